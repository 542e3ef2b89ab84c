"""Faults with real Redis, real vLLM workers, the router and the controller as a process:
a controller killed mid-switch, a drain that times out, Redis gone for 10 s, malformed events.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from e2e.client import Completion, complete, metric
from prorsa.events.keys import ClusterKeys
from prorsa.local.processes import Child, free_port
from prorsa.local.redis_server import RedisServer
from prorsa.local.registry import Registry, WorkerRecord
from prorsa.local.stack import LocalStack, StackConfig
from prorsa.policy.allocate import Role

KEYS = ClusterKeys("e2e", "faults")
LONG = 1500  # tokens: a decode that keeps a CPU worker busy for ~15 s


@pytest.fixture(scope="module")
def redis_faults(workdir: Path) -> Iterator[RedisServer]:
    with RedisServer(workdir / "faults-redis", persist=True) as r:
        yield r


@pytest.fixture(scope="module")
def fstack(workdir: Path, tiny_model: Path, redis_faults: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(model=tiny_model, workdir=workdir / "faults", redis_url=redis_faults.url,
                      roles=[Role.DECODE, Role.DECODE], keys=KEYS)  # fmt: skip
    with LocalStack(cfg) as s:
        yield s


class Controller:
    """`prorsa controller` as a process, with its metrics port."""

    def __init__(self, s: LocalStack, log: Path, *args: str) -> None:
        self.port = free_port()
        argv = [
            sys.executable, "-m", "prorsa.cli", "controller", "--redis-url", s.cfg.redis_url,
            "--cluster", f"{KEYS.namespace}/{KEYS.name}", "--policy", "static",
            "--interval", "1", "--cooldown", "0", "--metrics-port", str(self.port), *args,
        ]  # fmt: skip
        self.child = Child("controller", argv, log).start()

    async def metric(self, s: aiohttp.ClientSession, name: str) -> float:
        return await metric(s, f"http://127.0.0.1:{self.port}", name)

    async def healthy(self, s: aiohttp.ClientSession) -> bool:
        try:
            async with s.get(f"http://127.0.0.1:{self.port}/healthz") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False


async def records(r: Redis) -> dict[str, WorkerRecord]:
    return {w.name: w for w in await Registry(r, KEYS).list()}


async def until(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


async def both_decode(r: Redis) -> None:
    reg = Registry(r, KEYS)
    for name in ("worker-0", "worker-1"):
        await reg.set_role(name, Role.DECODE)
    await asyncio.sleep(1.0)  # the router sees it


def long_turns(s: aiohttp.ClientSession, url: str, tag: str) -> list[asyncio.Task[Completion]]:
    """One long decode per worker (placement spreads new trajectories)."""
    return [asyncio.create_task(complete(s, url, [5 + i, 6, 7, 8], LONG, traj=f"{tag}-{i}"))
            for i in range(2)]  # fmt: skip


def test_controller_killed_mid_switch_is_finished_by_the_next_one(
    fstack: LocalStack, workdir: Path
) -> None:
    async def main() -> None:
        async with Redis.from_url(fstack.cfg.redis_url, socket_timeout=30) as r, \
                aiohttp.ClientSession() as s:  # fmt: skip
            await both_decode(r)
            busy = long_turns(s, fstack.router_url, "kill")
            await asyncio.sleep(2.0)
            first = Controller(fstack, workdir / "faults" / "ctl-1.log", "--static-prefill", "1")

            async def draining() -> bool:
                return any(w.draining for w in (await records(r)).values())

            await until(draining, 30, "a drain to start")
            first.child.signal(9)  # SIGKILL, mid-switch
            first.child.stop(5)
            [victim] = [w for w in (await records(r)).values() if w.draining]
            assert victim.target_role is Role.PREFILL
            served = [await complete(s, fstack.router_url, f"during {i}", 8) for i in range(4)]
            assert all(c.status == 200 for c in served)  # the router keeps serving

            second = Controller(fstack, workdir / "faults" / "ctl-2.log", "--static-prefill", "1")
            try:

                async def switched() -> bool:
                    recs = await records(r)
                    return not any(w.draining for w in recs.values()) and sorted(
                        w.role.value for w in recs.values()) == ["decode", "prefill"]  # fmt: skip

                await until(switched, 120, "the resumed switch to finish")
                assert (await records(r))[victim.name].role is Role.PREFILL
                assert "resuming the switch of " + victim.name in second.child.log_path.read_text()
            finally:
                second.child.stop(10)
            done = await asyncio.gather(*busy)
            assert all(c.status == 200 and len(c.token_ids) == LONG for c in done)

    asyncio.run(main())


def test_a_drain_stuck_past_its_timeout_is_rolled_back(fstack: LocalStack, workdir: Path) -> None:
    async def main() -> None:
        async with Redis.from_url(fstack.cfg.redis_url, socket_timeout=30) as r, \
                aiohttp.ClientSession() as s:  # fmt: skip
            await both_decode(r)
            busy = long_turns(s, fstack.router_url, "stuck")
            await asyncio.sleep(2.0)
            ctl = Controller(fstack, workdir / "faults" / "ctl-stuck.log",
                             "--static-prefill", "1", "--drain-timeout", "4",
                             "--cooldown", "600")  # fmt: skip
            try:

                async def rolled_back() -> bool:
                    try:
                        return await ctl.metric(s, "prorsa_drain_timeouts_total") >= 1
                    except (aiohttp.ClientError, IndexError):
                        return False

                await until(rolled_back, 60, "the drain to time out")
                recs = await records(r)
                assert not any(w.draining for w in recs.values())
                assert all(w.role is Role.DECODE for w in recs.values())  # old roles kept
                rolled = 'prorsa_switches_total{from_role="decode",outcome="rolled_back"'
                text = ctl.child.log_path.read_text()
                assert "rolling back" in text
                async with s.get(f"http://127.0.0.1:{ctl.port}/metrics") as resp:
                    assert rolled in await resp.text()
            finally:
                ctl.child.stop(10)
            done = await asyncio.gather(*busy)
            assert all(c.status == 200 and len(c.token_ids) == LONG for c in done)

    asyncio.run(main())


def test_redis_gone_for_ten_seconds(
    fstack: LocalStack, redis_faults: RedisServer, workdir: Path
) -> None:
    """The router serves throughout, the controller holds, both recover; malformed events
    written afterwards are skipped and counted."""

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            ctl = Controller(fstack, workdir / "faults" / "ctl-redis.log", "--static-prefill", "1")
            try:
                await until(lambda: ctl.healthy(s), 30, "the controller")
                results: list[Completion] = []
                stop = asyncio.Event()

                async def load() -> None:
                    i = 0
                    while not stop.is_set():
                        results.append(await complete(s, fstack.router_url, [9, i % 300 + 3], 8,
                                                      traj=f"redis-{i % 4}"))  # fmt: skip
                        i += 1

                traffic = asyncio.create_task(load())
                await asyncio.sleep(2)
                redis_faults.stop()
                t0 = time.monotonic()
                await until(lambda: _not(ctl.healthy(s)), 15, "the controller to notice")
                served_while_down = len(results)
                await asyncio.sleep(max(0.0, 10 - (time.monotonic() - t0)))
                assert len(results) > served_while_down  # still serving without Redis
                redis_faults.child.start()
                redis_faults.child.wait_until(redis_faults._answers, 30, "PONG")
                await until(lambda: ctl.healthy(s), 60, "the controller to recover")

                async def events_back() -> bool:
                    async with s.get(fstack.router_url + "/readyz") as resp:
                        return bool((await resp.json()).get("events_healthy"))

                await until(events_back, 60, "the router's events to flow again")
                stop.set()
                await traffic
                assert results and all(c.status == 200 for c in results), [
                    c.error for c in results if c.status != 200][:3]  # fmt: skip
                async with Redis.from_url(fstack.cfg.redis_url) as r:
                    assert len(await records(r)) == 2  # the registry survived (AOF)
                    for _ in range(5):
                        await r.xadd(KEYS.events, {"v": "1", "type": "explode", "traj": "x"})

                async def counted() -> bool:
                    return await ctl.metric(s, "prorsa_events_malformed_total") >= 5

                await until(counted, 30, "malformed events to be counted")
                assert ctl.child.alive
            finally:
                ctl.child.stop(10)

    asyncio.run(main())


async def _not(c):  # type: ignore[no-untyped-def]
    return not await c
