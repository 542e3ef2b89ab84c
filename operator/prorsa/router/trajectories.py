"""Turns → lifecycle events, and the little the router remembers per trajectory.

Per trajectory the router keeps its sticky decode worker, the size of the context that worker
holds and a fingerprint of the last prompt (to tell an append from a new context). Every turn
emits `turn_submit`, `prefill_done`, `decode_done`; the first turn of an id emits `traj_start`;
a request without an id is a one-turn trajectory of its own, closed by `traj_end`. Tool calls
and ends come from client hints or from a chat response that asks for a tool.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass

from prorsa.events.stream import EventWriter
from prorsa.policy.events import Event, EventType
from prorsa.router.placement import Plan, TurnFacts
from prorsa.router.requests import Turn
from prorsa.router.tokens import TokenCounter


@dataclass(slots=True)
class Memory:
    sticky: str | None = None
    prompt_len: int = 0  # length of the last prompt, in its own units (chars, ids, messages)
    prompt_hash: bytes = b""
    context_tokens: int = 0  # prompt + output of the last completed turn
    last_seen: float = 0.0


def _fingerprint(turn: Turn, upto: int | None = None) -> tuple[int, bytes]:
    """(length, hash) of the prompt, or of its first `upto` units."""
    if turn.prompt_ids is not None:
        units: object = turn.prompt_ids
        n = len(turn.prompt_ids)
    elif turn.prompt_text is not None:
        units, n = turn.prompt_text, len(turn.prompt_text)
    else:
        units, n = turn.messages, len(turn.messages)
    if upto is not None:
        if upto > n:
            return n, b""
        units, n = units[:upto], upto  # type: ignore[index]
    raw = units.encode() if isinstance(units, str) else json.dumps(units).encode()
    return n, hashlib.blake2b(raw, digest_size=16).digest()


@dataclass(slots=True)
class TurnRecord:
    """One turn in flight: its ids, counts and timestamps (all events derive from it)."""

    traj: str
    anonymous: bool
    prompt_tokens: int
    facts: TurnFacts
    submitted_at: float
    prefill_done_at: float = 0.0
    fingerprint: tuple[int, bytes] = (0, b"")


class Trajectories:
    def __init__(
        self,
        writer: EventWriter | None,
        counter: TokenCounter,
        *,
        idle_s: float = 3600.0,
        max_tracked: int = 200_000,
    ) -> None:
        self.writer = writer
        self.counter = counter
        self.idle_s = idle_s
        self.max_tracked = max_tracked
        self._mem: OrderedDict[str, Memory] = OrderedDict()
        self.hosted: Counter[str] = Counter()  # trajectories whose decode sticks to a worker

    def __len__(self) -> int:
        return len(self._mem)

    def _stick(self, m: Memory, worker: str | None) -> None:
        """Move a trajectory's decode home, keeping the per-worker counts placement reads."""
        if m.sticky == worker:
            return
        if m.sticky is not None:
            self.hosted[m.sticky] -= 1
            if self.hosted[m.sticky] <= 0:
                del self.hosted[m.sticky]
        if worker is not None:
            self.hosted[worker] += 1
        m.sticky = worker

    def _emit(self, ev: Event) -> None:
        if self.writer is not None:
            self.writer.emit(ev)

    def _sweep(self, now: float) -> None:
        while self._mem:
            traj, m = next(iter(self._mem.items()))
            if now - m.last_seen < self.idle_s and len(self._mem) <= self.max_tracked:
                break
            self._stick(m, None)
            del self._mem[traj]

    # ---- a turn ---------------------------------------------------------------------------

    def begin(self, turn: Turn, routing_switch: bool = True) -> TurnRecord:
        now = time.time()
        self._sweep(now)
        anonymous = turn.traj is None
        traj = turn.traj or f"anon-{uuid.uuid4().hex}"
        m = self._mem.get(traj)
        if m is None:
            m = Memory(last_seen=now)
            if not anonymous:
                self._mem[traj] = m
            self._emit(Event(EventType.TRAJ_START, traj, now))
        else:
            self._mem.move_to_end(traj)
        m.last_seen = now
        prompt_tokens = self.counter.count(turn)
        extends = bool(m.prompt_hash) and _fingerprint(turn, m.prompt_len)[1] == m.prompt_hash
        new_tokens = prompt_tokens - m.context_tokens if extends else prompt_tokens
        facts = TurnFacts(
            prompt_tokens=prompt_tokens,
            new_tokens=max(new_tokens, 1),
            sticky=m.sticky,
            extends_context=extends,
            can_split=turn.can_split,
            routing_switch=routing_switch,
        )
        return TurnRecord(
            traj, anonymous, prompt_tokens, facts, now, fingerprint=_fingerprint(turn)
        )

    def submitted(self, rec: TurnRecord, plan: Plan) -> None:
        # The context is held by the decode worker (a local append, or a split turn whose
        # decode worker holds it while a pool recomputes it) or, in a handoff, by the worker
        # the trajectory leaves, which prefills only the new tokens.
        holds = plan.holds_prefix or plan.handoff
        computes_new = plan.handoff or (plan.prefill is None and plan.holds_prefix)
        uncached = rec.facts.new_tokens if computes_new else rec.prompt_tokens
        self._emit(
            Event(
                EventType.TURN_SUBMIT,
                rec.traj,
                rec.submitted_at,
                prompt_tokens=rec.prompt_tokens,
                uncached_tokens=max(uncached, 1),
                remote=plan.pool_worthy,
                held_tokens=rec.prompt_tokens - rec.facts.new_tokens if holds else 0,
                pool_tokens=rec.prompt_tokens,
            )
        )

    def prefill_done(self, rec: TurnRecord, worker: str, tokens: int) -> None:
        now = time.time()
        rec.prefill_done_at = now
        self._emit(
            Event(
                EventType.PREFILL_DONE,
                rec.traj,
                now,
                worker=worker,
                tokens=max(tokens, 1),
                seconds=now - rec.submitted_at,
            )
        )

    def decode_done(
        self,
        rec: TurnRecord,
        worker: str,
        prompt_tokens: int,
        output_tokens: int,
        tool_call: bool = False,
    ) -> None:
        now = time.time()
        self._emit(
            Event(
                EventType.DECODE_DONE,
                rec.traj,
                now,
                worker=worker,
                output_tokens=output_tokens,
                seconds=now - (rec.prefill_done_at or rec.submitted_at),
            )
        )
        if rec.anonymous:
            self._emit(Event(EventType.TRAJ_END, rec.traj, now, reason="single_request"))
            return
        m = self._mem.get(rec.traj)
        if m is None:
            return
        self._stick(m, worker)
        m.prompt_len, m.prompt_hash = rec.fingerprint
        m.context_tokens = prompt_tokens + output_tokens
        m.last_seen = now
        if tool_call:
            self._emit(Event(EventType.TOOL_START, rec.traj, now))

    def failed(self, rec: TurnRecord) -> None:
        """The turn could not be served: its trajectory's state on the workers is unknown."""
        m = self._mem.get(rec.traj)
        if m is not None:
            self._stick(m, None)
            m.prompt_hash, m.context_tokens = b"", 0

    def forget_worker(self, worker: str) -> None:
        """A worker left the decode pool: its trajectories will be re-placed."""
        for m in self._mem.values():
            if m.sticky == worker:
                self._stick(m, None)

    # ---- client hints ---------------------------------------------------------------------

    def tool_start(self, traj: str, expected_seconds: float | None) -> None:
        self._emit(
            Event(EventType.TOOL_START, traj, time.time(), expected_seconds=expected_seconds)
        )

    def tool_end(self, traj: str) -> None:
        self._emit(Event(EventType.TOOL_END, traj, time.time()))

    def end(self, traj: str, reason: str) -> None:
        m = self._mem.pop(traj, None)
        if m is not None:
            self._stick(m, None)
        self._emit(Event(EventType.TRAJ_END, traj, time.time(), reason=reason))
