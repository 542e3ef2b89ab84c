"""The local registry and the switch protocol over the local Cluster adapter, on a real Redis.
In-flight counts are written into the `workers` hash exactly as a router reports them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.local.cluster import LocalCluster
from prorsa.local.registry import Registry
from prorsa.policy.allocate import Role

KEYS = ClusterKeys("t", "reg")


def test_registration_keeps_a_role_the_controller_set(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            reg = Registry(r, KEYS)
            await reg.register("w0", "http://127.0.0.1:1", Role.PREFILL)
            await reg.set_ready("w0", True)
            await reg.set_role("w0", Role.DECODE)
            await reg.register("w0", "http://127.0.0.1:2", Role.PREFILL)  # agent restarted
            [w] = await reg.list()
            assert (w.role, w.url, w.ready) == (Role.DECODE, "http://127.0.0.1:2", False)

    asyncio.run(main())


def test_drain_marks_and_rollback(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            reg = Registry(r, KEYS)
            await reg.register("w0", "http://x:1", Role.PREFILL)
            await reg.mark_draining("w0", Role.DECODE)
            [w] = await reg.list()
            assert w.draining and w.target_role is Role.DECODE and w.role is Role.PREFILL
            await reg.cancel_drain("w0")
            [w] = await reg.list()
            assert not w.draining and w.target_role is None and w.role is Role.PREFILL

    asyncio.run(main())


def test_corrupted_entries_are_invisible_not_fatal(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            reg = Registry(r, KEYS)
            await reg.register("good", "http://x:1", Role.MIXED)
            await r.sadd(KEYS.registry, "ghost", "bad")
            await r.hset(KEYS.worker("bad"), mapping={"url": "http://x:2", "role": "chef"})
            assert [w.name for w in await reg.list()] == ["good"]

    asyncio.run(main())


@contextlib.asynccontextmanager
async def reporting(r: Redis, worker: str, prefill: int, decode: int) -> AsyncIterator[None]:
    """What a router does every interval, for the duration of the block."""
    stop = asyncio.Event()

    async def report() -> None:
        while not stop.is_set():
            await r.hset(KEYS.workers, inflight.field(worker, "r1"),
                         inflight.value(prefill, decode, time.time()))  # fmt: skip
            await asyncio.sleep(0.05)

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        stop.set()
        await task


def test_switch_waits_for_a_fresh_zero_then_relabels(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            await cluster.registry.register("w0", "http://x:1", Role.PREFILL)
            # a stale zero written before the drain proves nothing:
            await r.hset(KEYS.workers, inflight.field("w0", "r1"), inflight.value(0, 0, 1.0))
            async with reporting(r, "w0", 2, 0):
                sw = asyncio.create_task(
                    switch(cluster, "w0", Role.DECODE, settle_s=0.2, poll_s=0.05)
                )
                await asyncio.sleep(0.5)
                assert not sw.done()
                [w] = await cluster.workers()
                assert w.draining and w.role is Role.PREFILL  # still draining its prefills
            async with reporting(r, "w0", 0, 3):  # decodes don't block
                assert await asyncio.wait_for(sw, 5) is SwitchOutcome.DONE
            [w] = await cluster.workers()
            assert w.role is Role.DECODE and not w.draining

    asyncio.run(main())


def test_switch_rolls_back_when_the_drain_times_out(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            await cluster.registry.register("w0", "http://x:1", Role.DECODE)
            async with reporting(r, "w0", 0, 1):
                out = await switch(cluster, "w0", Role.PREFILL, drain_timeout_s=0.6, settle_s=0.1)
            assert out is SwitchOutcome.ROLLED_BACK
            [w] = await cluster.workers()
            assert w.role is Role.DECODE and not w.draining
            assert await switch(cluster, "w0", Role.DECODE) is SwitchOutcome.SKIPPED

    asyncio.run(main())


def test_a_new_controller_finishes_a_half_done_switch(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            await cluster.registry.register("w0", "http://x:1", Role.PREFILL)
            await cluster.mark_draining("w0", Role.DECODE)  # then the controller died
            async with reporting(r, "w0", 0, 0):
                out = await switch(cluster, "w0", Role.DECODE, settle_s=0.1, poll_s=0.05)
            assert out is SwitchOutcome.DONE
            [w] = await cluster.workers()
            assert w.role is Role.DECODE and not w.draining

    asyncio.run(main())


def test_switch_waits_for_the_engine_too_when_routers_report_zero(redis_url: str) -> None:
    """The engine's own metrics say a request still runs (a client went around the routers):
    the drain is not done, and times out into a rollback."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0"} 1.0\n')

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with TestServer(app) as engine, Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            url = str(engine.make_url("")).rstrip("/")
            await cluster.registry.register("w0", url, Role.DECODE)
            async with reporting(r, "w0", 0, 0):
                out = await switch(cluster, "w0", Role.PREFILL, drain_timeout_s=0.8,
                                   settle_s=0.1, engine_check=True)  # fmt: skip
            assert out is SwitchOutcome.ROLLED_BACK
            assert await cluster.engine_inflight("w0") == 1

    asyncio.run(main())


