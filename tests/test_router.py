"""Router parts without a model: request validation, placement, pool health, the HTTP surface
and the events of client hints (with a real Redis)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.events.schema import decode
from prorsa.local.processes import free_port
from prorsa.policy.allocate import Role
from prorsa.policy.events import EventType
from prorsa.router.app import Router, RouterConfig
from prorsa.router.discovery import Endpoint, StaticDiscovery, parse_static
from prorsa.router.placement import Placement, Plan, TurnFacts
from prorsa.router.pool import Pool
from prorsa.router.requests import ApiError, Kind, parse_turn

KEYS = ClusterKeys("t", "router")


# ---- request validation --------------------------------------------------------------------


def _turn(body: Any, kind: Kind = Kind.COMPLETIONS, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return parse_turn(kind, json.dumps(body).encode(), headers or {})


def test_a_valid_turn_keeps_its_body_and_finds_its_trajectory() -> None:
    t = _turn(
        {"model": "m", "prompt": [1, 2, 3], "user": "u1"}, headers={"X-Prorsa-Trajectory": "t9"}
    )
    assert t.traj == "t9" and t.prompt_ids == [1, 2, 3] and t.can_split
    t = _turn({"model": "m", "prompt": "hi", "user": "u1", "stream": True})
    assert t.traj == "u1" and t.stream and t.prompt_text == "hi"
    t = _turn({"model": "m", "prompt": ["a", "b"]})
    assert t.batched and not t.can_split
    t = _turn({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, Kind.CHAT)
    assert not t.can_split


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": "", "prompt": "hi"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": {"a": 1}}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "user": 5}, "user"),
        # found by the fuzz: a 500 from dict(-1) in the streaming path
        ({"model": "m", "prompt": "x", "stream": True, "stream_options": -1}, "stream_options"),
    ],
)
def test_bad_completions_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        _turn(body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_bad_chat_requests_and_non_objects() -> None:
    for body in ({"model": "m", "messages": []}, {"model": "m", "messages": [{"content": "x"}]}):
        with pytest.raises(ApiError, match="messages"):
            _turn(body, Kind.CHAT)
    with pytest.raises(ApiError, match="JSON object"):
        _turn([1, 2])
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_turn(Kind.COMPLETIONS, b"{nope", {})


# ---- placement -----------------------------------------------------------------------------


def _pool(*specs: str, **state: Any) -> Pool:
    pool = Pool()
    pool.update([parse_static(s) for s in specs])
    for name, changes in state.items():
        for k, v in changes.items():
            setattr(pool.workers[name], k, v)
    return pool


def _facts(**kw: Any) -> TurnFacts:
    base: dict[str, Any] = dict(prompt_tokens=2000, new_tokens=2000, sticky=None,
                                extends_context=False, can_split=True)  # fmt: skip
    return TurnFacts(**{**base, **kw})


def test_a_first_turn_is_split_across_the_pools() -> None:
    pool = _pool("p0=http://a@prefill", "p1=http://b@prefill", "d0=http://c@decode",
                 p0={"queued_prefill_tokens": 5000})  # fmt: skip
    plan = Placement(pool).plan(_facts())
    assert plan is not None and plan.prefill is not None
    assert (plan.prefill.name, plan.decode.name, plan.pool_worthy) == ("p1", "d0", True)


def test_a_short_append_stays_on_its_sticky_decode_worker() -> None:
    pool = _pool("p0=http://a@prefill", "d0=http://c@decode", "d1=http://d@decode")
    placement = Placement(pool, hosted={"d0": 3, "d1": 2})
    plan = placement.plan(_facts(new_tokens=100, sticky="d0", extends_context=True))
    assert plan is not None and plan.prefill is None and plan.decode.name == "d0"
    assert plan.holds_prefix and not plan.pool_worthy
    # a long observation is pool-worthy even with the prefix held
    plan = placement.plan(_facts(new_tokens=3000, prompt_tokens=3500, sticky="d0",
                                 extends_context=True))  # fmt: skip
    assert plan is not None and plan.pool_worthy


def test_draining_workers_get_no_work_of_their_old_role() -> None:
    pool = Pool()
    pool.update([
        Endpoint("p0", "http://a", Role.PREFILL, draining=True, target_role=Role.DECODE),
        Endpoint("d0", "http://c", Role.DECODE),
    ])  # fmt: skip
    placement = Placement(pool)
    plan = placement.plan(_facts())
    assert plan is not None and plan.prefill is None  # no prefill pool left: served whole
    # routing switch mode: a worker draining towards decode may already decode
    placement.hosted = {"d0": 10}
    plan = placement.plan(_facts())
    assert plan is not None and plan.decode.name == "p0"
    # restart mode: it may not
    plan = placement.plan(_facts(routing_switch=False))
    assert plan is not None and plan.decode.name == "d0"


def test_with_no_decode_pool_a_prefill_worker_serves_the_whole_turn() -> None:
    pool = _pool("p0=http://a@prefill", "p1=http://b@prefill", p0={"decode_inflight": 2})
    plan = Placement(pool).plan(_facts())
    assert plan is not None and plan.prefill is None and plan.decode.name == "p1"


def test_ejected_and_excluded_workers_are_skipped_and_none_left_means_none() -> None:
    pool = _pool("m0=http://a@mixed", "m1=http://b@mixed")
    pool.eject(pool.workers["m0"], now=0.0)
    placement = Placement(pool)
    plan = placement.plan(_facts())
    assert plan is not None and plan.decode.name == "m1" and plan.prefill is None
    assert placement.plan(_facts(), exclude=frozenset({"m1"})) is None
    pool.readmit(pool.workers["m0"])
    assert pool.ready_count == 2


def test_ejection_backs_off_and_a_new_process_is_readmitted() -> None:
    pool = _pool("w=http://a:1@decode")
    w = pool.workers["w"]
    pool.eject(w, now=0.0)
    first = w.next_probe_at
    pool.eject(w, now=0.0)
    assert w.next_probe_at > first and not w.healthy
    assert pool.due_for_probe(now=first) == []
    pool.update([parse_static("w=http://a:2@decode")])  # restarted elsewhere
    assert pool.workers["w"].healthy


def test_a_worker_hosting_far_more_than_its_share_sheds_a_trajectory() -> None:
    pool = _pool("d0=http://a@decode", "d1=http://b@decode")
    plan = Placement(pool, hosted={"d0": 30, "d1": 2}).plan(
        _facts(new_tokens=50, sticky="d0", extends_context=True)
    )
    assert plan is not None and plan.decode.name == "d1"


def test_the_worker_a_trajectory_leaves_hands_its_context_over() -> None:
    """In `routing` mode every engine produces and consumes KV: the crowded worker, which
    still holds the context, prefills the moved turn and the new worker pulls the KV (as the
    simulator models it); nothing is recomputed, and the turn reports so."""
    from prorsa.router.tokens import TokenCounter
    from prorsa.router.trajectories import Trajectories

    pool = _pool("p0=http://p@prefill", "d0=http://a@decode", "d1=http://b@decode")
    placement = Placement(pool, hosted={"d0": 30, "d1": 2})
    moved = _facts(prompt_tokens=5000, new_tokens=50, sticky="d0", extends_context=True)
    plan = placement.plan(moved)
    assert plan is not None and plan.handoff and not plan.pool_worthy
    assert (plan.prefill.name if plan.prefill else None, plan.decode.name) == ("d0", "d1")
    # no handoff: in restart mode (a decode engine only consumes KV), from a worker that is
    # gone, for a turn that does not extend the context, or when the trajectory stays put
    for facts, excluded in (
        (replace(moved, routing_switch=False), frozenset[str]()),
        (moved, frozenset({"d0"})),
        (replace(moved, extends_context=False), frozenset[str]()),
    ):
        other = placement.plan(facts, excluded)
        assert other is not None and not other.handoff and other.decode.name == "d1"
    calm = Placement(pool, hosted={"d0": 3, "d1": 2}).plan(moved)
    assert calm is not None and not calm.handoff and calm.decode.name == "d0"

    class Sink:
        def __init__(self) -> None:
            self.events: list[Any] = []

        def emit(self, ev: Any) -> None:
            self.events.append(ev)

    sink = Sink()
    trajs = Trajectories(sink, TokenCounter())  # type: ignore[arg-type]
    body = {"model": "m", "prompt": list(range(100))}
    first = trajs.begin(_turn(body, headers={"X-Prorsa-Trajectory": "t"}))
    trajs.submitted(first, Plan(pool.workers["d0"], None, True, False))
    trajs.decode_done(first, "d0", prompt_tokens=100, output_tokens=20)
    body = {"model": "m", "prompt": list(range(100)) + list(range(20)) + [7] * 30}
    second = trajs.begin(_turn(body, headers={"X-Prorsa-Trajectory": "t"}))
    trajs.submitted(second, Plan(pool.workers["d1"], pool.workers["d0"], False, False, True))
    ev = sink.events[-1]
    assert ev.type == EventType.TURN_SUBMIT
    assert (ev.prompt_tokens, ev.uncached_tokens, ev.held_tokens) == (150, 30, 120)


def test_static_worker_specs() -> None:
    assert parse_static("w0=http://h:1/@decode") == Endpoint("w0", "http://h:1", Role.DECODE)
    for bad in ("w0", "w0=http://h:1", "w0=http://h:1@chef", "=http://h@decode"):
        with pytest.raises(ValueError):
            parse_static(bad)


# ---- the HTTP surface ----------------------------------------------------------------------


def _with_router(
    test: Callable[[TestClient, Router], Awaitable[None]],
    endpoints: list[Endpoint] | None = None,
    redis_url: str | None = None,
    max_body_bytes: int = 1 << 20,
) -> None:
    async def main() -> None:
        cfg = RouterConfig(KEYS, redis_url=redis_url, max_body_bytes=max_body_bytes,
                           probe_interval_s=0.05, eject_s=0.05)  # fmt: skip
        router = Router(cfg, StaticDiscovery(endpoints or []))
        async with TestClient(TestServer(router.app())) as client:
            await asyncio.sleep(0.05)  # discovery
            await test(client, router)

    asyncio.run(main())


def test_bad_input_gets_openai_errors_and_is_counted() -> None:
    async def test(client: TestClient, router: Router) -> None:
        cases = [
            ("/v1/completions", b"{oops", 400),
            ("/v1/completions", b'{"model":"m"}', 400),
            ("/v1/chat/completions", b'{"model":"m","messages":"hi"}', 400),
            ("/v1/completions", b'{"model":"m","prompt":"' + b"x" * 2_000_000 + b'"}', 413),
            ("/prorsa/v1/trajectories/t/explode", b"", 404),
            ("/prorsa/v1/trajectories/t/tool_start", b'{"expected_seconds":"soon"}', 400),
            ("/v1/unknown", b"{}", 404),
        ]
        for path, body, status in cases:
            r = await client.post(path, data=body)
            data = await r.json()
            assert r.status == status, (path, data)
            assert set(data["error"]) == {"message", "type", "param", "code"}
        r = await client.get("/v1/completions")
        assert r.status == 405 and "error" in await r.json()
        text = await (await client.get("/metrics")).text()
        assert 'prorsa_router_bad_requests_total{status="400"} 4.0' in text

    _with_router(test)


def test_no_worker_means_503_and_not_ready() -> None:
    async def test(client: TestClient, router: Router) -> None:
        assert (await client.get("/healthz")).status == 200
        r = await client.get("/readyz")
        assert r.status == 503 and (await r.json())["ready_workers"] == 0
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status == 503 and (await r.json())["error"]["type"] == "unavailable"

    _with_router(test)


def test_an_unreachable_worker_is_ejected_then_probed(redis_url: str) -> None:
    dead = Endpoint("w0", f"http://127.0.0.1:{free_port()}", Role.MIXED)

    async def test(client: TestClient, router: Router) -> None:
        assert (await client.get("/readyz")).status == 200
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        body = await r.json()
        assert r.status == 503 and "w0" in body["error"]["message"]
        assert router.pool.workers["w0"].ejected
        assert (await client.get("/readyz")).status == 503
        await asyncio.sleep(0.3)  # probes keep failing: still out
        assert router.pool.workers["w0"].ejected and router.pool.workers["w0"].failures >= 2
        text = await (await client.get("/metrics")).text()
        assert 'prorsa_router_ejections_total{worker="w0"} 1.0' in text
        assert 'prorsa_router_requests_total{code="503",kind="completions",path="none"}' in text

    _with_router(test, [dead], redis_url)


async def _fake_worker(break_turns: bool, health: bool) -> tuple[TestServer, Endpoint]:
    """An OpenAI-shaped worker; `break_turns` drops the connection of every turn without an
    answer (what an engine killed mid-request does), `health` is what /health says."""

    async def turn(request: web.Request) -> web.StreamResponse:
        if break_turns:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        usage = {"prompt_tokens": 2, "completion_tokens": 1}
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                  "usage": usage})  # fmt: skip

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(status=200 if health else 503)

    app = web.Application()
    app.router.add_post("/v1/completions", turn)
    app.router.add_get("/health", healthz)
    server = TestServer(app)
    await server.start_server()
    return server, Endpoint("", str(server.make_url("")).rstrip("/"), Role.MIXED)


@pytest.mark.parametrize("alive", [True, False])
def test_a_connection_lost_mid_turn_ejects_only_a_worker_that_fails_health(alive: bool) -> None:
    """A turn whose connection breaks is retried elsewhere at once; the worker is ejected on that
    first failure when its /health does not answer either (a dead engine), and keeps serving
    otherwise (a live engine that dropped one connection takes a strike)."""

    async def main() -> None:
        broken, ep_b = await _fake_worker(break_turns=True, health=alive)
        good, ep_g = await _fake_worker(break_turns=False, health=True)
        eps = [replace(ep_b, name="broken"), replace(ep_g, name="good")]
        cfg = RouterConfig(KEYS, probe_interval_s=60, eject_s=60)
        router = Router(cfg, StaticDiscovery(eps))
        try:
            async with TestClient(TestServer(router.app())) as client:
                await asyncio.sleep(0.05)
                for i in range(2):  # the router's placement may try either worker first
                    body = {"model": "m", "prompt": "hi", "user": f"t{i}"}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status == 200, await r.text()
                w = router.pool.workers["broken"]
                text = await (await client.get("/metrics")).text()
                tried = 'prorsa_router_retries_total{reason="error"}' in text
                assert tried, "no turn was placed on the broken worker"
                assert w.ejected is (not alive)
                ejected = 'prorsa_router_ejections_total{worker="broken"} 1.0' in text
                assert ejected is (not alive)
                assert not router.pool.workers["good"].ejected
        finally:
            await broken.close()
            await good.close()

    asyncio.run(main())


def test_hints_become_lifecycle_events_on_the_stream(redis_url: str) -> None:
    async def test(client: TestClient, router: Router) -> None:
        base = "/prorsa/v1/trajectories/traj-1"
        assert (await client.post(base + "/tool_start", json={"expected_seconds": 3})).status == 202
        assert (await client.post(base + "/tool_end")).status == 202
        assert (await client.post(base + "/end", json={"reason": "solved"})).status == 202
        assert router.writer is not None
        while router.writer.pending:
            await asyncio.sleep(0.01)
        async with Redis.from_url(redis_url) as r:
            events = [decode(f) for _, f in await r.xrange(KEYS.events)]
        assert [e.type for e in events] == [
            EventType.TOOL_START, EventType.TOOL_END, EventType.TRAJ_END
        ]  # fmt: skip
        assert events[0].expected_seconds == 3.0 and events[2].reason == "solved"

    _with_router(test, redis_url=redis_url)


def test_router_serves_while_redis_is_unreachable() -> None:
    async def test(client: TestClient, router: Router) -> None:
        r = await client.post("/prorsa/v1/trajectories/t/tool_end")
        assert r.status == 202
        await asyncio.sleep(0.3)
        assert router.writer is not None and not router.writer.healthy
        r = await client.get("/readyz")
        assert (await r.json())["events_healthy"] is False

    _with_router(test, redis_url=f"redis://127.0.0.1:{free_port()}")


# ---- per-trajectory memory -----------------------------------------------------------------


def test_appends_are_recognised_and_homes_are_counted() -> None:
    from prorsa.router.placement import Plan
    from prorsa.router.tokens import TokenCounter
    from prorsa.router.trajectories import Trajectories

    trajs = Trajectories(None, TokenCounter())
    pool = _pool("d0=http://a@decode", "d1=http://b@decode")
    first = trajs.begin(
        _turn({"model": "m", "prompt": list(range(100))}, headers={"X-Prorsa-Trajectory": "t"})
    )
    assert not first.facts.extends_context and first.facts.new_tokens == 100
    trajs.submitted(first, Plan(pool.workers["d0"], None, True, False))
    trajs.decode_done(first, "d0", prompt_tokens=100, output_tokens=20)
    assert trajs.hosted == {"d0": 1}

    grown = list(range(100)) + list(range(20)) + [7] * 30  # answer + observation appended
    second = trajs.begin(
        _turn({"model": "m", "prompt": grown}, headers={"X-Prorsa-Trajectory": "t"})
    )
    assert second.facts.extends_context and second.facts.sticky == "d0"
    assert second.facts.new_tokens == 150 - 120
    trajs.decode_done(second, "d1", prompt_tokens=150, output_tokens=5)
    assert trajs.hosted == {"d1": 1}

    rewritten = [9] * 200  # the agent rewrote its context: not an append
    third = trajs.begin(
        _turn({"model": "m", "prompt": rewritten}, headers={"X-Prorsa-Trajectory": "t"})
    )
    assert not third.facts.extends_context and third.facts.new_tokens == 200
    trajs.forget_worker("d1")
    assert not trajs.hosted
    trajs.end("t", "done")
    assert len(trajs) == 0


def test_a_workers_engines_report_their_in_flight_requests_as_the_worker(redis_url: str) -> None:
    """Two engines of one worker (endpoints naming it) and a worker of its own: the `workers`
    hash gets one field per worker, the engines' counts summed, and the fields go when the
    router stops."""

    async def test(client: TestClient, router: Router) -> None:
        router.pool.workers["w0"].decode_inflight = 2
        router.pool.workers["w0-1"].decode_inflight = 3
        router.pool.workers["w0-1"].prefill_inflight = 1
        router.pool.workers["w1"].prefill_inflight = 4
        async with Redis.from_url(redis_url) as r:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                counts = inflight.parse(await r.hgetall(KEYS.workers), time.time(), 5.0)
                if counts.get("w0", inflight.Inflight()).total == 6:
                    break
                await asyncio.sleep(0.05)
            assert {k: (v.prefill, v.decode) for k, v in counts.items()} == {
                "w0": (1, 5), "w1": (4, 0)}  # fmt: skip

    eps = [Endpoint("w0", "http://127.0.0.1:9", Role.DECODE),
           Endpoint("w0-1", "http://127.0.0.1:10", Role.DECODE, worker="w0"),
           Endpoint("w1", "http://127.0.0.1:11", Role.PREFILL)]  # fmt: skip
    _with_router(test, eps, redis_url=redis_url)

    async def after() -> dict[bytes, bytes]:
        async with Redis.from_url(redis_url) as r:
            return await r.hgetall(KEYS.workers)  # type: ignore[no-any-return]

    assert asyncio.run(after()) == {}
