"""A trajectory moved off a crowded decode worker, on real vLLM: the worker it leaves still
holds its context, prefills the turn (only the new tokens) and the new worker pulls the KV over
NIXL; the answer is the one the new worker gives for the whole prompt alone."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from e2e.client import TIMEOUT, VOCAB, complete, metric
from prorsa.events.keys import ClusterKeys
from prorsa.local.redis_server import RedisServer
from prorsa.local.registry import Registry
from prorsa.local.stack import LocalStack, StackConfig
from prorsa.policy.allocate import Role

KEYS = ClusterKeys("e2e", "handoff")
TRAJECTORIES = 6


@pytest.fixture(scope="module")
def hstack(workdir: Path, tiny_model: Path, redis_server: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(model=tiny_model, workdir=workdir / "handoff", redis_url=redis_server.url,
                      roles=[Role.DECODE, Role.PREFILL], keys=KEYS)  # fmt: skip
    with LocalStack(cfg) as s:
        yield s


async def _handoffs(s: aiohttp.ClientSession, router: str) -> float:
    async with s.get(router + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prorsa_router_ttft_seconds_count") and 'path="handoff"' in line
    )


def test_a_moved_trajectorys_old_worker_prefills_its_turn_for_the_new_one(
    hstack: LocalStack,
) -> None:
    async def main() -> None:
        router, old, new = hstack.router_url, hstack.workers[0].url, hstack.workers[1].url
        rng = random.Random(5)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            # first turns: prefilled on worker-1 (prefill), decoded on worker-0, which keeps
            # every trajectory's context
            prompts = []
            for i in range(TRAJECTORIES):
                p = [rng.randrange(3, VOCAB) for _ in range(300)]
                first = await complete(s, router, p, 16, traj=f"h{i}")
                assert first.status == 200, first.error
                prompts.append(p + first.token_ids)
            async with Redis.from_url(hstack.cfg.redis_url) as r:
                await Registry(r, KEYS).set_role("worker-1", Role.DECODE)  # a routing switch
            await asyncio.sleep(1.5)  # the router sees it: worker-0 hosts all six, worker-1 none

            second = prompts[0] + [rng.randrange(3, VOCAB) for _ in range(40)]  # observation
            computed = "vllm:request_prefill_kv_computed_tokens_sum"
            before = (await metric(s, old, computed),
                      await metric(s, new, "vllm:nixl_xfer_time_seconds_count"),
                      await _handoffs(s, router))  # fmt: skip
            moved = await complete(s, router, second, 16, traj="h0")
            assert moved.status == 200, moved.error
            after = (await metric(s, old, computed),
                     await metric(s, new, "vllm:nixl_xfer_time_seconds_count"),
                     await _handoffs(s, router))  # fmt: skip
            alone = await complete(s, new, second, 16)
        assert after[2] - before[2] == 1, "the turn ran as a handoff"
        assert after[1] > before[1], "the new worker pulled the KV over NIXL"
        # the old worker computed the observation and the context's last partial cache
        # block (128 tokens on the CPU), not the 316 tokens of context it holds
        assert 0 < after[0] - before[0] <= len(second) - 200, (before, after)
        assert moved.token_ids == alone.token_ids

    asyncio.run(main())
