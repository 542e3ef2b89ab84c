"""Shared helpers for the test suite."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from prorsa.local.redis_server import RedisServer
from prorsa.policy.events import Event, EventType
from prorsa.policy.lifecycle import LifecycleTable


def turn(
    traj: str, t0: float, prompt: int, new: int, out: int, decode_s: float = 1.0
) -> list[Event]:
    """The three events the router writes for one turn."""
    return [
        Event(EventType.TURN_SUBMIT, traj, t0, prompt_tokens=prompt, uncached_tokens=new),
        Event(EventType.PREFILL_DONE, traj, t0 + 0.1, worker="w0", tokens=new, seconds=0.1),
        Event(
            EventType.DECODE_DONE,
            traj,
            t0 + 0.1 + decode_s,
            worker="w1",
            output_tokens=out,
            seconds=decode_s,
        ),
    ]


def fill_windows(tab: LifecycleTable, n: int, window: int = 32768, seed: int = 3) -> None:
    """`n` finished trajectories of up to 12 turns whose observations are 1K or 9K tokens at
    random: each stops once the next would overflow its `window`-token context, so how
    deep it gets depends on the observations it drew, not on a depth."""
    rng = random.Random(seed)
    for i in range(n):
        tid, t, ctx, new = f"w{i}", 0.0, 500, 500
        tab.apply(Event(EventType.TRAJ_START, tid, t))
        for _ in range(12):
            tab.ingest(turn(tid, t, ctx, new, 100))
            ctx += 100
            new = rng.choice((1000, 9000))
            if ctx + 100 + new > window:
                break
            ctx += new
            t += 2.0
        tab.apply(Event(EventType.TRAJ_END, tid, t + 1.5))


# ---- a real Redis server for the adapter tests --------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it)")
    with RedisServer(Path(tmp_path_factory.mktemp("redis"))) as r:
        yield r


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database per test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    yield redis_server.url


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve `app` on a free local port: (its runner, to clean up; the port)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
