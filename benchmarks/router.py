"""Benchmark of the data plane: router overhead and event-writing capacity, on real vLLM.

Prints figures, asserts nothing; every ratio is against a baseline measured in the same run.

1. Overhead: the same short request alternately sent straight to a worker and through the
   router (a `mixed` worker, so the router adds only its own hop), sequentially; the added
   latency is routed minus direct, per pair.
2. Events: a router writing lifecycle events to Redis vs one with events off, under the same
   concurrent load (latency ratio); and the event writer's own capacity into a real Redis.

    .venv/bin/python benchmarks/router.py [--pairs 400] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventWriter
from prorsa.local.model import make_tiny_model
from prorsa.local.processes import Child, free_port
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import Role
from prorsa.policy.events import Event, EventType

BODY = {"model": SERVED_MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=BODY, headers=headers) as r:
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t0


async def overhead(worker: str, router: str, pairs: int) -> None:
    direct: list[float] = []
    routed: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(20):  # warm both paths
            await timed(s, worker, {})
            await timed(s, router, {})
        for i in range(pairs):
            order = [(worker, direct), (router, routed)]
            for url, out in order if i % 2 else order[::-1]:
                out.append(await timed(s, url, {"X-Prorsa-Trajectory": f"b{i}"}))
    added = sorted(r - d for r, d in zip(routed, direct, strict=True))
    print(f"## router overhead · {pairs} pairs · 1-token requests · mixed worker")
    print("| | median ms | p99 ms |")
    print("|---|---|---|")
    for label, xs in (("direct to worker", direct), ("through router", routed),
                      ("added (per pair)", added)):  # fmt: skip
        print(f"| {label} | {1e3 * statistics.median(xs):.2f} | {1e3 * pct(xs, 0.99):.2f} |")
    print(
        f"routed/direct median ratio: {statistics.median(routed) / statistics.median(direct):.3f}"
    )


async def load(url: str, concurrency: int, seconds: float) -> tuple[int, list[float]]:
    lat: list[float] = []
    stop = time.monotonic() + seconds

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        k = 0
        while time.monotonic() < stop:
            lat.append(await timed(s, url, {"X-Prorsa-Trajectory": f"l{i}-{k // 8}"}))
            k += 1

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(i, s) for i in range(concurrency)))
    return len(lat), lat


async def events_cost(with_events: str, without: str, redis_url: str, keys: ClusterKeys) -> None:
    print("\n## event writing under load · 16 concurrent clients · 20 s each, alternating")
    rows = []
    for url, label in ((without, "events off"), (with_events, "events on"),
                       (without, "events off"), (with_events, "events on")):  # fmt: skip
        async with Redis.from_url(redis_url) as r:
            before = await r.xlen(keys.events)
            n, lat = await load(url, 16, 20.0)
            written = await r.xlen(keys.events) - before
        rows.append((label, n / 20.0, statistics.median(lat), written / 20.0))
    print("| router | requests/s | median ms | events/s written |")
    print("|---|---|---|---|")
    for label, rps, med, eps in rows:
        print(f"| {label} | {rps:.1f} | {1e3 * med:.2f} | {eps:.0f} |")
    on = [r for r in rows if r[0] == "events on"]
    off = [r for r in rows if r[0] == "events off"]
    print(f"requests/s with events / without: {sum(r[1] for r in on) / sum(r[1] for r in off):.3f}")


async def writer_capacity(redis_url: str, n: int = 200_000) -> None:
    async with Redis.from_url(redis_url) as r:
        w = EventWriter(r, "bench:events", max_buffer=n)
        task = asyncio.create_task(w.run())
        ev = Event(EventType.DECODE_DONE, "traj-000001", time.time(), worker="worker-0",
                   output_tokens=123, seconds=0.5)  # fmt: skip
        t0 = time.perf_counter()
        for _ in range(n):
            w.emit(ev)
        emit_s = time.perf_counter() - t0
        while w.pending:
            await asyncio.sleep(0.01)
        total_s = time.perf_counter() - t0
        task.cancel()
    print(f"\n## event writer capacity · {n} events into a real Redis")
    print(f"emit (request path): {1e6 * emit_s / n:.2f} µs/event; "
          f"written: {n / total_s:,.0f} events/s (pipelined batches of {w.batch})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    wd = Path(tempfile.mkdtemp(prefix="prorsa-bench-"))
    model = make_tiny_model(args.model or wd / "tiny")
    keys = ClusterKeys("bench", "router")
    with RedisServer(wd / "redis") as redis:
        stack = LocalStack(StackConfig(model=model, workdir=wd, redis_url=redis.url,
                                       roles=[Role.MIXED], keys=keys))  # fmt: skip
        plain: Child | None = None
        try:
            stack.start()
            stack.wait_ready(900)
            worker = stack.workers[0].url
            port = free_port()
            plain = Child("router-no-events", [
                sys.executable, "-m", "prorsa.cli", "router", "--host", "127.0.0.1",
                "--port", str(port), "--discovery", "static",
                "--worker", f"worker-0={worker}@mixed", "--log-level", "warning",
            ], wd / "router-plain.log").start()  # fmt: skip
            plain.wait_until(lambda: True, 1, "start")
            time.sleep(2)
            asyncio.run(overhead(worker, stack.router_url, args.pairs))
            asyncio.run(events_cost(stack.router_url, f"http://127.0.0.1:{port}", redis.url, keys))
            asyncio.run(writer_capacity(redis.url))
        finally:
            if plain is not None:
                plain.stop(5)
            stack.stop()


if __name__ == "__main__":
    main()
