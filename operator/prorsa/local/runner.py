"""`prorsa local`: the whole system on one machine, for real.

A private Redis, the tiny model, vLLM workers on the CPU (through `prorsa worker`), the router
and the controller; a seeded agentic workload driven through the router with real tool sleeps;
a live view of roles, forecast and progress; a summary, and with `--compare` the same workload
under each policy. Every process it starts is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from redis.asyncio import Redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from prorsa.control.cluster import WorkerStatus
from prorsa.control.controller import Controller, ControllerConfig
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventReader
from prorsa.local.calibrate import Calibration, calibrate
from prorsa.local.cluster import LocalCluster
from prorsa.local.driver import DriveResult, Progress, Scale, drive, scale_scripts
from prorsa.local.model import check_model_dir, make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import AllocationSettings, make_policy
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
    cluster = LocalCluster(redis, KEYS)
    roles = make_policy(settings, capacity.capacity()).initial_roles(len(stack.workers))
    for w, role in zip(stack.workers, roles, strict=True):
        await cluster.set_role(w.name, role)
    await redis.delete(KEYS.events)  # each policy starts from an empty history
    await asyncio.sleep(1.0)  # the router sees the roles
    spec = load_workload(opts.workload)
    scripts = scale_scripts(generate(spec, opts.trajectories, opts.seed), opts.scale)
    ctl = Controller(
        cluster,
        EventReader(redis, KEYS.events, group=f"prorsa-{policy}"),
        ControllerConfig(
            settings,
            capacity.capacity(),
            mode=opts.mode,  # type: ignore[arg-type]
            drain_timeout_s=30.0,
            settle_s=1.0,
        ),
    )
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
    with Live(console=console, refresh_per_second=4, transient=True,
              auto_refresh=opts.live) as live:  # fmt: skip
        view = asyncio.create_task(watch(live.update))
        try:
            result = await drive(stack.router_url, scripts, model=SERVED_MODEL, seed=opts.seed,
                                 concurrency=concurrency, on_progress=progress,
                                 prefix=f"{policy}-")  # fmt: skip
        finally:
            view.cancel()
            stop.set()
            await control
    return PolicyRun(policy, result, ctl.switches_done, ctl.decisions_made)


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
        console.print(
            f"• calibrated: prefill {cal.prefill_tokens_per_s:.0f} tok/s, decode step "
            f"{1e3 * cal.decode_step_s:.1f} ms (+{1e3 * cal.decode_s_per_seq:.2f} ms/seq)"
        )
        runs = []
        for policy in opts.policies:
            console.print(f"• running {policy}")
            runs.append(await run_policy(opts, stack, redis, cal, policy, console))
        _summary(runs, console)
        return 0 if all(r.result.turns_failed == 0 for r in runs) else 1
    finally:
        await redis.aclose()
        await asyncio.to_thread(stack.stop)
        if server is not None:
            server.stop()
