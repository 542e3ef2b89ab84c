"""Switch mode `restart`: the engine has an explicit NIXL role (kv_producer / kv_consumer), so
the agent restarts vLLM when the registry relabels it — after the drain protocol emptied it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from e2e.client import complete
from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events.keys import ClusterKeys
from prorsa.local.cluster import LocalCluster
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import LocalStack, StackConfig
from prorsa.policy.allocate import Role

KEYS = ClusterKeys("e2e", "restart")


@pytest.fixture(scope="module")
def restart_stack(
    workdir: Path, tiny_model: Path, redis_server: RedisServer
) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=tiny_model,
        workdir=workdir / "restart",
        redis_url=redis_server.url,
        roles=[Role.PREFILL],
        keys=KEYS,
        switch_mode="restart",
    )
    with LocalStack(cfg) as s:
        yield s


def test_relabel_restarts_the_engine_into_its_new_kv_role(restart_stack: LocalStack) -> None:
    s = restart_stack
    agent_log = s.workers[0].child.log_path

    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            Redis.from_url(s.cfg.redis_url, socket_timeout=30) as r,
        ):
            # a prefill-only cluster still serves whole turns (the pool fallback)
            before = await complete(http, s.router_url, "a prefill worker alone", 8)
            assert before.status == 200 and len(before.token_ids) == 8
            assert "(kv_producer)" in agent_log.read_text()

            out = await switch(
                LocalCluster(r, KEYS), "worker-0", Role.DECODE, settle_s=1.0, engine_check=True
            )
            assert out is SwitchOutcome.DONE
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                started = "starting vLLM as decode (kv_consumer)" in agent_log.read_text()
                if started and s.ready_workers() == 1:  # readiness was dropped before restart
                    break
                await asyncio.sleep(1)
            text = agent_log.read_text()
            assert "role prefill -> decode (restarting vLLM)" in text
            assert "starting vLLM as decode (kv_consumer)" in text
            after = await complete(http, s.router_url, "a decode worker alone", 8)
            assert after.status == 200 and len(after.token_ids) == 8

    asyncio.run(main())
