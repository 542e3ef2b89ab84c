"""`prorsa local`: the whole system on one machine, for real.

A private Redis, the tiny model, vLLM workers on the CPU (through `prorsa worker`), the router
and the controller; a seeded agentic workload driven through the router with real tool sleeps;
a live view of roles, forecast and progress; a summary, and with `--compare` the same workload
under each policy. Every process it starts is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from prorsa.control.cluster import WorkerStatus
from prorsa.control.controller import Controller, ControllerConfig, SwitchRecord, capacity_text
from prorsa.control.metrics import capacity_figures
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventReader
from prorsa.local.calibrate import Calibration, agreement, calibrate
from prorsa.local.cluster import LocalCluster
from prorsa.local.cpu import StackShare
from prorsa.local.driver import DriveResult, Progress, Scale, drive, scale_scripts
from prorsa.local.model import check_model_dir, make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.plot import plot_run
from prorsa.policy.allocate import AllocationSettings, Decision, Role, make_policy
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.events import State
from prorsa.policy.forecast import Forecast
from prorsa.sim.config import TimelinePoint, timeline_row
from prorsa.sim.presets import PRESET_PRIOR_REL_SD, prior_capacity
from prorsa.sim.workload import generate, load_workload

log = logging.getLogger(__name__)
KEYS = ClusterKeys("local", "demo")


@dataclass
class LocalOptions:
    workers: int = 2
    policies: list[str] = field(default_factory=lambda: ["predictive"])
    workload: str = "swe"
    trajectories: int = 24
    seed: int = 0
    mode: str = "sync"
    redis_url: str | None = None
    workdir: Path = Path(".prorsa/local")
    model: Path | None = None  # a Hugging Face-format directory (default: the tiny model)
    scale: Scale = field(default_factory=Scale)
    live: bool = True
    # what the controller prices splits with: "calibrated" (the offline calibration), "auto"
    # or a preset (their datasheet); corrected online from the workers' metrics if learning
    capacity_model: str = "calibrated"
    learn_capacity: bool = True
    json_out: Path | None = None  # the run as JSON (per-turn timings, switches, timeline)
    plot: Path | None = None  # the run as a picture (`prorsa.plot`)
    # decisions at CPU pace: the workload's tool latencies are scaled by `scale.time`
    settings: AllocationSettings = field(
        default_factory=lambda: replace(
            AllocationSettings(), interval_s=2.0, horizon_s=20.0, cooldown_s=4.0, min_evidence=30
        )
    )


@dataclass
class PolicyRun:
    policy: str
    result: DriveResult
    switches: int
    decisions: int
    timeline: list[TimelinePoint] = field(default_factory=list)  # one point per decision
    switch_log: list[SwitchRecord] = field(default_factory=list)
    started_at: float = 0.0  # the controller's clock when the rollout started
    capacity: RoleCapacity | None = None  # what the controller priced with at the end
    evidence: dict[str, float] | None = None  # what it had learned it from (None: not learning)
    # the share of the machine's CPU the rest of the stack took from the engines meanwhile
    stack_cpu_share: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The same fields `prorsa simulate --json` writes for a policy, and what only a real
        run has: every turn's timing and every switch."""
        r = self.result
        done = sorted(r.completion_s)
        return {
            "label": self.policy,
            "makespan_s": r.makespan_s,
            "p50_completion_s": statistics.median(done) if done else 0.0,
            "turns_ok": r.turns_ok,
            "turns_failed": r.turns_failed,
            "switches": self.switches,
            "decisions": self.decisions,
            "timeline": [timeline_row(p) for p in self.timeline],
            "completions_s": [round(x, 3) for x in done],
            "turns": [asdict(t) for t in r.turns],
            "switch_log": [
                {
                    "start_s": round(sw.started_at - self.started_at, 3),
                    "worker": sw.worker,
                    "from": sw.from_role.value,
                    "to": sw.to_role.value,
                    "outcome": sw.outcome.value,
                    "seconds": round(sw.seconds, 3),
                }
                for sw in self.switch_log
            ],
            "capacity": capacity_figures(self.capacity) if self.capacity else None,
            "capacity_evidence": self.evidence,
            "stack_cpu_share": self.stack_cpu_share,
            "errors": r.errors,
        }