def test_a_restarting_switch_waits_for_kv_another_worker_has_not_pulled_yet(
    redis_url: str,
) -> None:
    """Restart mode: a decode worker that prefilled a turn for another decode worker (load
    shedding) holds its KV until that one pulls it; the routers count it as the source's
    in-flight prefill. Restarting the engine before the pull lost the turn (a NIXL
    remote-disconnect seen in e2e), so the drain waits for it, though no decode is in flight."""

    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            await cluster.registry.register("w0", "http://127.0.0.1:9", Role.DECODE)  # no engine
            async with reporting(r, "w0", 1, 0):  # the KV not pulled yet
                sw = asyncio.create_task(switch(cluster, "w0", Role.PREFILL, settle_s=0.1,
                                                poll_s=0.05, engine_check=True))  # fmt: skip
                await asyncio.sleep(0.6)
                assert not sw.done()  # routing mode would have relabelled here
            async with reporting(r, "w0", 0, 0):
                assert await asyncio.wait_for(sw, 5) is SwitchOutcome.DONE
            # routing mode: the engine keeps the KV, so only the old role's work counts
            await cluster.registry.register("w1", "http://127.0.0.1:9", Role.DECODE)
            async with reporting(r, "w1", 1, 0):
                out = await switch(cluster, "w1", Role.PREFILL, settle_s=0.1, poll_s=0.05)
            assert out is SwitchOutcome.DONE

    asyncio.run(main())


def test_a_restarting_switch_relabels_under_the_drain_until_the_engine_goes_down(
    redis_url: str,
) -> None:
    """Restart mode: relabelled and undrained at once, the worker was ready in its new role
    while its old engine still ran, until its agent noticed and took it down; a router sent
    it a prefill in that window whose KV the restart then lost (seen in e2e). The switch now
    relabels under the drain mark and clears it once the worker stops being ready."""

    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            await cluster.registry.register("w0", "http://127.0.0.1:9", Role.DECODE)
            await cluster.registry.set_ready("w0", True)  # the old engine answers
            async with reporting(r, "w0", 0, 0):
                sw = asyncio.create_task(switch(cluster, "w0", Role.PREFILL, settle_s=0.1,
                                                poll_s=0.05, engine_check=True))  # fmt: skip
                await asyncio.sleep(0.8)
                [w] = await cluster.workers()
                assert w.role is Role.PREFILL and w.draining and w.ready  # no router uses it
                assert not sw.done()
                await cluster.registry.set_ready("w0", False)  # the agent restarts the engine
                assert await asyncio.wait_for(sw, 5) is SwitchOutcome.DONE
            [w] = await cluster.workers()
            assert w.role is Role.PREFILL and not w.draining and not w.ready
            # an agent that never restarts (no new arguments): the drain clears after a while
            await cluster.registry.set_ready("w0", True)
            async with reporting(r, "w0", 0, 0):
                out = await switch(cluster, "w0", Role.DECODE, settle_s=0.1, poll_s=0.05,
                                   engine_check=True, restart_notice_s=0.5)  # fmt: skip
            assert out is SwitchOutcome.DONE
            [w] = await cluster.workers()
            assert w.role is Role.DECODE and not w.draining

    asyncio.run(main())
