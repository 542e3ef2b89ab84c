"""The data plane on real vLLM: disaggregated serving is exact, roles switch live without a
failed request, a dead worker costs no non-streamed turn, and every turn lands on the stream.
Tests run in file order on one shared cluster (the switching test leaves roles swapped)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import defaultdict
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from e2e.client import TIMEOUT, VOCAB, Completion, Rollout, complete, metric
from e2e.conftest import KEYS
from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events.schema import decode
from prorsa.local.cluster import LocalCluster
from prorsa.local.registry import Registry
from prorsa.local.stack import LocalStack
from prorsa.policy.allocate import Role
from prorsa.policy.events import EventType


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    """Token-id prompts from 3 to ~700 tokens (roughly geometric)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, VOCAB) for _ in range(int(3 * 1.3**i) + rng.randrange(3))]
        for i in range(n)
    ]


async def _worker_roles(redis_url: str) -> dict[str, Role]:
    async with Redis.from_url(redis_url, socket_timeout=30) as r:
        return {w.name: w.role for w in await Registry(r, KEYS).list()}


def test_greedy_equivalence_through_disaggregated_path(stack: LocalStack) -> None:
    """Prefill on worker-0, KV pulled over NIXL by worker-1, decode there: same tokens as
    worker-1 serving the prompt alone."""

    async def main() -> None:
        roles = await _worker_roles(stack.cfg.redis_url)
        assert roles == {"worker-0": Role.PREFILL, "worker-1": Role.DECODE}
        decoder = stack.workers[1].url
        cases = prompts(22) + ["The agent reads the repository and runs the tests."] * 1
        cases.append("Prefill computes the prompt; decode produces one token at a time. " * 9)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            pulls_before = await metric(s, decoder, "vllm:nixl_xfer_time_seconds_count")
            mismatches = []
            for i, p in enumerate(cases):
                alone = await complete(s, decoder, p, 24)
                streamed = i % 4 == 3  # half of those without usage: the router hides its own
                routed = await complete(
                    s, stack.router_url, p, 24, stream=streamed, stream_usage=i % 8 == 3
                )
                if streamed:
                    assert bool(routed.usage) == (i % 8 == 3)
                assert alone.status == routed.status == 200, (alone.error, routed.error)
                assert len(alone.token_ids) == 24
                if routed.token_ids != alone.token_ids:
                    mismatches.append((i, alone.token_ids, routed.token_ids))
            pulls = await metric(s, decoder, "vllm:nixl_xfer_time_seconds_count") - pulls_before
        assert not mismatches, f"{len(mismatches)} of {len(cases)} differ: {mismatches[:2]}"
        assert pulls >= len(cases), f"only {pulls} NIXL pulls for {len(cases)} routed prompts"

    asyncio.run(main())


def test_live_role_switching_loses_nothing(stack: LocalStack) -> None:
    """24 trajectories run while the two workers swap roles 5 times through the drain
    protocol (drain, wait for in-flight zero, relabel, undrain): no failed request."""

    async def main() -> None:
        rollout = Rollout(stack.router_url, 24)
        outcomes: list[SwitchOutcome] = []
        async with (
            Redis.from_url(stack.cfg.redis_url, socket_timeout=30) as r,
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
        ):
            cluster = LocalCluster(r, KEYS)
            runners = [asyncio.create_task(rollout.trajectory(s, i)) for i in range(rollout.n)]
            await asyncio.sleep(3)
            a, b = "worker-0", "worker-1"  # a: prefill, b: decode
            for _ in range(5):
                outcomes.append(await switch(cluster, a, Role.DECODE, drain_timeout_s=60))
                outcomes.append(await switch(cluster, b, Role.PREFILL, drain_timeout_s=60))
                a, b = b, a
                await asyncio.sleep(1.0)
            while rollout.total_turns < 220 and not rollout.failures:
                await asyncio.sleep(0.5)
            rollout.stop.set()
            await asyncio.gather(*runners)
        assert not rollout.failures, rollout.failures[:5]
        assert outcomes == [SwitchOutcome.DONE] * 10
        assert rollout.total_turns >= 200 and len(rollout.turns) >= 24
        assert all(c.finish_reason == "length" for t in rollout.turns.values() for c in t)
        assert await _worker_roles(stack.cfg.redis_url) == {
            "worker-0": Role.DECODE,
            "worker-1": Role.PREFILL,
        }
        test_live_role_switching_loses_nothing.rollout = rollout  # type: ignore[attr-defined]

    asyncio.run(main())