def run_document(opts: LocalOptions, runs: list[PolicyRun], cal: Calibration,
                 model: str) -> dict[str, Any]:  # fmt: skip
    """A real run in the shape of `prorsa simulate --json` (`prorsa plot` draws either)."""
    base = runs[0].result.makespan_s
    results = {}
    for r in runs:
        row = r.to_json()
        if r.result.makespan_s > 0:
            row[f"speedup_vs_{runs[0].policy}"] = base / r.result.makespan_s
        results[r.policy] = row
    return {
        "source": "real",
        "title": f"{opts.workload} · {opts.mode} · {opts.workers} vLLM workers on the CPU · "
        f"{opts.trajectories} trajectories · {model}",
        "workload": opts.workload,
        "mode": opts.mode,
        "workers": opts.workers,
        "trajectories": opts.trajectories,
        "seed": opts.seed,
        "model": model,
        "calibration": asdict(cal),
        "results": results,
    }


class _Timeline:
    """Records a `TimelinePoint` at each decision: roles, forecast vs what the lifecycle
    table saw since the last one, and the capacity the roles give as the controller prices
    them."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.points: list[TimelinePoint] = []
        self.t0 = time.monotonic()
        self._last = (self.t0, 0)
        self.ctl: Controller | None = None

    async def on_decision(self, _: Decision, fc: Forecast | None) -> None:
        assert self.ctl is not None
        table, now = self.ctl.table, time.monotonic()
        capacity = self.ctl.capacity  # as priced at this decision (learned, if learning)
        roles = [w.role for w in await self.cluster.workers()]
        n = {r: roles.count(r) for r in Role}
        last_t, last_submitted = self._last
        dt = max(now - last_t, 1e-3)
        self.points.append(
            TimelinePoint(
                t=now - self.t0,
                prefill=n[Role.PREFILL],
                decode=n[Role.DECODE],
                mixed=n[Role.MIXED],
                forecast_prefill_tps=fc.prefill_tokens_per_s[0] if fc else 0.0,
                actual_prefill_tps=(table.submitted_tokens_total - last_submitted) / dt,
                forecast_decode=fc.decode_seqs[0] if fc else 0.0,
                actual_decode=table.count(State.DECODE),
                prefill_capacity_tps=n[Role.PREFILL] * capacity.prefill_tokens_per_s,
                forecast_decode_kv=fc.decode_kv_tokens[0] if fc else 0.0,
                actual_decode_kv=float(table.decode_context_tokens),
                decode_kv_capacity=(n[Role.DECODE] + n[Role.MIXED]) * capacity.kv_capacity_tokens,
            )
        )
        self._last = (now, table.submitted_tokens_total)


def _view(policy: str, prog: Progress | None, workers: list[WorkerStatus],
          ctl: Controller) -> Group:  # fmt: skip
    t = Table(title=f"prorsa local · policy {policy}", expand=False)
    for col in ("worker", "role", "ready", "switch", "in flight P/D"):
        t.add_column(col)
    for w in workers:
        switch = f"→ {w.target_role.value}" if w.draining and w.target_role else ""
        t.add_row(w.name, w.role.value, "yes" if w.ready else "no", switch,
                  f"{w.inflight.prefill}/{w.inflight.decode}")  # fmt: skip
    d, fc = ctl.last_decision, ctl.last_forecast
    lines = []
    if fc is not None:
        lines.append(f"forecast: prefill {fc.prefill_tokens_per_s[0]:.0f} tok/s, "
                     f"decode {fc.decode_seqs[0]:.1f} seqs")  # fmt: skip
    if d is not None:
        lines.append(f"target {d.target} · {d.reason} · switches done {ctl.switches_done}")
    if prog is not None:
        lines.append(
            f"turns {prog.turns_done}/{prog.total_turns} · trajectories "
            f"{prog.trajectories_done}/{prog.total_trajectories} · failed {prog.failed}"
        )
    return Group(t, *lines)


async def run_policy(
    opts: LocalOptions,
    stack: LocalStack,
    redis: Redis,
    capacity: Calibration,
    policy: str,
    console: Console,
) -> PolicyRun:
    settings = replace(opts.settings, policy=policy)
    keys = stack.cfg.keys
    cluster = LocalCluster(redis, keys)
    roles = make_policy(settings, capacity.capacity()).initial_roles(len(stack.workers))
    for w, role in zip(stack.workers, roles, strict=True):
        await cluster.set_role(w.name, role)
    await redis.delete(keys.events)  # each policy starts from an empty history
    await asyncio.sleep(1.0)  # the router sees the roles
    spec = load_workload(opts.workload)
    scripts = scale_scripts(generate(spec, opts.trajectories, opts.seed), opts.scale)
    prior, prior_rel_sd = capacity.capacity(), PRESET_PRIOR_REL_SD
    if opts.capacity_model != "calibrated":
        prior, prior_rel_sd = prior_capacity(opts.capacity_model)
    timeline = _Timeline(cluster)
    ctl = Controller(
        cluster,
        EventReader(redis, keys.events, group=f"prorsa-{policy}"),
        ControllerConfig(
            settings,
            prior,
            mode=opts.mode,  # type: ignore[arg-type]
            drain_timeout_s=30.0,
            settle_s=1.0,
            learn_capacity=opts.learn_capacity,
            capacity_prior_rel_sd=prior_rel_sd,
        ),
        on_decision=timeline.on_decision,
    )
    timeline.ctl = ctl
    await ctl.learn_capacity(await cluster.workers())  # the engines' counters before the run
    started_at = ctl.clock()
    stop = asyncio.Event()
    control = asyncio.create_task(ctl.run(stop))
    state: dict[str, object] = {"prog": None, "workers": []}

    def progress(p: Progress) -> None:
        state["prog"] = p

    async def watch(update: Callable[[Group], None]) -> None:
        while True:
            with contextlib.suppress(Exception):
                state["workers"] = await cluster.workers()
            update(_view(policy, state["prog"], state["workers"], ctl))  # type: ignore[arg-type]
            await asyncio.sleep(0.5)

    concurrency = 0 if opts.mode == "sync" else max(1, opts.trajectories // 2)
    meter = StackShare()
    with Live(console=console, refresh_per_second=4, transient=True,
              auto_refresh=opts.live) as live:  # fmt: skip
        view = asyncio.create_task(watch(live.update))
        try:
            async with meter.sampling():
                result = await drive(stack.router_url, scripts, model=SERVED_MODEL,
                                     seed=opts.seed, concurrency=concurrency,
                                     on_progress=progress, prefix=f"{policy}-")  # fmt: skip
        finally:
            view.cancel()
            stop.set()
            await control
    evidence = ctl.learner.evidence() if ctl.learner else None
    return PolicyRun(policy, result, ctl.switches_done, ctl.decisions_made, timeline.points,
                     list(ctl.switch_log), started_at, ctl.capacity, evidence,
                     meter.last(result.makespan_s))  # fmt: skip


def _summary(runs: list[PolicyRun], console: Console) -> None:
    t = Table(title="prorsa local · summary")
    for col in ("policy", "makespan s", "turns ok", "failed", "p50 traj s", "switches", "ratio"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    base = runs[0].result.makespan_s
    for r in runs:
        p50 = statistics.median(r.result.completion_s) if r.result.completion_s else 0.0
        t.add_row(r.policy, f"{r.result.makespan_s:.1f}", str(r.result.turns_ok),
                  str(r.result.turns_failed), f"{p50:.1f}", str(r.switches),
                  f"{base / r.result.makespan_s:.3f}x" if r.result.makespan_s else "-")  # fmt: skip
    console.print(t)
    if len(runs) > 1:
        console.print(f"{runs[-1].policy} vs {runs[0].policy}: "
                      f"{base / runs[-1].result.makespan_s:.3f}x faster rollout")  # fmt: skip
    for r in runs:
        for e in r.result.errors[:3]:
            console.print(f"[red]{r.policy}:[/red] {e}")


def _learned(runs: list[PolicyRun], cal: Calibration, console: Console) -> None:
    """What the controller learned online, beside the offline calibration."""
    for r in runs:
        if r.capacity is None or r.evidence is None:
            continue
        ev = r.evidence
        source = "as the engine timed it" if cal.engine else "wall clock"
        seen = agreement(cal, r.capacity, ev["prefill_tokens_seen"], 0.0,
                         ev["decode_batch_seen"], ev["decode_kv_seen"])  # fmt: skip
        ref = agreement(cal, r.capacity)
        where, far = [], []
        if ev["prefill_samples"] > 0:  # only prefill workers teach prefill (none at 0P)
            where.append(f"prefill of {ev['prefill_tokens_seen']:.0f} tokens "
                         f"{100 * seen['prefill_s']:+.0f}%")  # fmt: skip
            far.append(f"prefill {100 * ref['prefill_s']:+.0f}%")
        if ev["decode_samples"] > 0:
            where.append(f"decode step at batch {ev['decode_batch_seen']:.1f} "
                         f"{100 * seen['decode_step_s']:+.0f}%")  # fmt: skip
            far.append(f"decode step {100 * ref['decode_step_s']:+.0f}%")
            if r.stack_cpu_share > 0:  # the calibration ran on an idle machine
                shared = (1 + seen["decode_step_s"]) * (1 - r.stack_cpu_share) - 1
                where.append(
                    f"the rest of the stack took {r.stack_cpu_share:.0%} of the CPU: at what "
                    f"that left the engines, decode step {100 * shared:+.0f}%"
                )
        console.print(
            f"• {r.policy}: learned online {capacity_text(r.capacity)} "
            f"({ev['prefill_samples']:.1f} prefill / {ev['decode_samples']:.1f} decode windows)."
            + (
                f" Against the offline calibration ({source}) where the run measured: "
                f"{', '.join(where)}; "
                f"at 1,024 tokens and batch 8: {', '.join(far)}"
                if where
                else ""
            )
        )


async def run_local(opts: LocalOptions, console: Console) -> int:
    opts.workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]prorsa local[/bold]: {opts.workers} vLLM workers on the CPU, "
                  f"workload {opts.workload}, {opts.trajectories} trajectories, "
                  f"policies {', '.join(opts.policies)} (workdir {opts.workdir})")  # fmt: skip
    cfg = StackConfig(model=opts.workdir / "tiny-llama", workdir=opts.workdir / "logs",
                      redis_url="", roles=[], keys=KEYS)  # fmt: skip
    if opts.model is not None:
        own = check_model_dir(opts.model, opts.workers, cfg.kv_cache_gib)
        cfg = replace(cfg, model=own.path, max_model_len=min(cfg.max_model_len, own.max_positions))
        mib = own.weight_bytes / 2**20
        size = f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"
        console.print(f"• model: {own.path} ({size} of weights)")
    else:
        cached = (cfg.model / "config.json").exists()
        console.print("• model: tiny (" + ("cached" if cached else "generating") + ")")
        make_tiny_model(cfg.model)
    model = cfg.model
    server = None if opts.redis_url else RedisServer(opts.workdir / "redis", persist=True).start()
    redis_url = opts.redis_url or server.url  # type: ignore[union-attr]
    console.print(f"• redis: {redis_url}")
    stack = LocalStack(replace(cfg, redis_url=redis_url))
    redis = Redis.from_url(redis_url, socket_timeout=10)
    try:
        first = make_policy(replace(opts.settings, policy=opts.policies[0]),
                            Calibration(1e4, 0, 0.01, 0, 1e6).capacity())  # fmt: skip
        for i, role in enumerate(first.initial_roles(opts.workers)):
            stack.start_worker(i, role)
        stack.start_router()
        console.print("• starting workers (the first start compiles the model: a minute or two)")
        await asyncio.to_thread(stack.wait_ready, 900)
        cal = await calibrate(stack.workers[0].url, SERVED_MODEL, model, stack.cfg.kv_cache_gib)
        for who, c in (("calibrated", cal), ("as the engine timed it", cal.engine)):
            if c is not None:
                console.print(
                    f"• {who}: prefill {c.prefill_tokens_per_s:.0f} tok/s "
                    f"+ {1e3 * c.prefill_fixed_s:.1f} ms/request, decode step "
                    f"{1e3 * c.decode_step_s:.2f} ms (+{1e3 * c.decode_s_per_seq:.3f} ms/seq, "
                    f"+{1e6 * c.decode_s_per_kv_token:.2f} us/KV token)"
                )
        runs = []
        for policy in opts.policies:
            console.print(f"• running {policy}")
            runs.append(await run_policy(opts, stack, redis, cal, policy, console))
        _summary(runs, console)
        _learned(runs, cal, console)
        if opts.json_out is not None or opts.plot is not None:
            name = opts.model.name if opts.model is not None else "tiny random Llama"
            doc = run_document(opts, runs, cal, name)
            if opts.json_out is not None:
                opts.json_out.parent.mkdir(parents=True, exist_ok=True)
                opts.json_out.write_text(json.dumps(doc, indent=1) + "\n")
                console.print(f"• wrote {opts.json_out} (turns, switches, forecast vs actual)")
            if opts.plot is not None:
                console.print(f"• wrote {plot_run(doc, opts.plot)}")
        return 0 if all(r.result.turns_failed == 0 for r in runs) else 1
    finally:
        await redis.aclose()
        await asyncio.to_thread(stack.stop)
        if server is not None:
            server.stop()
