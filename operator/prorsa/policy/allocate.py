"""Allocation policies: how many workers should prefill and how many should decode.

Every policy answers one question with the same interface: given the cluster as it is now
(`ClusterView`) and, if it wants one, a demand forecast, what allocation should it have? The
shared `Policy.decide` then applies the limits every policy must respect (minimum counts,
cooldown, a cap on switches per decision) and `plan_switches` turns the difference into
concrete worker switches, preferring idle workers and never switching a worker twice at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from enum import StrEnum

from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.forecast import MIN_EVIDENCE, Forecast, Horizon


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # colocated: serves both phases


@dataclass(frozen=True, slots=True)
class AllocationSettings:
    """Every policy knob, with its default, in one place (the CRD's `allocation` mirrors it)."""

    policy: str = "predictive"
    static_prefill: int | None = None  # static: prefill workers (default: a quarter)
    min_prefill: int = 0  # 0: decode workers may prefill locally when no pool is worth it
    initial_prefill: int | None = None  # prefill workers at start (None: min_prefill)
    min_decode: int = 1
    horizon_s: float = 60.0
    interval_s: float = 5.0
    cooldown_s: float = 10.0
    hysteresis: float = 0.05  # predictive: grow the prefill pool only for this relative gain
    max_switches_per_decision: int = 4
    min_evidence: int = MIN_EVIDENCE  # predictive: decodes to see before trusting a forecast
    # reactive thresholds (Dynamo-style load planner)
    reactive_prefill_wait_up_s: float = 1.0
    reactive_prefill_wait_down_s: float = 0.2
    reactive_kv_util_up: float = 0.8
    reactive_kv_util_down: float = 0.5

    @property
    def horizon(self) -> Horizon:
        """The forecast horizon: one step per decision interval."""
        return Horizon(self.interval_s, max(1, round(self.horizon_s / self.interval_s)))


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: str
    role: Role
    draining: bool = False
    target_role: Role | None = None
    ready: bool = True
    inflight_prefill: int = 0
    inflight_decode: int = 0
    queued_prefill_tokens: int = 0
    kv_tokens: float = 0.0

    @property
    def effective_role(self) -> Role:
        """The role this worker is heading to: its target while draining."""
        return self.target_role if self.draining and self.target_role else self.role

    @property
    def load(self) -> float:
        return self.inflight_prefill + self.inflight_decode + self.kv_tokens * 1e-6


@dataclass(frozen=True, slots=True)
class ClusterView:
    workers: tuple[WorkerView, ...]

    def count(self, role: Role) -> int:
        return sum(1 for w in self.workers if w.effective_role == role)

    @property
    def allocation(self) -> Allocation:
        return Allocation(self.count(Role.PREFILL), self.count(Role.DECODE), self.count(Role.MIXED))

    @property
    def prefill_queue_tokens(self) -> int:
        return sum(w.queued_prefill_tokens for w in self.workers)

    @property
    def decode_seqs(self) -> int:
        return sum(w.inflight_decode for w in self.workers)

    @property
    def decode_kv_tokens(self) -> float:
        return sum(w.kv_tokens for w in self.workers if w.role != Role.PREFILL)


@dataclass(frozen=True, slots=True)
class Allocation:
    prefill: int
    decode: int
    mixed: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.mixed

    def __str__(self) -> str:
        if self.mixed and not (self.prefill or self.decode):
            return f"{self.mixed}M"
        s = f"{self.prefill}P:{self.decode}D"
        return s + (f":{self.mixed}M" if self.mixed else "")


@dataclass(frozen=True, slots=True)
class Switch:
    worker: str
    from_role: Role
    to_role: Role


@dataclass(slots=True)
class Decision:
    target: Allocation
    switches: list[Switch]
    reason: str
    forecast: Forecast | None = None


@dataclass
class Policy(ABC):
    settings: AllocationSettings
    capacity: RoleCapacity
    name: str = "policy"
    uses_forecast: bool = False
    _last_switch_at: float = field(default=-math.inf, init=False)

    def initial_roles(self, n: int) -> list[Role]:
        """Start at `initial_prefill` (default: the minimum pool; decode workers prefill
        locally meanwhile). Where a switch restarts engines for minutes, a start near the
        expected split saves those restarts."""
        p = self.clamp(Allocation(self.settings.initial_prefill or 0, n), n).prefill
        return [Role.PREFILL] * p + [Role.DECODE] * (n - p)

    @abstractmethod
    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]: ...

    def clamp(self, a: Allocation, n: int) -> Allocation:
        """Respect min counts; with fewer workers than both minimums, keep one of each."""
        if a.mixed:
            return a
        min_p = min(self.settings.min_prefill, max(n - 1, 0))
        min_d = min(self.settings.min_decode, max(n - min_p, 0))
        p = max(min_p, min(a.prefill, n - min_d))
        return Allocation(p, n - p)

    @property
    def cooldown_s(self) -> float:
        """No policy can see whether its last switch helped until that switch is done, and
        what it learned under the old split (how much a pool recomputes, what decode workers
        evict) needs evidence from the new one: where a switch restarts engines, it waits at
        least twice that long between switches."""
        return max(self.settings.cooldown_s, 2.0 * self.capacity.switch_s)

    def decide(self, view: ClusterView, forecast: Forecast | None, now: float) -> Decision:
        current = view.allocation
        target, reason = self.target(view, forecast, now)
        target = self.clamp(target, len(view.workers))
        if target == current:
            return Decision(target, [], reason, forecast)
        if now - self._last_switch_at < self.cooldown_s:
            return Decision(current, [], f"cooldown (wanted {target}: {reason})", forecast)
        switches = plan_switches(view, target, self.settings.max_switches_per_decision)
        if switches:
            self._last_switch_at = now
        return Decision(target, switches, reason, forecast)


