"""The control loop on a real Redis: consumer-group reading, malformed events, decisions
carried out through the switch protocol, recovery of a half-done switch, Redis going away.
The routers' in-flight reports are written into the `workers` hash as a router writes them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from redis.asyncio import Redis

from prorsa.control.controller import Controller, ControllerConfig
from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.events.schema import encode
from prorsa.events.stream import EventReader
from prorsa.local.cluster import LocalCluster
from prorsa.local.redis_server import RedisServer
from prorsa.policy.allocate import AllocationSettings, Role
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.events import Event, EventType

KEYS = ClusterKeys("t", "ctl")
CAPACITY = RoleCapacity(20_000.0, 0.02, 0.0005, 1e-7, 500_000.0)


def config(**kw: object) -> ControllerConfig:
    settings = replace(AllocationSettings(), **kw)  # type: ignore[arg-type]
    return ControllerConfig(settings, CAPACITY, drain_timeout_s=5.0, settle_s=0.1)


async def report_idle(r: Redis, names: list[str], stop: asyncio.Event) -> None:
    """A router with nothing in flight, reporting every 50 ms."""
    while not stop.is_set():
        now = time.time()
        await r.hset(KEYS.workers, mapping={inflight.field(n, "r"): inflight.value(0, 0, now)
                                            for n in names})  # fmt: skip
        await asyncio.sleep(0.05)


async def roles(cluster: LocalCluster) -> dict[str, Role]:
    return {w.name: w.role for w in await cluster.workers()}


def test_reader_skips_malformed_entries_and_resumes_after_a_restart(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            good = [Event(EventType.TRAJ_START, f"t{i}", float(i)) for i in range(5)]
            for ev in good[:3]:
                await r.xadd(KEYS.events, encode(ev))  # type: ignore[arg-type]
            await r.xadd(KEYS.events, {"v": "1", "type": "teleport", "traj": "x", "ts": "1"})
            await r.xadd(KEYS.events, {"garbage": "\x00"})
            first = EventReader(r, KEYS.events, consumer="c1")
            await first.ensure_group()
            got = await first.read()
            await first.ack()
            assert [e.traj for e in got] == ["t0", "t1", "t2"] and first.malformed == 2
            for ev in good[3:]:
                await r.xadd(KEYS.events, encode(ev))  # type: ignore[arg-type]
            second = EventReader(r, KEYS.events, consumer="c1")  # the restarted controller
            await second.ensure_group()
            got = await second.read(block_ms=100)
            assert [e.traj for e in got] == ["t3", "t4"]  # resumed, not replayed
            assert await second.read(block_ms=50) == []
            assert await second.lag() == 0

    asyncio.run(main())


def test_unacknowledged_entries_are_redelivered_to_the_next_controller(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            await r.xadd(KEYS.events, encode(Event(EventType.TRAJ_START, "t0", 1.0)))  # type: ignore[arg-type]
            crashed = EventReader(r, KEYS.events, consumer="c1")
            await crashed.ensure_group()
            assert len(await crashed.read()) == 1  # read, then died before applying/acking
            again = EventReader(r, KEYS.events, consumer="c1")
            assert [e.traj for e in await again.read()] == ["t0"]

    asyncio.run(main())


def test_decisions_move_workers_through_the_switch_protocol(redis_url: str) -> None:
    """A static 1P policy over three decode workers: one is drained and relabelled."""

    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            names = ["w0", "w1", "w2"]
            for n in names:
                await cluster.registry.register(n, f"http://127.0.0.1/{n}", Role.DECODE)
                await cluster.registry.set_ready(n, True)
            stop = asyncio.Event()
            reporter = asyncio.create_task(report_idle(r, names, stop))
            ctl = Controller(cluster, EventReader(r, KEYS.events),
                             config(policy="static", static_prefill=1, interval_s=0.2,
                                    cooldown_s=0.0))  # fmt: skip
            loop = asyncio.create_task(ctl.run(stop))
            for _ in range(100):
                if ctl.switches_done:
                    break
                await asyncio.sleep(0.1)
            got = await roles(cluster)
            stop.set()
            await asyncio.gather(loop, reporter)
            assert sorted(got.values()) == [Role.DECODE, Role.DECODE, Role.PREFILL]
            assert ctl.switches_done == 1 and ctl.last_decision is not None
            assert str(ctl.last_decision.target) == "1P:2D"

    asyncio.run(main())


def test_a_new_controller_finishes_the_switch_its_predecessor_left(redis_url: str) -> None:
    async def main() -> None:
        async with Redis.from_url(redis_url) as r:
            cluster = LocalCluster(r, KEYS)
            for n in ("w0", "w1"):
                await cluster.registry.register(n, f"http://127.0.0.1/{n}", Role.DECODE)
            await cluster.mark_draining("w0", Role.PREFILL)  # and then the controller died
            stop = asyncio.Event()
            reporter = asyncio.create_task(report_idle(r, ["w0", "w1"], stop))
            ctl = Controller(cluster, EventReader(r, KEYS.events),
                             config(policy="colocated", interval_s=60))  # fmt: skip
            assert await ctl.recover() == 1
            await ctl.wait_switches()
            stop.set()
            await reporter
            assert (await roles(cluster))["w0"] is Role.PREFILL
            [w0] = [w for w in await cluster.workers() if w.name == "w0"]
            assert not w0.draining

    asyncio.run(main())


def test_redis_away_holds_the_allocation_then_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()

    async def main() -> None:
        r = Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
        cluster = LocalCluster(r, KEYS)
        await cluster.registry.register("w0", "http://x/w0", Role.DECODE)
        ctl = Controller(cluster, EventReader(r, KEYS.events),
                         config(policy="colocated", interval_s=0.1))  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.create_task(ctl.run(stop))
        for _ in range(50):
            if ctl.healthy:
                break
            await asyncio.sleep(0.05)
        assert ctl.healthy
        decisions = ctl.metrics.decisions._value.get()
        server.stop()
        await asyncio.sleep(1.5)
        assert not ctl.healthy
        held = ctl.metrics.decisions._value.get()
        await asyncio.sleep(0.5)
        assert ctl.metrics.decisions._value.get() == held  # no decision without Redis
        server.child.start()
        server.child.wait_until(server._answers, 20, "PONG")
        await cluster.registry.register("w0", "http://x/w0", Role.DECODE)  # memory was lost
        for _ in range(200):
            if ctl.healthy and ctl.metrics.decisions._value.get() > held:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await loop
        await r.aclose()
        assert ctl.healthy and ctl.metrics.decisions._value.get() > max(held, decisions)

    try:
        asyncio.run(main())
    finally:
        server.stop()
