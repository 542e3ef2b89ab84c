"""The control loop: events in, role switches out.

    stream ─▶ lifecycle table ─▶ forecast(horizon) ─▶ policy.decide ─▶ switch protocol
                                                                  (drain, wait, relabel)

The decisions are the very objects the simulator runs (`prorsa.policy`); this module only adds
I/O: a consumer-group reader, a `Cluster` to read workers from and switch them on, metrics and
logs. Safety rules: a worker is never switched twice at once; a switch left half-done by a
previous controller is finished (or rolled back) on start; while Redis or the cluster cannot be
read, no decision is made and the allocation stays as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from prorsa.cancellation import raise_if_cancelled
from prorsa.control.cluster import Cluster, ClusterUnavailable, WorkerStatus
from prorsa.control.engine_metrics import EngineEvidence, parse_engine_metrics
from prorsa.control.metrics import ControllerMetrics
from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events.stream import EventReader
from prorsa.policy.allocate import (
    AllocationSettings,
    ClusterView,
    Decision,
    Policy,
    Role,
    WorkerView,
    make_policy,
)
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.forecast import Forecast, RolloutMode
from prorsa.policy.forecasters import make_forecaster
from prorsa.policy.learn import CapacityEstimator
from prorsa.policy.lifecycle import LifecycleTable
from prorsa.policy.lifecycle_forecast import LifecycleForecaster

log = logging.getLogger(__name__)


@dataclass
class ControllerConfig:
    settings: AllocationSettings
    capacity: RoleCapacity
    mode: RolloutMode = "sync"
    drain_timeout_s: float = 120.0
    settle_s: float = 1.0  # routers' discovery lag: see control.switch
    read_block_ms: int = 250
    switch_mode: str = "routing"  # restart: a drain also waits for the engine to be idle
    max_backoff_s: float = 10.0
    # on stop: True waits for switches in progress; False leaves them as they are (their state
    # is on the workers) for the next controller to finish — an operator shutting down must
    # not hold its pod for a whole drain timeout
    finish_switches_on_stop: bool = True
    # learn the capacity online from the workers' engine metrics, `capacity` as the prior
    # (`policy/learn.py`); False: price every split with `capacity` as given
    learn_capacity: bool = False
    capacity_prior_rel_sd: float = 0.5  # how far the prior may be off (1 sd, relative)


def capacity_text(c: RoleCapacity) -> str:
    """A capacity in one line, as the decision log shows what the allocator prices with."""
    return (
        f"prefill {c.prefill_tokens_per_s:.0f} tok/s ({1e3 * c.prefill_request_s:.1f} ms/request),"
        f" decode step "
        f"{1e3 * c.decode_base_step_s:.2f} ms + {1e3 * c.decode_s_per_seq:.3f} ms/seq + "
        f"{1e6 * c.decode_s_per_kv_token:.4f} ms/1k KV, appends {c.local_prefill_rate:.0f} "
        f"tok/s, KV {c.kv_capacity_tokens:.0f} tokens, switch {c.switch_s:.0f} s"
    )


def cluster_view(workers: list[WorkerStatus]) -> ClusterView:
    return ClusterView(
        tuple(
            WorkerView(
                id=w.name,
                role=w.role,
                draining=w.draining,
                target_role=w.target_role,
                ready=w.ready,
                inflight_prefill=w.inflight.prefill,
                inflight_decode=w.inflight.decode,
            )
            for w in workers
        )
    )


@dataclass(frozen=True)
class SwitchRecord:
    """One switch as it ended: when it started (the controller's clock), which worker, the
    roles, how it ended and how long it took."""

    started_at: float
    worker: str
    from_role: Role
    to_role: Role
    outcome: SwitchOutcome
    seconds: float


@dataclass
class Controller:
    cluster: Cluster
    reader: EventReader
    config: ControllerConfig
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)
    clock: Callable[[], float] = time.time
    on_decision: Callable[[Decision, Forecast | None], Awaitable[None]] | None = None
    table: LifecycleTable = field(default_factory=LifecycleTable)
    policy: Policy = field(init=False)
    last_decision: Decision | None = field(default=None, init=False)
    last_forecast: Forecast | None = field(default=None, init=False)
    healthy: bool = field(default=False, init=False)
    switches_done: int = field(default=0, init=False)
    decisions_made: int = field(default=0, init=False)
    # the latest switches (a long-running operator keeps only these)
    switch_log: deque[SwitchRecord] = field(default_factory=lambda: deque(maxlen=1000), init=False)
    _switching: dict[str, asyncio.Task[SwitchOutcome]] = field(default_factory=dict, init=False)
    _malformed_counted: int = field(default=0, init=False)
    # switched workers: when they were relabelled, and whether they were seen not ready since
    # (an engine restart); the switch's cost beyond its drain is learned when they are back
    _restarting: dict[str, tuple[float, bool]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.config.settings, self.config.capacity)
        self.forecaster = make_forecaster(
            "lifecycle", self.config.mode, self.config.settings.min_evidence
        )
        self.learner: CapacityEstimator | None = None
        self.engine_evidence: EngineEvidence | None = None
        if self.config.learn_capacity:
            self.learner = CapacityEstimator(
                self.config.capacity, prior_rel_sd=self.config.capacity_prior_rel_sd
            )
            self.engine_evidence = EngineEvidence(self.learner)

    @property
    def capacity(self) -> RoleCapacity:
        """What the policy prices splits with now: the prior, or what was learned."""
        return self.policy.capacity

    def update_settings(self, settings: AllocationSettings) -> bool:
        """Adopt edited allocation settings (a `kubectl edit` of the spec) from the next
        decision on; the lifecycle statistics are kept. True when they changed."""
        if settings == self.config.settings:
            return False
        log.info("allocation settings changed: policy %s", settings.policy)
        self.config = replace(self.config, settings=settings)
        capacity = self.policy.capacity  # what was learned so far stays learned
        self.policy = make_policy(settings, capacity)
        if isinstance(self.forecaster, LifecycleForecaster):
            self.forecaster.min_evidence = settings.min_evidence
        return True

    # ---- switches -----------------------------------------------------------------------------

    @property
    def switching(self) -> set[str]:
        return set(self._switching)

    def _start_switch(self, worker: str, from_role: Role, to_role: Role) -> None:
        if worker in self._switching:
            return  # never two switches of one worker at once

        async def run() -> SwitchOutcome:
            t0, started_at = time.monotonic(), self.clock()
            try:
                out = await switch(
                    self.cluster, worker, to_role,
                    drain_timeout_s=self.config.drain_timeout_s, settle_s=self.config.settle_s,
                    engine_check=self.config.switch_mode == "restart",
                )  # fmt: skip
            finally:
                self._switching.pop(worker, None)
                self.metrics.switching.set(len(self._switching))
            self.metrics.switches.labels(from_role.value, to_role.value, out.value).inc()
            seconds = time.monotonic() - t0
            self.switch_log.append(
                SwitchRecord(started_at, worker, from_role, to_role, out, seconds)
            )
            if out is SwitchOutcome.DONE:
                self._restarting[worker] = (self.clock(), False)
                self.switches_done += 1
                self.metrics.switch_seconds.observe(seconds)
            elif out is SwitchOutcome.ROLLED_BACK:
                self.metrics.drain_timeouts.inc()
            return out

        self._switching[worker] = asyncio.create_task(run(), name=f"switch-{worker}")
        self.metrics.switching.set(len(self._switching))

    async def recover(self) -> int:
        """Finish (or roll back) every switch a previous controller left half-done."""
        found = 0
        for w in await self.cluster.workers():
            if w.draining and w.target_role is not None:
                log.info("resuming the switch of %s to %s left by a previous controller",
                         w.name, w.target_role.value)  # fmt: skip
                self._start_switch(w.name, w.role, w.target_role)
                found += 1
        return found

    async def wait_switches(self) -> None:
        if self._switching:
            await asyncio.gather(*self._switching.values(), return_exceptions=True)

    async def abandon_switches(self) -> None:
        """Stop watching the switches in progress; they stay half-done on the workers (drain
        mark and target role) and the next controller's `recover` finishes them."""
        tasks = list(self._switching.values())
        if tasks:
            log.info("leaving %d switch(es) in progress to the next controller: %s",
                     len(tasks), ", ".join(self._switching))  # fmt: skip
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one decision -------------------------------------------------------------------------

    async def learn_capacity(self, workers: list[WorkerStatus]) -> None:
        """Read every serving worker's engine metrics and let the estimator learn from
        them; the policy then prices splits with the estimate. A worker that does not answer
        teaches nothing this time."""
        if self.learner is None or self.engine_evidence is None:
            return
        evidence = self.engine_evidence
        self._learn_switch_costs(workers)
        serving = [w for w in workers if w.ready and not w.draining and w.url]
        texts = await asyncio.gather(*(self.cluster.engine_metrics(w) for w in serving))
        now = self.clock()
        for w, text in zip(serving, texts, strict=True):
            sample = parse_engine_metrics(text, now) if text else None
            if sample is not None:
                evidence.feed(w.name, w.role, sample)
        known = {w.name for w in workers}
        for gone in [n for n in evidence.workers if n not in known]:
            evidence.forget(gone)
        self.policy.capacity = self.learner.capacity()
        self.metrics.observe_capacity(self.policy.capacity, self.learner.evidence())

    def _learn_switch_costs(self, workers: list[WorkerStatus]) -> None:
        assert self.learner is not None
        by_name = {w.name: w for w in workers}
        now = self.clock()
        for name, (relabelled, restarted) in list(self._restarting.items()):
            w = by_name.get(name)
            if w is None:
                del self._restarting[name]
            elif not w.ready:
                self._restarting[name] = (relabelled, True)
            else:  # back: an engine restart cost the time since the relabel, routing nothing
                self.learner.observe_switch(now - relabelled if restarted else 0.0)
                del self._restarting[name]

    async def decide(self) -> Decision:
        now = self.clock()
        workers = await self.cluster.workers()
        await self.learn_capacity(workers)
        view = cluster_view(workers)
        forecast = None
        if self.policy.uses_forecast:
            forecast = self.forecaster.forecast(self.table, now, self.config.settings.horizon)
        decision = self.policy.decide(view, forecast, now)
        for sw in decision.switches:
            if sw.worker not in self._switching:
                self._start_switch(sw.worker, sw.from_role, sw.to_role)
        self._record(view, decision, forecast)
        if self.on_decision is not None:
            await self.on_decision(decision, forecast)
        return decision

    def _record(self, view: ClusterView, d: Decision, fc: Forecast | None) -> None:
        m = self.metrics
        m.decisions.inc()
        self.decisions_made += 1
        for role, n in ((Role.PREFILL, d.target.prefill), (Role.DECODE, d.target.decode),
                        (Role.MIXED, d.target.mixed)):  # fmt: skip
            m.target.labels(role.value).set(n)
            m.actual.labels(role.value).set(view.count(role))
        m.trajectories.set(self.table.in_flight)
        if fc is not None:
            m.forecast_prefill.set(fc.prefill_tokens_per_s[0])
            m.forecast_decode.set(fc.decode_seqs[0])
        changed = self.last_decision is None or d.switches or d.target != self.last_decision.target
        if changed:
            moves = ", ".join(f"{s.worker} {s.from_role.value}->{s.to_role.value}"
                              for s in d.switches) or "none"  # fmt: skip
            fc_text = "none"
            if fc is not None:
                fc_text = (
                    f"prefill {fc.prefill_tokens_per_s[0]:.0f} tok/s, "
                    f"decode {fc.decode_seqs[0]:.1f} seqs"
                )
            learned = f"; capacity {capacity_text(self.policy.capacity)}" if self.learner else ""
            log.info("decision: %s -> target %s (%s); forecast %s; switches: %s%s",
                     view.allocation, d.target, d.reason, fc_text, moves, learned)  # fmt: skip
        self.last_decision, self.last_forecast = d, fc

    # ---- the loop -----------------------------------------------------------------------------

    async def _consume(self) -> None:
        events = await self.reader.read(self.config.read_block_ms)
        if events:
            self.table.ingest(events)
            self.metrics.events.inc(len(events))
        await self.reader.ack()
        if self.reader.malformed > self._malformed_counted:
            self.metrics.malformed.inc(self.reader.malformed - self._malformed_counted)
            self._malformed_counted = self.reader.malformed

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._loop(stop)
        except asyncio.CancelledError:
            await self.abandon_switches()  # cancelled: never leave orphaned switch tasks
            raise
        if self.config.finish_switches_on_stop:
            await self.wait_switches()
        else:
            await self.abandon_switches()

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff = 0.5
        recovered = False
        next_decision = 0.0
        while not stop.is_set():
            raise_if_cancelled()
            try:
                if not recovered:
                    await self.reader.ensure_group()
                    await self.recover()
                    recovered = True
                await self._consume()
                if time.monotonic() >= next_decision:
                    next_decision = time.monotonic() + self.config.settings.interval_s
                    await self.decide()
                    with contextlib.suppress(RedisError):
                        lag = await self.reader.lag()
                        if lag is not None:
                            self.metrics.lag.set(lag)
                if not self.healthy:
                    log.info("Redis and the cluster answer: deciding again")
                self.healthy = True
                self.metrics.up.set(1)
                backoff = 0.5
            except (RedisError, OSError, ClusterUnavailable) as e:
                if self.healthy or backoff == 0.5:
                    log.warning("cannot reach Redis or the cluster (%s): holding the current "
                                "allocation, retrying", e)  # fmt: skip
                self.healthy = False
                recovered = False  # Redis may have lost the consumer group: set it up again
                self.metrics.up.set(0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)