def plan_switches(view: ClusterView, target: Allocation, max_switches: int) -> list[Switch]:
    """Choose which workers change role to move toward `target`.

    Donors are the least-loaded workers of roles with a surplus; a worker already draining is
    never switched again; the last worker that can still decode is never drained. (Every
    worker can serve a whole request, so an empty prefill pool only means local prefills.)
    """
    current = view.allocation
    deficit = {
        Role.PREFILL: target.prefill - current.prefill,
        Role.DECODE: target.decode - current.decode,
        Role.MIXED: target.mixed - current.mixed,
    }
    receivers = [r for r, d in deficit.items() if d > 0 for _ in range(d)]
    if not receivers:
        return []
    active = {r: sum(1 for w in view.workers if w.role == r and not w.draining) for r in Role}
    donors = sorted(
        (w for w in view.workers if not w.draining and deficit[w.role] < 0 and w.ready),
        key=lambda w: w.load,
    )
    plan: list[Switch] = []
    for w in donors:
        if len(plan) >= max_switches or not receivers or deficit[w.role] >= 0:
            continue
        can_decode = active[Role.DECODE] + active[Role.MIXED] - (w.role != Role.PREFILL)
        if can_decode < 1:
            continue
        to = receivers.pop(0)
        plan.append(Switch(w.id, w.role, to))
        deficit[w.role] += 1
        active[w.role] -= 1
    return plan


# ---- the policies ---------------------------------------------------------------------------


@dataclass
class ColocatedPolicy(Policy):
    """Every worker serves both phases (vLLM with chunked prefill): the usual baseline."""

    name: str = "colocated"

    def initial_roles(self, n: int) -> list[Role]:
        return [Role.MIXED] * n

    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]:
        return Allocation(0, 0, len(view.workers)), "colocated: every worker mixed"


