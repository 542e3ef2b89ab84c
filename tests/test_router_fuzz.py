"""Hostile and broken clients at the router, property-based (Hypothesis).

One router with two OpenAI-shaped workers (a prefill and a decode worker that answer like vLLM,
KV transfer parameters included) and a real Redis runs on its own event loop in a thread; the
tests are plain blocking HTTP clients. Every case must get either a completion or an OpenAI-
shaped 4xx, leave no request in flight on any worker, and write only well-formed lifecycle
events; the router must keep serving throughout.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis

from prorsa.events.keys import ClusterKeys
from prorsa.events.schema import decode
from prorsa.local.processes import free_port
from prorsa.local.redis_server import RedisServer
from prorsa.policy.allocate import Role
from prorsa.router.app import Router, RouterConfig
from prorsa.router.discovery import Endpoint, StaticDiscovery

KEYS = ClusterKeys("t", "fuzz")
MAX_BODY = 256 * 1024


async def _worker_turn(request: web.Request) -> web.StreamResponse:
    """What vLLM answers: 400 for what it would refuse, a (streamed) completion otherwise."""
    body = await request.json()
    if (body.get("max_tokens") or 1) > 4096:  # null: the engine's default, as in vLLM
        err = {
            "error": {
                "message": "max_tokens too large",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
        return web.json_response(err, status=400)
    chat = request.path.endswith("chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
    out: dict[str, Any] = {
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    kv = body.get("kv_transfer_params") or {}
    if kv.get("do_remote_decode"):
        out["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "e",
            "remote_block_ids": [1],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
    if not body.get("stream"):
        return web.json_response(out)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(20):  # slow enough for a client to leave mid-stream
        delta = {"choices": [{"index": 0, "text": "x", "delta": {"content": "x"}}]}
        await resp.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
        await asyncio.sleep(0.02)
    await resp.write(b"data: " + json.dumps({"choices": [], "usage": out["usage"]}).encode())
    await resp.write(b"\n\ndata: [DONE]\n\n")
    return resp


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@dataclass
class Served:
    url: str
    host: str
    port: int
    router: Router
    loop: asyncio.AbstractEventLoop
    redis_url: str
    cases: dict[str, int] = field(default_factory=dict)

    def inflight(self) -> int:
        return sum(w.inflight for w in self.router.pool.workers.values())


@pytest.fixture(scope="module")
def served(redis_server: RedisServer) -> Iterator[Served]:
    redis_url = redis_server.url
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        runners = []
        eps = []
        for name, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
            app = web.Application()
            app.router.add_post("/v1/completions", _worker_turn)
            app.router.add_post("/v1/chat/completions", _worker_turn)
            app.router.add_get("/health", _health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            eps.append(Endpoint(name, f"http://127.0.0.1:{port}", role))
        cfg = RouterConfig(KEYS, redis_url=redis_url, max_body_bytes=MAX_BODY)
        router = Router(cfg, StaticDiscovery(eps))
        runner = web.AppRunner(router.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        state.update(router=router, port=port)
        ready.set()
        await stop.wait()
        for r in reversed(runners):
            await r.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    Redis.from_url(redis_url).delete(KEYS.events)
    s = Served(
        f"http://127.0.0.1:{state['port']}",
        "127.0.0.1",
        state["port"],
        state["router"],
        loop,
        redis_url,
    )
    time.sleep(0.1)  # discovery
    yield s
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    print("\nrouter fuzz cases tried:", ", ".join(f"{k} {v}" for k, v in sorted(s.cases.items())))


def _post(
    s: Served, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
    try:
        conn.request(
            "POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
        )
        r = conn.getresponse()
        raw = r.read()
        ctype = r.getheader("Content-Type") or ""
        if "event-stream" in ctype:
            return r.status, raw
        return r.status, json.loads(raw)
    finally:
        conn.close()


def _settle(s: Served) -> None:
    deadline = time.monotonic() + 5
    while s.inflight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.inflight() == 0, "a request was left in flight on a worker"


def _check(s: Served, status: int, data: Any, kind: str) -> None:
    key = f"{kind} -> {status}"
    s.cases[key] = s.cases.get(key, 0) + 1
    assert status == 200 or 400 <= status < 500, (status, data)
    if status != 200:
        assert set(data["error"]) >= {"message", "type", "code"}, data
        assert data["error"]["message"]
    _settle(s)


json_scalar = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=20)
)
json_value = st.recursive(
    json_scalar,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "stream",
    "temperature",
    "user",
    "max_completion_tokens",
    "min_tokens",
    "stream_options",
]
edge = st.sampled_from([0, -1, 1, 2**31, 2**63, 1e308, -0.0, "", "x" * 300, [], {}, None, True])


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[bool, dict[str, Any]]:
    """A valid request, then (half the time) one to three fields broken or added."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "m"}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}]
    else:
        body["prompt"] = draw(
            st.text(min_size=1, max_size=40)
            | st.lists(st.integers(0, 50000), min_size=1, max_size=8)
        )
    for name, value in (
        ("max_tokens", st.integers(1, 6000)),
        ("stream", st.booleans()),
        ("n", st.integers(1, 2)),
        ("temperature", st.floats(0, 2)),
        ("user", st.text(min_size=1, max_size=40)),
    ):
        if draw(st.booleans()):
            body[name] = draw(value)
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            body[name] = draw(edge | json_value)
    return chat, body


SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(case=openai_bodies())
def test_any_openai_shaped_body_is_served_or_refused_cleanly(
    served: Served, case: tuple[bool, dict[str, Any]]
) -> None:
    chat, body = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        raw = json.dumps(body).encode()
    except ValueError:  # NaN and friends are JSON to Python but not to every client
        raw = json.dumps(body, allow_nan=True).encode()
    status, data = _post(served, path, raw)
    _check(served, status, data, "openai body")


@SETTINGS
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_malformed_bytes_get_a_400(served: Served, raw: bytes) -> None:
    status, data = _post(served, "/v1/completions", raw)
    _check(served, status, data, "malformed bytes")


@SETTINGS
@given(
    traj=st.text(
        st.characters(blacklist_categories=["Cs", "Cc"], blacklist_characters="/?#%"),
        min_size=1,
        max_size=300,
    ),
    action=st.sampled_from(["tool_start", "tool_end", "end", "explode"]),
    body=st.none() | json_value,
)
def test_trajectory_hints_with_any_id_and_body(
    served: Served, traj: str, action: str, body: Any
) -> None:
    from urllib.parse import quote

    raw = b"" if body is None else json.dumps(body, allow_nan=True).encode()
    status, data = _post(served, f"/prorsa/v1/trajectories/{quote(traj, safe='')}/{action}", raw)
    served.cases["hint"] = served.cases.get("hint", 0) + 1
    assert status in (202, 400, 404), (status, data)
    if status != 202:
        assert data["error"]["message"]


def test_oversized_bodies_get_413_and_the_router_keeps_serving(served: Served) -> None:
    for size in (MAX_BODY + 1, 4 * MAX_BODY):
        body = json.dumps({"model": "m", "prompt": "a" * size}).encode()
        status, data = _post(served, "/v1/completions", body)
        _check(served, status, data, "oversized")
        assert status == 413
    ok, _ = _post(served, "/v1/completions", b'{"model": "m", "prompt": "hi"}')
    assert ok == 200


def test_slow_loris_uploads_do_not_stop_other_clients(served: Served) -> None:
    socks = []
    for _ in range(20):
        sk = socket.create_connection((served.host, served.port), timeout=5)
        sk.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b'\r\nContent-Length: 100000\r\n\r\n{"model": "m", '
        )
        socks.append(sk)
    try:
        t0 = time.monotonic()
        status, _ = _post(served, "/v1/completions", b'{"model": "m", "prompt": "hi"}')
        assert status == 200 and time.monotonic() - t0 < 5
    finally:
        for sk in socks:
            sk.close()
    served.cases["slow loris"] = len(socks)
    _settle(served)


def test_clients_that_leave_mid_stream_leak_nothing(served: Served) -> None:
    for i in range(10):
        conn = http.client.HTTPConnection(served.host, served.port, timeout=30)
        body = json.dumps(
            {
                "model": "m",
                "prompt": f"stream {i}",
                "stream": True,
                "max_tokens": 16,
                "user": f"leaver-{i}",
            }
        )
        conn.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200
        r.read(20)  # the first bytes of the stream, then gone
        conn.sock.close() if conn.sock else None
        conn.close()
    served.cases["left mid-stream"] = 10
    _settle(served)
    text = http.client.HTTPConnection(served.host, served.port, timeout=10)
    text.request("GET", "/metrics")
    metrics = text.getresponse().read().decode()
    gone = [ln for ln in metrics.splitlines() if ln.startswith("prorsa_router_client_disconnects")]
    assert gone and float(gone[0].rsplit(" ", 1)[1]) >= 1


def test_every_event_written_during_the_fuzz_is_well_formed(served: Served) -> None:
    """Runs last in this module: whatever the clients sent, the stream holds only events the
    controller can read."""
    router = served.router
    deadline = time.monotonic() + 10
    while router.writer is not None and router.writer.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    entries = Redis.from_url(served.redis_url).xrange(KEYS.events)
    assert entries, "the fuzz wrote no lifecycle event at all"
    bad = []
    for _, fields in entries:
        try:
            decode(fields)
        except Exception as e:  # any failure to read an event back is a bug
            bad.append((fields, e))
    assert not bad, bad[:3]
    served.cases["events checked"] = len(entries)
