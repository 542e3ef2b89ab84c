"""Discrete-event simulator of one rollout cluster under one allocation policy.

The simulated cluster is the real system in miniature: a router that places each turn's
prefill (least uncached-token work, prefix-cache aware) and decode (sticky per trajectory;
`routing.SimRouter`), workers whose speed comes from `CostModel`, KV transfers between them,
tool calls, and a controller that every `interval_s` feeds the lifecycle events the router
would have written to the very same `LifecycleTable`, forecaster and `Policy` objects the
operator runs.

Workers advance as fluids between events: a decode batch shares one step time, so each worker
keeps a single "tokens generated per sequence" counter and a heap of finish targets, which
makes a batch change O(log batch) instead of O(batch). What a finished run reports is
`results.summarize`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

from prorsa.policy.allocate import (
    ClusterView,
    Decision,
    Policy,
    Role,
    WorkerView,
    make_policy,
)
from prorsa.policy.events import Event, EventType, State
from prorsa.policy.forecast import Forecast, Forecaster, ForecastScorer
from prorsa.policy.forecasters import make_forecaster
from prorsa.policy.learn import CapacityEstimator
from prorsa.policy.lifecycle import LifecycleTable
from prorsa.sim.config import (
    SimConfig,
    SimResult,
    SimulationTooLong,
    TimelinePoint,
)
from prorsa.sim.costmodel import Cost
from prorsa.sim.results import summarize
from prorsa.sim.roles import RoleCosts, role_costs
from prorsa.sim.routing import SimRouter
from prorsa.sim.state import PrefillJob, SimWorker, TrajRun
from prorsa.sim.workload import TrajectoryScript

# Heap event kinds
_WORKER, _KV_DONE, _TOOL_DONE, _ARRIVAL, _TICK, _SWITCH_DONE, _PREFIX_PULLED = range(7)
_EPS = 1e-6
_REFRESH_S = 5.0  # re-evaluate a decode segment at least this often (its KV keeps growing)


class Simulator:
    def __init__(
        self,
        cost: Cost | RoleCosts,
        scripts: list[TrajectoryScript],
        config: SimConfig,
        policy: Policy | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.cfg = config.resolved()
        self.settings = self.cfg.settings
        colocated = (policy.name if policy else self.settings.policy) == "colocated"
        self.costs = role_costs(cost).laid_out(colocated)
        self.cost = self.costs.decode  # transfers and the switch mode are the decode side's
        self.capacity = self.costs.role_capacity(colocated)
        self._prefill_tps = self.costs.prefill.role_capacity().prefill_tokens_per_s
        self.policy = policy or make_policy(self.settings, self.cfg.capacity_prior or self.capacity)
        self.learner = CapacityEstimator(self.policy.capacity) if self.cfg.learn_capacity else None
        self.trajs = [TrajRun(i, s) for i, s in enumerate(scripts)]
        roles = self.policy.initial_roles(self.cfg.workers(self.costs.slot_gpus(colocated)))
        self.workers = [
            SimWorker(i, r, self.costs.of(r).kv_capacity_tokens) for i, r in enumerate(roles)
        ]
        self._by_id = {w.id: w for w in self.workers}
        self.router = SimRouter(self.workers, self.costs, self.cfg)
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._dec_seq = itertools.count()
        self.events: list[Event] = []
        self.table = LifecycleTable()
        self.horizon = self.settings.horizon
        self.shadows: dict[str, Forecaster] = {
            name: make_forecaster(name, self.cfg.mode, self.settings.min_evidence)
            for name in self.cfg.shadow_forecasters
        }
        self.scorers = {name: ForecastScorer(self.horizon) for name in self.shadows}
        self.oracle_forecast: Callable[[Simulator], Forecast] | None = None
        self.switches = 0
        self.decisions = 0
        self.done = 0
        self.started = 0
        self.turns_done = 0
        self.output_tokens = 0
        self.prefill_computed = 0
        self.timeline: list[TimelinePoint] = []
        self._last_submitted = 0
        self._last_tick = 0.0
        self.progress = progress
        self.admission_closed_at = math.inf
        self.completions: list[float] = []
        self.ttfts: list[float] = []  # per turn: submission to first decode step
        self.itls: list[float] = []  # per turn: decode seconds per output token
        self.last_decision: Decision | None = None
        self.event_log: list[Event] | None = None  # set to a list to keep every event

    # ---- event queue ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _emit(self, etype: EventType, traj: TrajRun, **fields: object) -> None:
        ev = Event(etype, traj.script.id, self.now, **fields)  # type: ignore[arg-type]
        self.events.append(ev)
        if self.event_log is not None:
            self.event_log.append(ev)

    # ---- main loop --------------------------------------------------------------------------

    def run(self) -> SimResult:
        import time

        wall0 = time.perf_counter()
        cfg = self.cfg
        if cfg.mode == "sync":
            for tr in self.trajs:
                self._push(0.0, _ARRIVAL, tr)
            self.admission_closed_at = 0.0
        else:
            first = min(cfg.concurrency, len(self.trajs))
            ramp = 30.0  # stagger the first wave, as an async trainer would
            for i in range(first):
                self._push(ramp * i / max(first, 1), _ARRIVAL, self.trajs[i])
            self._next_admit = first
            if first >= len(self.trajs):
                self.admission_closed_at = ramp
        self._push(0.0, _TICK, None)
        total = len(self.trajs)
        while self._heap and self.done < total:
            t, _, kind, payload = heapq.heappop(self._heap)
            if t > cfg.max_sim_s:
                raise SimulationTooLong(
                    f"simulation exceeded {cfg.max_sim_s:.0f} simulated seconds"
                )
            self.now = t
            if kind == _WORKER:
                worker, version = payload
                if worker.version == version:
                    self._on_worker(worker)
            elif kind == _TOOL_DONE:
                self._on_tool_done(payload)
            elif kind == _KV_DONE:
                tr, worker = payload
                worker.incoming -= 1
                self._decode_join(worker, tr)
                self._check_drained(worker)
            elif kind == _ARRIVAL:
                self._on_arrival(payload)
            elif kind == _TICK:
                self._on_tick()
            elif kind == _PREFIX_PULLED:
                job, worker = payload
                worker.pulling -= 1
                self._enqueue_prefill(worker, job)
            elif kind == _SWITCH_DONE:
                payload.restarting = False
                self.router.invalidate()
                self._drain_pending_everywhere()
                self._reschedule(payload)
        for w in self.workers:
            self._advance(w)
            w.role_s[w.role] += self.now - w.role_since
        return summarize(self, time.perf_counter() - wall0)

    # ---- trajectories -----------------------------------------------------------------------

    def _on_arrival(self, tr: TrajRun) -> None:
        tr.started_at = self.now
        self.started += 1
        self._emit(EventType.TRAJ_START, tr, group=tr.script.group)
        self._submit_turn(tr)

    def _submit_turn(self, tr: TrajRun) -> None:
        turn = tr.script.turns[tr.turn]
        prompt = tr.context + turn.new_tokens
        w, local, worthy = self.router.place_prefill(tr, prompt, turn.new_tokens)
        cached = min(w.cached(tr.idx), prompt - 1)
        pull = self._prefix_to_pull(tr, w, local, prompt)
        cached += pull
        compute = max(prompt - cached, 1)
        home = self.workers[tr.decode_home] if tr.decode_home >= 0 else None
        held = min(home.cached(tr.idx), prompt - 1) if home is not None else 0
        if not local and w.accepts(Role.DECODE):
            # a trajectory moved to a new home: its old one, which holds the prefix, prefills
            # the turn and hands the KV over (the new home holds nothing yet)
            held = max(held, min(w.cached(tr.idx), prompt - 1))
        self._emit(
            EventType.TURN_SUBMIT,
            tr,
            prompt_tokens=prompt,
            uncached_tokens=compute,
            remote=worthy,
            held_tokens=held,
            pool_tokens=compute if not local else self._pool_tokens(tr, prompt, held),
        )
        tr.context = prompt
        tr.phase_t0 = tr.submitted_at = self.now
        job = PrefillJob(tr, compute, cached, local)
        if pull:
            w.pulling += 1
            self._push(self.now + self.cost.kv_transfer_s(pull), _PREFIX_PULLED, (job, w))
            return
        self._enqueue_prefill(w, job)

    def _pool_tokens(self, tr: TrajRun, prompt: int, held: int) -> int:
        """What a prefill worker would compute for a turn prefilled elsewhere: the prompt
        less what the worker that prefilled this trajectory before still caches (or, with
        a prefix pull, what its decode worker holds)."""
        cached = 0
        if tr.prefill_home >= 0 and self.workers[tr.prefill_home].role is Role.PREFILL:
            cached = self.workers[tr.prefill_home].cached(tr.idx)
        if self.cfg.prefix_pull:
            cached = max(cached, held)
        return max(prompt - cached, 1)

    def _prefix_to_pull(self, tr: TrajRun, w: SimWorker, local: bool, prompt: int) -> int:
        """Prefix tokens a pool prefill pulls from the trajectory's decode worker (what-if)."""
        if not self.cfg.prefix_pull or local or tr.decode_home < 0 or tr.decode_home == w.idx:
            return 0
        held = min(self.workers[tr.decode_home].cached(tr.idx), prompt - 1)
        return max(held - min(w.cached(tr.idx), prompt - 1), 0)

    def _enqueue_prefill(self, w: SimWorker, job: PrefillJob) -> None:
        self._advance(w)
        w.pq.append(job)
        w.queue_s += self.costs.of(w.role).prefill_s(job.compute, job.ctx)
        w.queue_tokens += job.compute
        self._reschedule(w)

    def _on_tool_done(self, tr: TrajRun) -> None:
        if self.cfg.tool_events:
            self._emit(EventType.TOOL_END, tr)
        self._submit_turn(tr)

    def _after_decode(self, tr: TrajRun) -> None:
        turn = tr.script.turns[tr.turn]
        self._emit(
            EventType.DECODE_DONE,
            tr,
            output_tokens=turn.output_tokens,
            seconds=self.now - tr.phase_t0,
        )
        self.turns_done += 1
        self.output_tokens += turn.output_tokens
        if turn.output_tokens > 0:
            self.itls.append((self.now - tr.joined_at) / turn.output_tokens)
        tr.turn += 1
        if tr.turn >= len(tr.script.turns):
            tr.ended_at = self.now
            self.router.set_home(tr, None)
            self.done += 1
            self.completions.append(self.now)
            self._emit(EventType.TRAJ_END, tr, reason="done")
            if self.cfg.mode == "async" and self._next_admit < len(self.trajs):
                self._push(self.now, _ARRIVAL, self.trajs[self._next_admit])
                self._next_admit += 1
                if self._next_admit >= len(self.trajs):
                    self.admission_closed_at = self.now
            return
        if self.cfg.tool_events:
            self._emit(EventType.TOOL_START, tr)
        tr.tool_until = self.now + turn.tool_s
        self._push(tr.tool_until, _TOOL_DONE, tr)

    # ---- worker dynamics ------------------------------------------------------------------

    def _advance(self, w: SimWorker) -> None:
        dt = self.now - w.last_t
        if dt > 0:
            if w.count and w.tau > 0:
                w.G += dt / w.tau
            if w.pq and w.p_rate > 0:
                w.pq[0].remaining -= dt * w.p_rate
            if w.count or w.pq:
                w.busy_s[w.role] += dt
        w.last_t = self.now

    def _reschedule(self, w: SimWorker) -> None:
        w.version += 1
        b = w.count
        cost = self.costs.of(w.role)
        nxt = math.inf
        if w.restarting:
            w.tau = w.p_rate = 0.0
            return
        if w.pq:
            job = w.pq[0]
            done = job.compute - job.remaining
            jobs = len(w.pq)
            if b == 0:
                # A unit's ranks prefill one job each: fewer jobs than ranks leave ranks idle.
                busy = min(jobs, cost.dp_ranks) / cost.dp_ranks
                w.p_rate = busy * job.compute / max(cost.prefill_s(job.compute, job.ctx), _EPS)
            else:
                queued = job.remaining + w.queue_tokens - job.compute
                chunk = cost.mixed_chunk_tokens(b, queued, jobs)
                w.tau = cost.mixed_step_s(b, w.kv_running, chunk, job.ctx + done, jobs)
                w.p_rate = chunk / w.tau
            nxt = max(job.remaining, 0.0) / w.p_rate
        if b:
            rem = max(w.heap[0][0] - w.G, 0.0)
            if not w.pq:
                kv_mid = w.kv_running + b * min(rem, _REFRESH_S / max(w.tau, 1e-3)) / 2
                w.tau = cost.decode_step_s(b, kv_mid)
            nxt = min(nxt, rem * w.tau, _REFRESH_S)
        if nxt < math.inf:
            self._push(self.now + max(nxt, 0.0), _WORKER, (w, w.version))

    def _on_worker(self, w: SimWorker) -> None:
        self._advance(w)
        while w.heap and w.heap[0][0] <= w.G + _EPS:
            _, _, tr = heapq.heappop(w.heap)
            self._decode_leave(w, tr)
            self._after_decode(tr)
        while w.pq and w.pq[0].remaining <= _EPS:
            job = w.pq.popleft()
            w.queue_s -= self.costs.of(w.role).prefill_s(job.compute, job.ctx)
            w.queue_tokens -= job.compute
            if w.pq:
                w.pq[0].started = self.now
            self._prefill_done(w, job)
        if not w.pq:
            w.queue_s = 0.0
        self._admit_pending(w)
        self._reschedule(w)
        self._check_drained(w)

    def _prefill_done(self, w: SimWorker, job: PrefillJob) -> None:
        tr = job.traj
        self.prefill_computed += job.compute
        self._emit(
            EventType.PREFILL_DONE,
            tr,
            worker=w.id,
            tokens=job.compute,
            seconds=self.now - tr.phase_t0,
        )
        if self.learner is not None and w.role is Role.PREFILL:  # the engine's prefill time
            compute_s = self.costs.of(w.role).prefill_s(job.compute, job.ctx)
            self.learner.observe_prefill(job.compute, job.ctx, compute_s, self.now)
        tr.phase_t0 = self.now
        self._cache_put(w, tr.idx, tr.context)
        if job.local:
            self._decode_join(w, tr)
            return
        d = self.router.place_decode(tr)
        transfer = tr.context - min(d.cached(tr.idx), tr.context)
        d.incoming += 1
        self._push(self.now + self.cost.kv_transfer_s(transfer), _KV_DONE, (tr, d))

    def _decode_join(self, w: SimWorker, tr: TrajRun) -> None:
        if w.kv_running + tr.context > w.kv_capacity and w.count > 0:
            w.pending.append(tr)  # no KV room: wait for a running sequence to finish
            return
        self._advance(w)
        turn = tr.script.turns[tr.turn]
        tr.dec_ctx = tr.context
        tr.joined_at = self.now
        self.ttfts.append(self.now - tr.submitted_at)
        tr.gjoin = w.G
        tr.in_decode = w.idx
        tr.target = w.G + turn.output_tokens
        heapq.heappush(w.heap, (tr.target, next(self._dec_seq), tr))
        w.count += 1
        w.ctx_sum += tr.context
        w.gjoin_sum += w.G
        self._cache_put(w, tr.idx, tr.context, pin=True)
        self._reschedule(w)

    def _decode_leave(self, w: SimWorker, tr: TrajRun) -> None:
        w.count -= 1
        w.ctx_sum -= tr.dec_ctx
        w.gjoin_sum -= tr.gjoin
        if w.count == 0:
            w.G = 0.0
            w.gjoin_sum = 0.0
        tr.in_decode = -1
        tr.context += tr.script.turns[tr.turn].output_tokens
        self._cache_put(w, tr.idx, tr.context)

    def _admit_pending(self, w: SimWorker) -> None:
        while w.pending and (w.count == 0 or w.kv_running + w.pending[0].context <= w.kv_capacity):
            self._decode_join(w, w.pending.popleft())

    def _drain_pending_everywhere(self) -> None:
        for w in self.workers:
            self._admit_pending(w)

    def _cache_put(self, w: SimWorker, traj_idx: int, tokens: int, pin: bool = False) -> None:
        """Prefix cache, LRU. `pin` while the sequence decodes on `w`: never evicted then."""
        old = w.cache.pop(traj_idx, None)
        if old is None:
            old = w.pinned.pop(traj_idx, None)
        if old is not None:
            w.cache_total -= old
        (w.pinned if pin else w.cache)[traj_idx] = tokens
        w.cache_total += tokens
        need = w.cache_total - w.kv_capacity
        if need <= 0:
            return
        victims = []
        freed = 0
        for k, v in w.cache.items():
            if freed >= need:
                break
            if k != traj_idx:
                victims.append(k)
                freed += v
        for k in victims:
            w.cache_total -= w.cache.pop(k)

    # ---- role switches --------------------------------------------------------------------

    def _apply(self, decision: Decision) -> None:
        for sw in decision.switches:
            w = self._by_id[sw.worker]
            if w.draining or w.role != sw.from_role:
                continue
            w.draining = True
            w.target_role = sw.to_role
            self.switches += 1
            self.router.invalidate()
            self._check_drained(w)

    def _check_drained(self, w: SimWorker) -> None:
        if not w.draining or w.target_role is None:
            return
        old = w.role
        busy_prefill = bool(w.pq or w.pulling) and old in (Role.PREFILL, Role.MIXED)
        # A decode worker's queued local prefills are turns it will decode: work of its role.
        busy_decode = (w.count or w.pending or w.incoming or w.pq) and old in (
            Role.DECODE,
            Role.MIXED,
        )
        if busy_prefill or busy_decode:
            return
        self._advance(w)
        w.role_s[w.role] += self.now - w.role_since
        w.role_since = self.now
        restart = self.costs.switch_s(old, w.target_role)
        w.role = w.target_role
        w.kv_capacity = self.costs.of(w.role).kv_capacity_tokens
        w.draining = False
        w.target_role = None
        self.router.invalidate()
        if restart > 0:
            w.restarting = True
            w.cache.clear()
            w.pinned.clear()
            w.cache_total = 0
            self._push(self.now + restart, _SWITCH_DONE, w)
        self._reschedule(w)

    # ---- the controller ---------------------------------------------------------------------

    def view(self) -> ClusterView:
        return ClusterView(
            tuple(
                WorkerView(
                    id=w.id,
                    role=w.role,
                    draining=w.draining,
                    target_role=w.target_role,
                    ready=not w.restarting,
                    inflight_prefill=len(w.pq),
                    inflight_decode=w.count + len(w.pending) + w.incoming,
                    queued_prefill_tokens=int(w.queue_tokens),
                    kv_tokens=w.kv_running,
                )
                for w in self.workers
            )
        )

    def _on_tick(self) -> None:
        now = self.now
        self.table.ingest(self.events)
        self.events = []
        table = self.table
        decoding = table.count(State.DECODE)
        forecasts: dict[str, Forecast] = {}
        for name, fc in self.shadows.items():
            self.scorers[name].record_actual(now, table.submitted_tokens_total, decoding)
            forecasts[name] = fc.forecast(table, now, self.horizon)
            self.scorers[name].record_forecast(now, forecasts[name])
        policy_fc: Forecast | None = None
        if self.policy.name == "oracle" and self.oracle_forecast is not None:
            policy_fc = self.oracle_forecast(self)
        elif self.policy.uses_forecast:
            policy_fc = forecasts.get("lifecycle") or make_forecaster(
                "lifecycle", self.cfg.mode, self.settings.min_evidence
            ).forecast(table, now, self.horizon)
        if self.learner is not None:
            self._learn(self.learner)
        decision = self.policy.decide(self.view(), policy_fc, now)
        self.decisions += 1
        self.last_decision = decision
        self._apply(decision)
        dt = now - self._last_tick if now > self._last_tick else 1.0
        alloc = self.view().allocation
        shown = policy_fc or forecasts.get("lifecycle")
        self.timeline.append(
            TimelinePoint(
                t=now,
                prefill=alloc.prefill,
                decode=alloc.decode,
                mixed=alloc.mixed,
                forecast_prefill_tps=shown.prefill_tokens_per_s[0] if shown else 0.0,
                actual_prefill_tps=(table.submitted_tokens_total - self._last_submitted) / dt,
                forecast_decode=shown.decode_seqs[0] if shown else 0.0,
                actual_decode=decoding,
                prefill_capacity_tps=alloc.prefill * self._prefill_tps,
                forecast_decode_kv=shown.decode_kv_tokens[0] if shown else 0.0,
                actual_decode_kv=float(table.decode_context_tokens),
                decode_kv_capacity=sum(
                    w.kv_capacity for w in self.workers if w.role is not Role.PREFILL
                ),
            )
        )
        self._last_submitted = table.submitted_tokens_total
        self._last_tick = now
        if self.progress is not None:
            self.progress(self.done / max(len(self.trajs), 1))
        self._push(now + self.settings.interval_s, _TICK, None)

    def _learn(self, learner: CapacityEstimator) -> None:
        """What a worker's metrics tell between two decisions: each decoding worker's step at
        its batch and KV, its cache size; then the policy prices with what was learned."""
        for w in self.workers:
            if w.role is Role.DECODE and w.count and not w.pq and w.tau > 0:
                learner.observe_decode_step(w.count, w.kv_running, w.tau, self.now)
            if w.role is not Role.PREFILL:
                learner.observe_kv_capacity(w.id, w.kv_capacity)
        self.policy.capacity = learner.capacity()

    def invariant_violations(self) -> list[str]:
        """Bookkeeping that must hold at every instant (tests check it on every tick)."""
        bad = []
        for w in self.workers:
            if w.count < 0 or w.incoming < 0 or w.queue_tokens < 0 or w.homed < 0:
                bad.append(f"{w.id}: negative count/incoming/queue/homed")
            if w.count != len(w.heap):
                bad.append(f"{w.id}: batch count {w.count} != heap {len(w.heap)}")
            if w.cache_total != sum(w.cache.values()) + sum(w.pinned.values()):
                bad.append(f"{w.id}: cache total drifted")
            if w.queue_tokens != sum(j.compute for j in w.pq):
                bad.append(f"{w.id}: queued tokens drifted")
            if w.count and w.kv_running < -1e-6:
                bad.append(f"{w.id}: negative KV")
        return bad
