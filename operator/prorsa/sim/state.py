"""The simulator's moving parts: a trajectory's progress, a queued prefill, a worker's state."""

from __future__ import annotations

from collections import OrderedDict, deque

from prorsa.policy.allocate import Role
from prorsa.sim.workload import TrajectoryScript


class TrajRun:
    __slots__ = (
        "context",
        "dec_ctx",
        "decode_home",
        "ended_at",
        "gjoin",
        "idx",
        "in_decode",
        "joined_at",
        "phase_t0",
        "prefill_home",
        "script",
        "started_at",
        "submitted_at",
        "target",
        "tool_until",
        "turn",
    )

    def __init__(self, idx: int, script: TrajectoryScript) -> None:
        self.idx = idx
        self.script = script
        self.turn = 0
        self.context = 0  # tokens whose KV exists after the current turn's prefill
        self.decode_home = -1
        self.prefill_home = -1
        self.started_at = -1.0
        self.ended_at = -1.0
        self.dec_ctx = 0
        self.gjoin = 0.0
        self.in_decode = -1  # worker decoding it, or -1
        self.tool_until = -1.0
        self.phase_t0 = 0.0  # when the current phase's request was sent (for event timings)
        self.submitted_at = 0.0  # this turn's submission (its time to first token)
        self.joined_at = 0.0  # this turn's first decode step (its inter-token latency)
        self.target = 0.0  # decode: the worker's G at which this sequence finishes


class PrefillJob:
    __slots__ = ("compute", "ctx", "local", "remaining", "started", "traj")

    def __init__(self, traj: TrajRun, compute: int, ctx: int, local: bool) -> None:
        self.traj = traj
        self.compute = compute  # tokens to compute (prompt minus cached prefix)
        self.ctx = ctx  # cached prefix the new tokens attend to
        self.remaining = float(compute)
        self.local = local  # decode on the same worker (mixed / fallback) or transfer
        self.started = 0.0


class SimWorker:
    def __init__(self, idx: int, role: Role, kv_capacity: float) -> None:
        self.idx = idx
        self.id = f"w{idx}"
        self.role = role
        self.draining = False
        self.target_role: Role | None = None
        self.restarting = False
        self.kv_capacity = kv_capacity
        self.pq: deque[PrefillJob] = deque()
        self.queue_s = 0.0
        self.queue_tokens = 0
        self.heap: list[tuple[float, int, TrajRun]] = []
        self.G = 0.0
        self.count = 0
        self.ctx_sum = 0
        self.gjoin_sum = 0.0
        self.pending: deque[TrajRun] = deque()
        self.incoming = 0
        self.pulling = 0  # pool prefills waiting for their prefix KV (prefix-pull what-if)
        # Prefix cache: `cache` is the LRU of evictable prefixes; `pinned` holds those of the
        # sequences decoding here, which are never evicted (kept apart so eviction never scans
        # a large running batch). `cache_total` counts both.
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.pinned: dict[int, int] = {}
        self.cache_total = 0
        self.homed = 0  # trajectories whose decode sticks to this worker
        self.last_t = 0.0
        self.tau = 0.0
        self.p_rate = 0.0
        self.version = 0
        self.busy_s: dict[Role, float] = {r: 0.0 for r in Role}
        self.role_s: dict[Role, float] = {r: 0.0 for r in Role}
        self.role_since = 0.0

    def accepts(self, role: Role) -> bool:
        if self.draining or self.restarting:
            return False
        return self.role == role or self.role == Role.MIXED

    @property
    def kv_running(self) -> float:
        return self.ctx_sum + self.count * self.G - self.gjoin_sum

    def cached(self, traj_idx: int) -> int:
        c = self.cache.get(traj_idx)
        return self.pinned.get(traj_idx, 0) if c is None else c
