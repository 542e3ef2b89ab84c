"""What a finished simulation reports: makespan or throughput, completion percentiles,
utilisation per role, and the TTFT and ITL distributions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prorsa.policy.allocate import Role
from prorsa.sim.config import SimResult, p50_p99

if TYPE_CHECKING:
    from prorsa.sim.engine import Simulator


def summarize(sim: Simulator, wall_s: float) -> SimResult:
    """The figures a run reports, from the finished simulator."""
    ended = [tr for tr in sim.trajs if tr.ended_at >= 0]
    durations = sorted(tr.ended_at - tr.started_at for tr in ended)
    makespan = max((tr.ended_at for tr in ended), default=0.0)
    if sim.cfg.mode == "sync":
        throughput = 60.0 * len(ended) / makespan if makespan > 0 else 0.0
    else:
        # steady state: from the first wave's completion to the last admission
        conc = sim.cfg.concurrency
        comps = sim.completions
        t0 = comps[min(conc, len(comps)) - 1] if comps and len(comps) > conc else 0.0
        t1 = sim.admission_closed_at
        inside = sum(1 for c in comps if t0 < c <= t1)
        if t1 > t0 and inside > 0:
            throughput = 60.0 * inside / (t1 - t0)
        else:
            throughput = 60.0 * len(ended) / makespan if makespan > 0 else 0.0

    def pct(q: float) -> float:
        if not durations:
            return 0.0
        return durations[min(len(durations) - 1, int(q * len(durations)))]

    def util(roles: tuple[Role, ...]) -> float:
        busy = sum(w.busy_s[r] for w in sim.workers for r in roles)
        total = sum(w.role_s[r] for w in sim.workers for r in roles)
        return busy / total if total else 0.0

    return SimResult(
        policy=sim.policy.name,
        mode=sim.cfg.mode,
        makespan_s=makespan,
        throughput_traj_per_min=throughput,
        p50_completion_s=pct(0.5),
        p99_completion_s=pct(0.99),
        prefill_util=util((Role.PREFILL, Role.MIXED)),
        decode_util=util((Role.DECODE, Role.MIXED)),
        switches=sim.switches,
        trajectories=len(ended),
        turns=sim.turns_done,
        output_tokens=sim.output_tokens,
        prefill_tokens_computed=sim.prefill_computed,
        decisions=sim.decisions,
        forecast_mape={n: s.mape() for n, s in sim.scorers.items()},
        timeline=sim.timeline,
        wall_s=wall_s,
        label=sim.policy.name,
        ttft_s=p50_p99(sim.ttfts),
        itl_s=p50_p99(sim.itls),
        completions_s=durations,
    )
