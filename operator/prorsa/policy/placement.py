"""Where a turn's prefill runs: the rules the router and the simulator share.

Prefill disaggregation pays only when the prefill pool can do the work without recomputing
what a decode worker already holds. So a short append to a context its decode worker holds
is prefilled there (conditional disaggregation, as NVIDIA Dynamo does); everything else
(first turns, long observations, evicted contexts) is "pool-worthy". A pool-worthy prefill
still stays local when the pool is saturated, or when the pool worker would recompute far
more than the append. Sticky decode placement keeps prefixes warm, but a worker hosting far
more trajectories than its share hands some to the least-loaded one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    local_prefill_max_tokens: int = 1024  # appends up to this stay on their decode worker
    prefill_spill_s: float = 1.0  # pool queue beyond this: prefill locally instead
    remote_recompute_factor: float = 2.0  # pool would compute > this x the append: stay local
    rebalance_over: float = 1.25  # a worker hosting > this x the mean (plus slack) sheds load
    rebalance_slack: int = 2
    rebalance_under: float = 0.5  # a worker hosting < this x the mean takes any surplus


def pool_worthy(s: PlacementSettings, holds_prefix: bool, new_tokens: int) -> bool:
    """Whether a prefill pool should take this turn (reported even when no pool exists)."""
    return not (holds_prefix and new_tokens <= s.local_prefill_max_tokens)


def stays_local(
    s: PlacementSettings,
    holds_prefix: bool,
    new_tokens: int,
    pool_queue_s: float,
    pool_compute_tokens: int,
) -> bool:
    """A pool-worthy turn that the decode worker should prefill anyway."""
    if pool_queue_s > s.prefill_spill_s:
        return True
    return holds_prefix and pool_compute_tokens > s.remote_recompute_factor * new_tokens


def sheds_load(s: PlacementSettings, hosted: int, mean_hosted: float, least_hosted: int) -> bool:
    """Whether a worker should hand its next turn to the least-loaded worker: when it hosts
    far more than its share, or when some worker hosts far less (it just joined the decode
    pool after a role switch or a scale-up, and sticky placement alone would leave it idle)."""
    if hosted > s.rebalance_over * mean_hosted + s.rebalance_slack:
        return True
    return hosted > mean_hosted and least_hosted < s.rebalance_under * mean_hosted
