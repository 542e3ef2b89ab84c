"""`prorsa router`, `prorsa controller`, `prorsa operator`: the control and data planes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prorsa.cli._app import _DEFAULTS, RUN, _fail, _logging, _with_password, app
from prorsa.policy.allocate import AllocationSettings

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiohttp import web
    from prometheus_client import CollectorRegistry


@app.command(rich_help_panel=RUN)
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


@app.command(rich_help_panel=RUN)
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


@app.command("operator", rich_help_panel=RUN)
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
