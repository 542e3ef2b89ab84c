"""The lifecycle vocabulary every part shares: the event types of DESIGN.md, one event, the
states a trajectory moves through and a read-only snapshot of one trajectory.

The router writes these events to Redis, the simulator emits the same ones, and the lifecycle
table (`lifecycle.LifecycleTable`) folds them into what every trajectory is doing now.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum


class EventType(StrEnum):
    TRAJ_START = "traj_start"
    TURN_SUBMIT = "turn_submit"
    PREFILL_DONE = "prefill_done"
    DECODE_DONE = "decode_done"
    TOOL_START = "tool_start"
    TOOL_END = "tool_end"
    TRAJ_END = "traj_end"


@dataclass(frozen=True, slots=True)
class Event:
    """One lifecycle event. Only the fields of its type are meaningful."""

    type: EventType
    traj: str
    ts: float
    group: str | None = None  # traj_start: GRPO group (samples of one prompt)
    prompt_tokens: int = 0  # turn_submit: whole prompt
    uncached_tokens: int = 0  # turn_submit: tokens the chosen prefill worker must compute
    remote: bool = True  # turn_submit: pool-worthy (False: a short append its decode worker holds)
    # turn_submit: prefix tokens the trajectory's decode worker holds (a prefill there reuses
    # them), and tokens a prefill pool worker would compute (without a prefix pull, it
    # recomputes the held context); None: not reported
    held_tokens: int | None = None
    pool_tokens: int | None = None
    worker: str | None = None  # prefill_done / decode_done
    tokens: int = 0  # prefill_done: tokens computed
    output_tokens: int = 0  # decode_done
    seconds: float = 0.0  # prefill_done / decode_done: service time
    expected_seconds: float | None = None  # tool_start: optional client hint
    reason: str | None = None  # traj_end


class State(IntEnum):
    WAITING = 0  # started, or between turns without an explicit tool call
    PREFILL = 1  # turn submitted, prefill not done
    DECODE = 2  # prefill done, decode not done (includes KV transfer)
    TOOL = 3  # explicit tool call in progress
    DONE = 4


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A read-only snapshot of one trajectory's row (for inspection; the table keeps columns)."""

    id: str
    group: str | None
    state: State
    turn: int
    context_tokens: int
    pending_tokens: int
    started_at: float
    state_since: float
    last_ts: float
    tool_hint: float | None
    mean_tool_output: float | None  # recency-weighted tokens its turns append