def test_stream_holds_every_turn_with_consistent_counts(stack: LocalStack) -> None:
    rollout: Rollout | None = getattr(test_live_role_switching_loses_nothing, "rollout", None)
    if rollout is None:
        pytest.fail("needs the role-switching run (run the whole file)")

    async def main() -> dict[str, dict[EventType, list[Any]]]:
        by_traj: dict[str, dict[EventType, list[Any]]] = defaultdict(lambda: defaultdict(list))
        async with Redis.from_url(stack.cfg.redis_url, socket_timeout=30) as r:
            await asyncio.sleep(1.0)  # the router flushes its batches
            seen: set[tuple[str, EventType, float]] = set()
            for _id, fields in await r.xrange(KEYS.events):
                ev = decode(fields)
                # delivery is at least once (a batch whose reply was lost is sent again);
                # consumers drop repeats by (trajectory, type, timestamp), as the table does
                if ev.traj.startswith("sw-") and (ev.traj, ev.type, ev.ts) not in seen:
                    seen.add((ev.traj, ev.type, ev.ts))
                    by_traj[ev.traj][ev.type].append(ev)
        return by_traj

    events = asyncio.run(main())
    assert set(events) == set(rollout.turns)
    for traj, turns in rollout.turns.items():
        ev = events[traj]
        assert len(ev[EventType.TRAJ_START]) == 1
        assert len(ev[EventType.TURN_SUBMIT]) == len(turns), traj
        assert len(ev[EventType.PREFILL_DONE]) == len(ev[EventType.DECODE_DONE]) == len(turns)
        submitted = [e.prompt_tokens for e in ev[EventType.TURN_SUBMIT]]
        assert submitted == [c.usage["prompt_tokens"] for c in turns], traj
        outputs = [e.output_tokens for e in ev[EventType.DECODE_DONE]]
        assert outputs == [c.usage["completion_tokens"] for c in turns], traj
        for sub, pre in zip(ev[EventType.TURN_SUBMIT], ev[EventType.PREFILL_DONE], strict=True):
            assert 1 <= pre.tokens <= sub.prompt_tokens
            assert sub.uncached_tokens <= sub.prompt_tokens
        if int(traj.split("-")[1]) % 2 == 0 and len(turns) > 1:
            assert ev[EventType.TOOL_START] and ev[EventType.TOOL_END]


def test_killed_worker_costs_no_turn_and_comes_back(stack: LocalStack) -> None:
    """SIGKILL the decode worker's engine mid-run: non-streamed turns finish on the other
    worker; the router ejects it, the agent restarts it, the router re-admits it."""

    async def main() -> None:
        victim = "worker-0"  # decode after the switching test
        async with (
            Redis.from_url(stack.cfg.redis_url, socket_timeout=30) as r,
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
        ):
            rec = {w.name: w for w in await Registry(r, KEYS).list()}[victim]
            assert rec.role is Role.DECODE and rec.pid > 0
            ejections = await metric(s, stack.router_url, "prorsa_router_ejections_total")
            retries = await metric(s, stack.router_url, "prorsa_router_retries_total")
            inflight = f'prorsa_router_inflight{{phase="decode",role="decode",worker="{victim}"}}'
            results: list[Completion] = []

            async def turn(i: int) -> None:
                p = prompts(12, seed=100 + i)[-1]
                for _k in range(3):
                    results.append(await complete(s, stack.router_url, p, 48, traj=f"kill-{i}"))
                    p = p + results[-1].token_ids

            load = [asyncio.create_task(turn(i)) for i in range(8)]
            # Kill on evidence, not after a sleep: the router has decodes in flight there.
            deadline = time.monotonic() + 120
            while await metric(s, stack.router_url, inflight) < 1:
                assert time.monotonic() < deadline, "no decode ever reached the victim"
                assert not all(t.done() for t in load), "the load ended before the kill"
                await asyncio.sleep(0.02)
            os.killpg(rec.pid, signal.SIGKILL)
            await asyncio.gather(*load)
            assert [c.status for c in results] == [200] * 24, [c.error for c in results]
            assert all(len(c.token_ids) == 48 for c in results)
            # The turns that were on the victim were retried, and the lost connections plus a
            # failed /health took it out of rotation at once.
            assert await metric(s, stack.router_url, "prorsa_router_retries_total") > retries
            assert await metric(s, stack.router_url, "prorsa_router_ejections_total") > ejections

            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                ready = await metric(
                    s, stack.router_url, 'prorsa_router_workers{role="decode",state="ready"}'
                )
                if ready >= 1 and stack.ready_workers() == 2:
                    break
                await asyncio.sleep(1)
            assert stack.ready_workers() == 2, "restarted worker never re-admitted"
            after = [await complete(s, stack.router_url, p, 8) for p in prompts(6, seed=9)]
            assert all(c.status == 200 for c in after)
            served = await metric(s, stack.workers[0].url, "vllm:request_success_total")
            assert served > 0, "the restarted worker serves again"

    asyncio.run(main())


def test_bad_input_gets_openai_errors_and_router_keeps_serving(stack: LocalStack) -> None:
    async def main() -> None:
        url = stack.router_url
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            cases: list[tuple[str, bytes, int]] = [
                ("/v1/completions", b"{not json", 400),
                ("/v1/completions", b'{"model": "tiny"}', 400),
                ("/v1/completions", b'{"prompt": "hi"}', 400),
                ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": "x"}', 400),
                ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400),
                ("/v1/completions", b'{"model":"tiny","prompt":"' + b"a" * (33 << 20) + b'"}', 413),
                ("/prorsa/v1/trajectories/t1/explode", b"", 404),
                ("/v1/nothing", b"{}", 404),
            ]
            for path, body, status in cases:
                async with s.post(url + path, data=body) as r:
                    data = await r.json(content_type=None)
                    assert r.status == status, (path, body[:40], r.status, data)
                    assert data["error"]["message"] and data["error"]["type"]
            ok = await complete(s, url, "still serving", 4)
            assert ok.status == 200 and len(ok.token_ids) == 4

    asyncio.run(main())
