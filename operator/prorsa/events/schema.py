"""The stream encoding of a lifecycle event: flat string fields, schema version `v`.

`encode` writes only the fields of the event's type; `decode` checks every field it reads and
raises `EventError` naming the problem, so a consumer can skip and count a bad entry instead of
dying on it (docs/events.md lists the fields).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prorsa.policy.events import Event, EventType

SCHEMA_VERSION = "1"

_INT_FIELDS: dict[EventType, tuple[str, ...]] = {
    EventType.TURN_SUBMIT: ("prompt_tokens", "uncached_tokens"),
    EventType.PREFILL_DONE: ("tokens",),
    EventType.DECODE_DONE: ("output_tokens",),
}
_NEEDS_WORKER = (EventType.PREFILL_DONE, EventType.DECODE_DONE)
_MAX_ID = 256


class EventError(ValueError):
    """A stream entry that is not a valid lifecycle event."""


def encode(ev: Event) -> dict[str, str]:
    f = {"v": SCHEMA_VERSION, "type": ev.type.value, "traj": ev.traj, "ts": repr(ev.ts)}
    t = ev.type
    if t is EventType.TRAJ_START and ev.group is not None:
        f["group"] = ev.group
    elif t is EventType.TURN_SUBMIT:
        f["prompt_tokens"] = str(ev.prompt_tokens)
        f["uncached_tokens"] = str(ev.uncached_tokens)
        f["remote"] = "1" if ev.remote else "0"
        for name in ("held_tokens", "pool_tokens"):
            if (n := getattr(ev, name)) is not None:
                f[name] = str(n)
    elif t is EventType.PREFILL_DONE:
        f.update(worker=ev.worker or "", tokens=str(ev.tokens), seconds=repr(ev.seconds))
    elif t is EventType.DECODE_DONE:
        f.update(
            worker=ev.worker or "", output_tokens=str(ev.output_tokens), seconds=repr(ev.seconds)
        )
    elif t is EventType.TOOL_START and ev.expected_seconds is not None:
        f["expected_seconds"] = repr(ev.expected_seconds)
    elif t is EventType.TRAJ_END:
        f["reason"] = ev.reason or "end"
    return f


def _text(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in raw.items():
        try:
            key = k.decode() if isinstance(k, bytes) else k
            out[key] = v.decode() if isinstance(v, bytes) else v
        except UnicodeDecodeError as e:
            raise EventError(f"field {k!r} is not UTF-8") from e
    return out


def _number(f: dict[str, str], name: str, *, required: bool = True) -> float | None:
    if name not in f:
        if required:
            raise EventError(f"missing field {name!r}")
        return None
    try:
        x = float(f[name])
    except ValueError:
        raise EventError(f"field {name!r} is not a number: {f[name][:40]!r}") from None
    if not math.isfinite(x) or x < 0:
        raise EventError(f"field {name!r} must be finite and >= 0, got {f[name][:40]!r}")
    return x


def decode(raw: Mapping[bytes | str, bytes | str]) -> Event:
    """A stream entry's fields → `Event`; `EventError` on anything malformed."""
    f = _text(raw)
    if f.get("v") != SCHEMA_VERSION:
        raise EventError(f"unsupported schema version {f.get('v')!r} (want {SCHEMA_VERSION})")
    try:
        t = EventType(f.get("type", ""))
    except ValueError:
        raise EventError(f"unknown event type {f.get('type')!r}") from None
    traj = f.get("traj", "")
    if not traj or len(traj) > _MAX_ID:
        raise EventError("field 'traj' must be a non-empty id of at most 256 characters")
    ts = _number(f, "ts")
    assert ts is not None
    ints: dict[str, int] = {}
    for name in _INT_FIELDS.get(t, ()):
        x = _number(f, name)
        assert x is not None
        if x != int(x):
            raise EventError(f"field {name!r} must be an integer, got {f[name][:40]!r}")
        ints[name] = int(x)
    worker = f.get("worker") or None
    if t in _NEEDS_WORKER and worker is None:
        raise EventError(f"{t.value} needs field 'worker'")
    seconds = _number(f, "seconds", required=t in _NEEDS_WORKER) or 0.0
    held, pool = (_optional_int(f, n) if t is EventType.TURN_SUBMIT else None
                  for n in ("held_tokens", "pool_tokens"))  # fmt: skip
    remote = f.get("remote", "1")
    if remote not in ("0", "1"):
        raise EventError(f"field 'remote' must be 0 or 1, got {remote[:40]!r}")
    return Event(
        t,
        traj,
        ts,
        group=f.get("group") or None,
        remote=remote == "1",
        worker=worker,
        seconds=seconds,
        expected_seconds=_number(f, "expected_seconds", required=False),
        reason=f.get("reason") or None,
        held_tokens=held,
        pool_tokens=pool,
        **ints,
    )


def _optional_int(f: dict[str, str], name: str) -> int | None:
    x = _number(f, name, required=False)
    if x is not None and x != int(x):
        raise EventError(f"field {name!r} must be an integer, got {f[name][:40]!r}")
    return None if x is None else int(x)
