"""Shared helpers for the test suite."""

from __future__ import annotations

from prorsa.policy.lifecycle import Event, EventType


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
