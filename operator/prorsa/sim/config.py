"""What one simulated rollout is asked to do and what it reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from prorsa.policy.allocate import AllocationSettings
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.placement import PlacementSettings

Mode = Literal["sync", "async"]


class SimulationTooLong(RuntimeError):
    """The rollout did not finish within `SimConfig.max_sim_s` simulated seconds."""


@dataclass
class SimConfig:
    gpus: int
    mode: Mode = "sync"
    trajectories: int = 0  # 0: `per_gpu` per GPU (sync) or 2x the concurrency (async)
    concurrency: int = 0  # async: trajectories in flight (0: `per_gpu` per GPU)
    per_gpu: int = 16  # the workload's typical batch per GPU
    seed: int = 0
    settings: AllocationSettings = field(default_factory=AllocationSettings)
    tool_events: bool = True  # clients send tool_start/tool_end hints through the router
    shadow_forecasters: tuple[str, ...] = ("last", "ewma", "lifecycle")
    placement: PlacementSettings = field(default_factory=PlacementSettings)  # router rules
    # What-if: a prefill worker pulls the prefix KV a trajectory's decode worker holds (over
    # the KV link) instead of recomputing it. The real workers cannot yet: vLLM's NIXL
    # connector moves KV from prefill to decode only.
    prefix_pull: bool = False
    max_sim_s: float = 7 * 24 * 3600.0
    # What the allocator believes before it sees the cluster (None: the true cost's capacity),
    # and whether it learns the real one online from its workers (`policy/learn.py`).
    capacity_prior: RoleCapacity | None = None
    learn_capacity: bool = False

    def workers(self, gpus_per_worker: int) -> int:
        """Engine units of `gpus_per_worker` GPUs the cluster holds (what the policy splits)."""
        n = self.gpus // gpus_per_worker
        if n < 2:
            raise ValueError(
                f"{self.gpus} GPUs make {n} worker(s) of {gpus_per_worker} GPUs; the simulator "
                "needs at least 2 (one per role)"
            )
        return n

    def resolved(self) -> SimConfig:
        if self.gpus < 2:
            raise ValueError("the simulator needs at least 2 GPUs (one per role)")
        conc = self.concurrency or self.per_gpu * self.gpus
        n = self.trajectories or (self.per_gpu * self.gpus if self.mode == "sync" else 2 * conc)
        return replace(self, trajectories=n, concurrency=conc)


@dataclass
class TimelinePoint:
    """One decision's view of a run: roles, demand (forecast for the next step and what
    actually came) and the capacity the roles gave. `prorsa simulate` and `prorsa local`
    record the same points, so their plots compare picture to picture."""

    t: float
    prefill: int
    decode: int
    mixed: int
    forecast_prefill_tps: float
    actual_prefill_tps: float
    forecast_decode: float
    actual_decode: int
    prefill_capacity_tps: float = 0.0  # what the prefill workers can compute per second
    forecast_decode_kv: float = 0.0  # KV tokens of the sequences decoding
    actual_decode_kv: float = 0.0
    decode_kv_capacity: float = 0.0  # KV tokens the decode (and mixed) workers hold


def timeline_row(p: TimelinePoint) -> dict[str, float]:
    """A timeline point as JSON, rounded to what a plot or a reader needs."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(p).items()}


@dataclass
class SimResult:
    policy: str
    mode: Mode
    makespan_s: float
    throughput_traj_per_min: float
    p50_completion_s: float
    p99_completion_s: float
    prefill_util: float
    decode_util: float
    switches: int
    trajectories: int
    turns: int
    output_tokens: int
    prefill_tokens_computed: int
    decisions: int
    forecast_mape: dict[str, dict[str, float]]
    timeline: list[TimelinePoint]
    wall_s: float = 0.0
    label: str = ""
    # Per turn: time to first token (queueing, prefill, KV transfer) and the mean inter-token
    # latency of its decode, p50 and p99: where prefill interference shows.
    ttft_s: tuple[float, float] = (0.0, 0.0)
    itl_s: tuple[float, float] = (0.0, 0.0)
    completions_s: list[float] = field(default_factory=list)  # per trajectory, sorted


def p50_p99(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return (0.0, 0.0)
    v = sorted(xs)
    return v[len(v) // 2], v[min(len(v) - 1, int(0.99 * len(v)))]