@dataclass
class StaticPolicy(Policy):
    """A fixed P:D split, as a user would pick by hand."""

    name: str = "static"

    def _split(self, n: int) -> Allocation:
        p = self.settings.static_prefill
        return self.clamp(Allocation(max(1, n // 4) if p is None else p, 0), n)

    def initial_roles(self, n: int) -> list[Role]:
        p = self._split(n).prefill
        return [Role.PREFILL] * p + [Role.DECODE] * (n - p)

    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]:
        a = self._split(len(view.workers))
        return a, f"static split {a}"


@dataclass
class ReactivePolicy(Policy):
    """Threshold rules on current load, one worker at a time (like Dynamo's load planner)."""

    name: str = "reactive"

    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]:
        s, cap = self.settings, self.capacity
        cur = view.allocation
        p = max(cur.prefill, 1)
        d = max(cur.decode, 1)
        wait = view.prefill_queue_tokens / (p * cap.prefill_tokens_per_s)
        kv_util = view.decode_kv_tokens / (d * cap.kv_capacity_tokens)
        prefill_hot = wait > s.reactive_prefill_wait_up_s
        prefill_cold = wait < s.reactive_prefill_wait_down_s
        decode_hot = kv_util > s.reactive_kv_util_up
        decode_cold = kv_util < s.reactive_kv_util_down
        facts = f"prefill wait {wait:.2f}s, decode KV {kv_util:.0%}"
        # Back-pressure: while decode KV is full, prefilled requests wait for room, so a
        # hot decode side wins over a hot prefill queue (holding on "both hot" starved decode).
        if decode_hot and cur.prefill > 0:
            return replace(cur, prefill=cur.prefill - 1, decode=cur.decode + 1), f"{facts}: +D"
        if prefill_hot and not decode_hot:
            return replace(cur, prefill=cur.prefill + 1, decode=cur.decode - 1), f"{facts}: +P"
        if prefill_cold and not decode_cold and cur.prefill > 0:
            return replace(cur, prefill=cur.prefill - 1, decode=cur.decode + 1), f"{facts}: +D"
        return cur, f"{facts}: hold"


@dataclass
class PredictivePolicy(Policy):
    """Prorsa: choose P and D minimising the trajectory-seconds the forecast says are lost.

    Over the horizon, for each candidate split, it plays the forecast forward: the pool takes
    its share of the prefill demand up to its capacity, priced at what it computes (more than
    a decode worker would: the context that worker holds), and the rest is prefilled on the
    decode workers between their steps; decode sequences slow down as batches, KV reads and
    local prefills grow on D workers, and stall outright when their KV does not fit. The
    forecast was observed at the current split's pace: at another pace sequences stay longer
    or shorter (Little's law). Workers that must switch contribute nothing until their
    switch completes, and a decode worker that leaves takes the contexts it caches with it.
    A larger prefill pool wins only if it beats the current split by the hysteresis; a
    smaller one wins on any gain (a pool that stopped paying goes back to decode).
    """

    name: str = "predictive"
    uses_forecast: bool = True

    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]:
        cur = view.allocation
        n = len(view.workers)
        if forecast is None or cur.mixed:
            return cur, "no forecast yet: hold"
        if forecast.evidence < self.settings.min_evidence:
            seen = f"{forecast.evidence:.0f}/{self.settings.min_evidence}"
            return cur, f"learning ({seen} decodes seen): hold"
        lo = min(self.settings.min_prefill, n - 1)
        hi = n - min(self.settings.min_decode, n - lo)
        cur_cost = self.cost(forecast, cur.prefill, cur.prefill, n)
        best_p, best_cost = cur.prefill, cur_cost
        # Coarse grid over the whole range, then every split around the best: the cost is
        # smooth in P, and a 256-worker cluster needs ~40 evaluations instead of 256.
        stride = max(1, (hi - lo) // 24)
        coarse = [*range(lo, hi + 1, stride), hi]
        for p in coarse:
            c = self.cost(forecast, p, cur.prefill, n)
            if c < best_cost - 1e-9:
                best_p, best_cost = p, c
        for p in range(max(lo, best_p - stride + 1), min(hi, best_p + stride - 1) + 1):
            c = self.cost(forecast, p, cur.prefill, n)
            if c < best_cost - 1e-9:
                best_p, best_cost = p, c
        gain = cur_cost - best_cost
        facts = (
            f"forecast prefill {forecast.prefill_tokens_per_s[0]:.0f} tok/s"
            f" +{forecast.prefill_backlog_tokens:.0f} queued,"
            f" decode {forecast.decode_seqs[0]:.0f}->{forecast.decode_seqs[-1]:.0f} seqs;"
            f" lost {cur_cost:.0f}->{best_cost:.0f} traj-s"
        )
        # Hysteresis guards growing the prefill pool only: the cost is a sum of trajectory-
        # seconds most of which no split can save, so a few percent of it is a large real
        # difference, and a pool that has stopped paying for itself goes back to decode.
        needed = 0.0 if best_p < cur.prefill else self.settings.hysteresis * max(cur_cost, 1.0)
        if best_p == cur.prefill or gain <= needed:
            return cur, f"{facts}: hold {cur}"
        target = Allocation(best_p, n - best_p)
        return target, f"{facts}: {cur}->{target}"

    def cost(self, fc: Forecast, p: int, cur_p: int, n: int) -> float:
        """Trajectory-seconds lost over the horizon if the cluster had `p` prefill workers."""
        cap = self.capacity
        dt = fc.step_s
        mean_req = max(fc.mean_prefill_tokens, 1.0)
        # A switched worker drains and takes no new work of either role meanwhile, then
        # restarts: it serves neither role for that long. A decode worker drains for about
        # one decode's time; a prefill worker only for the request it is prefilling.
        if p > cur_p:
            drain_s = fc.mean_decode_s
        else:
            drain_s = mean_req / cap.prefill_rate(mean_req, cap.prefill_context)
        away_s = cap.switch_s + drain_s
        # Recompute scales with the share of live contexts the decode workers cannot hold
        # (the forecast saw it at the current split; fewer decode workers evict more).
        ev_now = _evicted(fc, n - cur_p, cap.kv_capacity_tokens)
        ev_p = _evicted(fc, n - p, cap.kv_capacity_tokens)
        # A returning turn recomputes its context where it was evicted: per token of demand,
        # the evicted share of a context per appended token, more (or less) than now.
        per_turn = fc.resident_kv_tokens / max(fc.live_trajectories, 1.0)
        more_recompute = (ev_p - ev_now) * per_turn / max(fc.mean_prefill_tokens, 1.0)
        # The forecast's sequences decode at the pace of the current split (its durations are
        # observed ones). At another pace they stay resident longer or shorter (Little's law):
        # the decoding population tends to the forecast's times the ratio of the paces, within
        # about one decode's time at the new pace.
        residency = max(fc.mean_decode_s, 1e-3)
        lost, surplus, ratio = 0.0, 0.0, 1.0
        # A decode worker that leaves takes the contexts it caches with it: the trajectories
        # it hosted recompute them when they return (over about one decode's time).
        held = min(fc.resident_kv_tokens / max(n - cur_p, 1), cap.kv_capacity_tokens)
        rehomed = max(p - cur_p, 0) * held
        for h in range(len(fc.decode_seqs)):
            # The workers leaving a role are gone from it at once; they join the other role
            # after `away_s`, part way through a horizon step.
            arrived = min(max(((h + 1) * dt - away_s) / dt, 0.0), 1.0)
            p_eff = min(p, cur_p) + arrived * max(p - cur_p, 0)
            d_eff = min(n - p, n - cur_p) + arrived * max(cur_p - p, 0)
            queued = fc.prefill_backlog_tokens if h == 0 else 0.0
            backlog = queued + (rehomed * min(dt / residency, 1.0) if h * dt < residency else 0.0)
            planned = fc.decode_seqs[h]
            if h > 0:
                settle = -math.expm1(-dt / (residency * ratio))
                surplus += (planned * (ratio - 1.0) - surplus) * settle
            seqs = max(planned + surplus, 0.0)
            step_lost, pace = self._step(fc, h, p_eff, d_eff, seqs, backlog, more_recompute)
            lost += step_lost
            if p_eff == cur_p and d_eff == n - cur_p and surplus == 0.0:
                ratio = 1.0  # the forecast's own split: no deviation from it
                continue
            _, pace_now = self._step(fc, h, cur_p, n - cur_p, planned, queued, 0.0)
            ratio = min(max(pace_now / max(pace, 1e-9), 0.1), 10.0)
        return lost

    def _step(self, fc: Forecast, h: int, p: float, d: float, seqs: float, backlog: float,
              more_recompute: float) -> tuple[float, float]:  # fmt: skip
        """(trajectory-seconds lost, decode pace relative to a lone sequence) in horizon step
        `h` with `p` prefill and `d` decode workers serving `seqs` decoding sequences."""
        cap, dt = self.capacity, fc.step_s
        mean_req = max(fc.mean_prefill_tokens, 1.0)
        # Prefill: the pool-worthy share goes to the prefill pool while the pool keeps up;
        # the router spills what it cannot take, and every short append, to the decode
        # workers, which prefill it between their decode steps.
        # A prefill attends to its trajectory's context (about a decoding sequence's KV).
        kv_seq = fc.decode_kv_tokens[h] / max(fc.decode_seqs[h], 1.0)
        slow = cap.prefill_slowdown(kv_seq)
        demand = fc.prefill_tokens_per_s[h] * max(1.0 + more_recompute, 0.0)
        # The pool computes more than its share of the demand: the context a trajectory's
        # decode worker holds and a pool worker does not (`pool_amplification`).
        remote = demand * fc.remote_prefill_share + backlog / dt
        # A pool request computes the turn's tokens and what it recomputes of the context.
        pool_rate = cap.prefill_rate(mean_req * fc.pool_amplification, kv_seq)
        served = min(remote, p * pool_rate / fc.pool_amplification)
        local = max(demand + backlog / dt - served, 0.0)  # the router spills what it cannot take
        if d <= 0:
            return seqs * dt, 0.0
        # Decode: progress lost to bigger batches, KV reads and local prefills; KV overflow
        # stalls.
        lost = 0.0
        kv_worker = seqs * kv_seq / d
        stalled = 0.0
        if kv_worker > cap.kv_capacity_tokens:
            stalled = 1.0 - cap.kv_capacity_tokens / kv_worker
            kv_worker = cap.kv_capacity_tokens
        batch = seqs * (1.0 - stalled) / d
        pure = cap.decode_step_s(batch, kv_worker)
        local_rate = cap.local_prefill_rate / slow
        busy = local / (d * local_rate)
        first = cap.local_prefill_first_s(mean_req, kv_seq)
        if first > 0 and local > 0:
            # The share of steps that carry an append: those steps last longer, so more
            # appends arrive during each (a few rounds settle the fixed point).
            rate, mixed, mean_step = local / d / mean_req, 0.0, pure
            for _ in range(4):
                mixed = -math.expm1(-rate * mean_step)
                mean_step = pure + mixed * first
            busy += mixed * first / mean_step
        if busy >= 0.95:  # decode workers cannot absorb it: the excess waits a step
            lost += (busy - 0.95) * d * local_rate * dt / mean_req * dt
            busy = 0.95
        step = pure / (1.0 - busy)
        pace = (1.0 - stalled) * min(1.0, cap.decode_step_s(1.0, kv_seq) / step)
        return lost + seqs * dt * (1.0 - pace), pace


def _evicted(fc: Forecast, decode_workers: int, kv_per_worker: float) -> float:
    """Share of the live trajectories' context that does not fit in the decode workers' KV."""
    if fc.resident_kv_tokens <= 0:
        return 0.0
    return max(0.0, 1.0 - decode_workers * kv_per_worker / fc.resident_kv_tokens)


POLICIES: dict[str, type[Policy]] = {
    "colocated": ColocatedPolicy,
    "static": StaticPolicy,
    "reactive": ReactivePolicy,
    "predictive": PredictivePolicy,
}


def make_policy(settings: AllocationSettings, capacity: RoleCapacity) -> Policy:
    """Build the policy `settings.policy` names (`oracle` is the predictive policy fed a
    perfect forecast; only the simulator can provide one)."""
    name = settings.policy
    if name == "oracle":
        return PredictivePolicy(settings, capacity, name="oracle")
    try:
        cls = POLICIES[name]
    except KeyError:
        known = sorted([*POLICIES, "oracle"])
        raise ValueError(f"unknown policy {name!r}; choose one of {known}") from None
    return cls(settings, capacity)
