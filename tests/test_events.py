"""The stream encoding, the batching writer (with a real Redis that goes away and comes
back) and the in-flight hash."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.events.schema import EventError, decode, encode
from prorsa.events.stream import EventWriter
from prorsa.local.redis_server import RedisServer
from prorsa.policy.events import Event, EventType

KEYS = ClusterKeys("ns", "demo")


def test_keys_follow_the_design_prefix() -> None:
    assert KEYS.events == "prorsa:ns:demo:events"
    assert KEYS.workers == "prorsa:ns:demo:workers"
    assert ClusterKeys.parse("team-a/rollout") == ClusterKeys("team-a", "rollout")
    assert ClusterKeys.parse("rollout") == ClusterKeys("default", "rollout")
    with pytest.raises(ValueError, match="namespace/name"):
        ClusterKeys.parse("a/b/c")


EVENTS = [
    Event(EventType.TRAJ_START, "t1", 10.0, group="g7"),
    Event(EventType.TURN_SUBMIT, "t1", 10.5, prompt_tokens=900, uncached_tokens=40, remote=False),
    Event(EventType.PREFILL_DONE, "t1", 10.7, worker="w0", tokens=40, seconds=0.2),
    Event(EventType.DECODE_DONE, "t1", 12.0, worker="w1", output_tokens=77, seconds=1.3),
    Event(EventType.TOOL_START, "t1", 12.1, expected_seconds=4.5),
    Event(EventType.TOOL_END, "t1", 16.0),
    Event(EventType.TRAJ_END, "t1", 16.1, reason="done"),
]


@pytest.mark.parametrize("ev", EVENTS, ids=lambda e: e.type.value)
def test_every_event_type_round_trips(ev: Event) -> None:
    fields = encode(ev)
    assert fields["v"] == "1" and fields["type"] == ev.type.value
    wire = {k.encode(): v.encode() for k, v in fields.items()}  # as Redis returns them
    assert decode(wire) == ev


@given(
    traj=st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s),
    ts=st.floats(min_value=0, max_value=4e9),
    prompt=st.integers(0, 10**7),
    uncached=st.integers(0, 10**7),
    remote=st.booleans(),
    held=st.none() | st.integers(0, 10**7),
    pool=st.none() | st.integers(0, 10**7),
)
def test_turn_submit_round_trips_for_any_values(
    traj: str, ts: float, prompt: int, uncached: int, remote: bool, held: int | None,
    pool: int | None,
) -> None:  # fmt: skip
    ev = Event(EventType.TURN_SUBMIT, traj, ts, prompt_tokens=prompt, uncached_tokens=uncached,
               remote=remote, held_tokens=held, pool_tokens=pool)  # fmt: skip
    assert decode(encode(ev)) == ev


GOOD = {"v": "1", "type": "prefill_done", "traj": "t", "ts": "1.5", "worker": "w0",
        "tokens": "12", "seconds": "0.1"}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": "9"}, "schema version"),
        ({"type": "teleport"}, "unknown event type"),
        ({"traj": ""}, "traj"),
        ({"ts": "yesterday"}, "'ts' is not a number"),
        ({"ts": "nan"}, "finite"),
        ({"tokens": "-3"}, ">= 0"),
        ({"tokens": "2.5"}, "integer"),
        ({"worker": ""}, "needs field 'worker'"),
        ({"seconds": None}, "missing field 'seconds'"),
        ({"remote": "maybe"}, "'remote' must be 0 or 1"),
    ],
)
def test_malformed_entries_are_rejected_with_the_reason(
    change: dict[str, str | None], message: str
) -> None:
    fields = {**GOOD, **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(EventError, match=message):
        decode(fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("held_tokens", "2.5", "integer"), ("pool_tokens", "-1", ">= 0"),
    ("held_tokens", "lots", "not a number"),
])  # fmt: skip
def test_malformed_optional_turn_fields_are_rejected(field: str, value: str, message: str) -> None:
    fields = {"v": "1", "type": "turn_submit", "traj": "t", "ts": "1.5", "prompt_tokens": "900",
              "uncached_tokens": "40", field: value}  # fmt: skip
    with pytest.raises(EventError, match=message):
        decode(fields)  # type: ignore[arg-type]


def test_undecodable_bytes_are_an_event_error() -> None:
    with pytest.raises(EventError, match="UTF-8"):
        decode({b"v": b"1", b"type": b"\xff\xfe"})


def test_inflight_sums_router_replicas_and_ignores_stale_or_broken() -> None:
    raw = {
        b"w0|r1": inflight.value(2, 1, 100.0).encode(),
        b"w0|r2": inflight.value(1, 4, 99.0).encode(),
        b"w0|gone": inflight.value(9, 9, 10.0).encode(),  # stale router
        b"w1|r1": b"{not json",
        b"w2|r1": json.dumps({"prefill": 1}).encode(),
    }
    got = inflight.parse(raw, now=101.0, max_age_s=5.0)
    assert got == {"w0": inflight.Inflight(3, 5, as_of=99.0)}


def test_writer_delivers_batches_in_order(redis_url: str) -> None:
    async def main() -> list[Event]:
        async with Redis.from_url(redis_url) as r:
            w = EventWriter(r, KEYS.events, batch=7)
            task = asyncio.create_task(w.run())
            sent = [Event(EventType.TOOL_END, f"t{i}", float(i)) for i in range(50)]
            for ev in sent:
                w.emit(ev)
            while w.pending:
                await asyncio.sleep(0.01)
            task.cancel()
            assert w.written == 50 and w.dropped == 0 and w.healthy
            return [decode(f) for _, f in await r.xrange(KEYS.events)]

    got = asyncio.run(main())
    assert [e.traj for e in got] == [f"t{i}" for i in range(50)]


def test_writer_survives_redis_going_away_and_counts_what_it_drops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "r").start()

    async def main() -> None:
        r = Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
        w = EventWriter(r, KEYS.events, max_buffer=10, max_backoff_s=0.2)
        task = asyncio.create_task(w.run())
        w.emit(Event(EventType.TOOL_END, "before", 1.0))
        while w.pending:
            await asyncio.sleep(0.01)
        server.stop()
        for i in range(15):  # nothing blocks while Redis is away
            w.emit(Event(EventType.TOOL_END, f"during{i}", 2.0 + i))
        await asyncio.sleep(0.5)
        assert not w.healthy and w.dropped == 5 and w.pending == 10
        server.child.start()
        server.child.wait_until(server._answers, 20, "PONG")
        for _ in range(200):
            if not w.pending:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        assert w.healthy and w.written == 11
        got = [decode(f).traj for _, f in await r.xrange(KEYS.events)]
        # the restarted server kept nothing (no persistence); the buffered newest arrived
        assert got == [f"during{i}" for i in range(5, 15)]
        await r.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()
