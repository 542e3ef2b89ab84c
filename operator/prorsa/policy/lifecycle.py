"""The trajectory lifecycle table: what every in-flight trajectory is doing right now.

It is fed the lifecycle events of DESIGN.md (the router writes them to Redis; the simulator
emits the same ones) and keeps, per trajectory, its state, turn, context and timings, plus the
online statistics the lifecycle forecaster needs (tool latency, tool output size, output
length per GRPO group, decode speed, continuation probability).

Robustness rules, because events travel through a stream that may duplicate or reorder:
- an event identical (type, ts) to one of the trajectory's last few is a duplicate: ignored;
- an event older than the trajectory's latest applied event never moves its state backwards,
  but completed work it reports (output lengths, timings) still teaches the statistics;
- a trajectory silent for `evict_after_s` is evicted (it never sent `traj_end`);
- the number of live trajectories, ended ids and GRPO groups is capped, so memory is bounded.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from prorsa.policy.stats import Ewma, LogHistogram, LogMoments


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


_NO_RECENT: tuple[tuple[float, EventType], ...] = ((-1.0, EventType.TRAJ_START),) * 4  # last 4


_WAITING, _PREFILL, _DECODE, _TOOL, _DONE = (
    State.WAITING,
    State.PREFILL,
    State.DECODE,
    State.TOOL,
    State.DONE,
)


class Trajectory:
    __slots__ = (
        "after_tool",
        "context_tokens",
        "counted_context",
        "group",
        "id",
        "last_ts",
        "pending_tokens",
        "recent",
        "started_at",
        "state",
        "state_since",
        "tool_hint",
        "tool_out_est",
        "turn",
    )

    def __init__(self, traj_id: str, ts: float, group: str | None) -> None:
        self.id = traj_id
        self.group = group
        self.state = State.WAITING
        self.turn = 0
        self.after_tool = False  # waiting after an explicit tool_end (not an inferred gap)
        self.context_tokens = 0
        self.counted_context = 0  # what this trajectory adds to decode_context_tokens
        self.pending_tokens = 0
        self.started_at = ts
        self.state_since = ts
        self.last_ts = ts
        self.tool_hint: float | None = None
        self.tool_out_est = -1.0  # recency-weighted tokens its turns append (-1: none yet)
        self.recent: tuple[tuple[float, EventType], ...] = _NO_RECENT

    @property
    def mean_tool_output(self) -> float | None:
        return self.tool_out_est if self.tool_out_est >= 0 else None


class GroupStats:
    """Output lengths seen in one GRPO group (its samples share a prompt, hence a difficulty)."""

    __slots__ = ("log_sum", "n")

    def __init__(self) -> None:
        self.n = 0
        self.log_sum = 0.0


@dataclass
class LearnedStats:
    """Distributions learned online from completed work."""

    tool_latency: LogHistogram
    tool_output_tokens: Ewma  # tokens a turn appends after the first (tool output)
    first_prompt_tokens: Ewma
    output_len: LogMoments  # log output tokens per turn, all trajectories
    decode_s: Ewma  # decode request seconds (includes KV transfer and queueing)
    # decode durations divided by their GRPO group's length factor: a long-tailed, queue-aware
    # distribution, shared by all groups, that each group stretches or shrinks
    decode_duration: LogHistogram
    decode_tokens: Ewma  # output tokens per decode request
    prefill_latency_s: Ewma  # submit -> prefill done (queueing + compute)
    remote_share: Ewma  # fraction of submitted prefill tokens a prefill pool would take
    recompute_share: Ewma  # fraction of a returning trajectory's context recomputed (evicted)
    continue_count: float = 1.0  # Laplace prior: a turn is followed by another...
    stop_count: float = 1.0  # ...or by traj_end
    # The same, per turn index (log-spaced bins): agents stop more often at some depths.
    continue_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)
    stop_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)
    # Tool output size per turn depth: agents plan with short observations, then act with long.
    tool_out_sum_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)
    tool_out_n_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)

    @classmethod
    def fresh(cls) -> LearnedStats:
        return cls(
            tool_latency=LogHistogram(),
            tool_output_tokens=Ewma(0.05),
            first_prompt_tokens=Ewma(0.05),
            output_len=LogMoments(),
            decode_s=Ewma(0.05),
            decode_duration=LogHistogram(half_life_s=180.0),
            decode_tokens=Ewma(0.05),
            prefill_latency_s=Ewma(0.1),
            remote_share=Ewma(0.02),
            recompute_share=Ewma(0.02),
        )

    def tpot(self, default: float = 0.02) -> float:
        """Decode seconds per output token: a ratio of means, so durations scale right."""
        if self.decode_s.value is None or not self.decode_tokens.value:
            return default
        return max(self.decode_s.value / self.decode_tokens.value, 1e-5)

    @property
    def p_continue(self) -> float:
        return self.continue_count / (self.continue_count + self.stop_count)

    def p_continue_after(self, turn: int) -> float:
        """P(another turn follows turn `turn`), shrunk toward the overall rate."""
        b = turn_bin(turn)
        c, s = self.continue_by_turn[b], self.stop_by_turn[b]
        prior = 4.0
        return (c + prior * self.p_continue) / (c + s + prior)

    def tool_output_after(self, turn: int) -> float:
        """Expected tokens appended before turn `turn + 1`, shrunk toward the overall mean."""
        b = turn_bin(turn + 1)
        prior = 4.0
        overall = self.tool_output_tokens.get(512.0)
        n = self.tool_out_n_by_turn[b]
        return (self.tool_out_sum_by_turn[b] + prior * overall) / (n + prior)

    def learn_continuation(self, turn: int, continued: bool) -> None:
        b = turn_bin(turn)
        if continued:
            self.continue_count += 1
            self.continue_by_turn[b] += 1
        else:
            self.stop_count += 1
            self.stop_by_turn[b] += 1


_TURN_BINS = 16


def turn_bin(turn: int) -> int:
    """1, 2, 3, 4, 5-6, 7-8, 9-11, 12-16, ... (two bins per doubling), capped."""
    if turn <= 1:
        return 0
    return min(int(2.0 * math.log2(turn)), _TURN_BINS - 1)


class LifecycleTable:
    """Per-trajectory state plus the aggregates the forecasters and policies read."""

    def __init__(
        self,
        evict_after_s: float = 1800.0,
        max_trajectories: int = 200_000,
        max_ended: int = 200_000,
        group_prior_weight: float = 2.0,
    ) -> None:
        self.evict_after_s = evict_after_s
        self.max_trajectories = max_trajectories
        self.max_ended = max_ended
        self.group_prior_weight = group_prior_weight
        self.trajs: dict[str, Trajectory] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.groups: OrderedDict[str, GroupStats] = OrderedDict()
        self.stats = LearnedStats.fresh()
        self.now = 0.0
        self._last_sweep = 0.0
        # Cumulative counters (forecasters difference them between decisions).
        self.submitted_tokens_total = 0
        self.started_total = 0
        self.ended_total = 0
        self.events_total = 0
        self.duplicates_total = 0
        self.late_total = 0
        self.evicted_total = 0
        # Current occupancy by state.
        self.count_by_state = [0, 0, 0, 0, 0]
        self._handlers = {
            EventType.TRAJ_START: self._on_traj_start,
            EventType.TURN_SUBMIT: self._on_turn_submit,
            EventType.PREFILL_DONE: self._on_prefill_done,
            EventType.DECODE_DONE: self._on_decode_done,
            EventType.TOOL_START: self._on_tool_start,
            EventType.TOOL_END: self._on_tool_end,
            EventType.TRAJ_END: self._on_traj_end,
        }
        self.prefill_backlog_tokens = 0
        self.decode_context_tokens = 0

    # ---- ingest -----------------------------------------------------------------------

    def ingest(self, events: list[Event]) -> None:
        for ev in events:
            self.apply(ev)
        if self.now - self._last_sweep >= self.evict_after_s / 10:
            self._last_sweep = self.now
            self.evict_idle(self.now)

    def apply(self, ev: Event) -> None:
        self.events_total += 1
        ts = ev.ts
        if ts > self.now:
            self.now = ts
        t = self.trajs.get(ev.traj)
        if t is None:
            if ev.traj in self.ended:
                self.late_total += 1
                return
            t = self._create(ev.traj, ts, ev.group)
        key = (ts, ev.type)  # ts first: most comparisons stop at the float
        recent = t.recent
        if key in recent:
            self.duplicates_total += 1
            return
        t.recent = (recent[1], recent[2], recent[3], key)
        late = ts < t.last_ts
        if late:
            self.late_total += 1
        else:
            t.last_ts = ts
        self._handlers[ev.type](t, ev, late)

    def _create(self, traj_id: str, ts: float, group: str | None) -> Trajectory:
        if len(self.trajs) >= self.max_trajectories:
            self._evict_oldest(max(1, self.max_trajectories // 10))
        t = Trajectory(traj_id, ts, group)
        self.trajs[traj_id] = t
        self.count_by_state[State.WAITING] += 1
        self.started_total += 1
        return t

    def _set_state(self, t: Trajectory, state: State, ts: float) -> None:
        old = t.state
        if old == state:
            return
        counts = self.count_by_state
        counts[old] -= 1
        counts[state] += 1
        if old == _PREFILL:
            self.prefill_backlog_tokens -= t.pending_tokens
        elif old == _DECODE:
            self.decode_context_tokens -= t.counted_context
        if state == _PREFILL:
            self.prefill_backlog_tokens += t.pending_tokens
        elif state == _DECODE:
            t.counted_context = t.context_tokens
            self.decode_context_tokens += t.counted_context
        t.state = state
        t.state_since = ts

    def _on_traj_start(self, t: Trajectory, ev: Event, late: bool) -> None:
        if ev.group is not None and t.group is None:
            t.group = ev.group
        t.started_at = min(t.started_at, ev.ts)

    def _on_turn_submit(self, t: Trajectory, ev: Event, late: bool) -> None:
        self.submitted_tokens_total += ev.uncached_tokens
        if ev.uncached_tokens > 0:
            # token-weighted: a big remote prefill counts more than a small local append
            share = self.stats.remote_share
            w = min(1.0, ev.uncached_tokens / 4096.0)
            x = 1.0 if ev.remote else 0.0
            share.value = (
                x if share.value is None else share.value + share.alpha * w * (x - share.value)
            )
        if t.turn == 0:
            self.stats.first_prompt_tokens.add(ev.prompt_tokens)
        elif not late:
            # What the turn appended (the tool's output) vs what its prefill must compute:
            # the excess is context the serving worker had evicted, recomputed.
            new = max(ev.prompt_tokens - t.context_tokens, 0)
            self.stats.tool_output_tokens.add(new)
            b = turn_bin(t.turn + 1)
            self.stats.tool_out_sum_by_turn[b] = 0.98 * self.stats.tool_out_sum_by_turn[b] + new
            self.stats.tool_out_n_by_turn[b] = 0.98 * self.stats.tool_out_n_by_turn[b] + 1.0
            if t.context_tokens > 0:
                extra = max(ev.uncached_tokens - new, 0)
                self.stats.recompute_share.add(min(extra / t.context_tokens, 1.0))
            # recency-weighted: an agent's observations change size as its task moves on
            est = t.tool_out_est
            t.tool_out_est = float(new) if est < 0 else est + 0.4 * (new - est)
            if t.state == _WAITING or t.state == _TOOL:
                self.stats.learn_continuation(t.turn, True)
                if t.state == _WAITING and not t.after_tool:  # an inferred tool gap
                    self.stats.tool_latency.add(ev.ts - t.state_since, ev.ts)
        t.turn += 1
        if late:
            return
        t.after_tool = False
        t.context_tokens = max(t.context_tokens, ev.prompt_tokens)
        t.tool_hint = None
        if t.state == _PREFILL:  # previous turn's prefill_done was lost
            self.prefill_backlog_tokens -= t.pending_tokens
            t.pending_tokens = ev.uncached_tokens
            self.prefill_backlog_tokens += t.pending_tokens
            t.state_since = ev.ts
        else:
            t.pending_tokens = ev.uncached_tokens
            self._set_state(t, _PREFILL, ev.ts)

    def _on_prefill_done(self, t: Trajectory, ev: Event, late: bool) -> None:
        if ev.seconds >= 0:
            self.stats.prefill_latency_s.add(ev.seconds)
        if late or t.state not in (_PREFILL, _WAITING):
            return
        self._set_state(t, _DECODE, ev.ts)

    def _on_decode_done(self, t: Trajectory, ev: Event, late: bool) -> None:
        if ev.output_tokens > 0:
            if ev.seconds > 0:
                self.stats.decode_duration.add(ev.seconds / self.group_factor(t.group), ev.ts)
            self._learn_output(t, ev.output_tokens)
            if ev.seconds > 0:
                self.stats.decode_s.add(ev.seconds)
                self.stats.decode_tokens.add(ev.output_tokens)
        if late:
            return
        # The next turn's prompt contains this output.
        t.context_tokens += ev.output_tokens
        if t.state == _DECODE or t.state == _PREFILL:
            self._set_state(t, _WAITING, ev.ts)

    def _on_tool_start(self, t: Trajectory, ev: Event, late: bool) -> None:
        if late or t.state == _TOOL:
            return
        t.tool_hint = ev.expected_seconds
        self._set_state(t, _TOOL, ev.ts)

    def _on_tool_end(self, t: Trajectory, ev: Event, late: bool) -> None:
        if late or t.state != _TOOL:
            return
        self.stats.tool_latency.add(ev.ts - t.state_since, ev.ts)
        t.tool_hint = None
        t.after_tool = True
        self._set_state(t, _WAITING, ev.ts)

    def _on_traj_end(self, t: Trajectory, ev: Event, late: bool) -> None:
        if t.state == _WAITING or t.state == _TOOL:
            self.stats.learn_continuation(t.turn, False)
        self._remove(t)
        self.ended_total += 1
        self.ended[t.id] = None
        if len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)

    def _remove(self, t: Trajectory) -> None:
        self._set_state(t, _DONE, t.last_ts)
        self.count_by_state[_DONE] -= 1
        del self.trajs[t.id]

    # ---- learned statistics -------------------------------------------------------------

    def _learn_output(self, t: Trajectory, output_tokens: int) -> None:
        st = self.stats
        y = math.log(output_tokens) if output_tokens > 1 else 0.0
        st.output_len.add_log(y)
        if t.group is not None:
            g = self.groups.get(t.group)
            if g is None:
                g = self.groups[t.group] = GroupStats()
                if len(self.groups) > self.max_trajectories:
                    self.groups.popitem(last=False)
            g.n += 1
            g.log_sum += y

    def group_factor(self, group: str | None) -> float:
        """How much longer than average this group's outputs run (1.0: average)."""
        if self.stats.output_len.n <= 0:
            return 1.0
        return math.exp(self.group_log_mean(group) - self.stats.output_len.mean)

    def group_log_mean(self, group: str | None) -> float:
        """Shrunk estimate of log output tokens for one turn of a trajectory in `group`."""
        prior = self.stats.output_len.mean if self.stats.output_len.n > 0 else math.log(256.0)
        if group is None:
            return prior
        g = self.groups.get(group)
        if g is None or g.n == 0:
            return prior
        k = self.group_prior_weight
        return (g.log_sum + k * prior) / (g.n + k)

    # ---- housekeeping -------------------------------------------------------------------

    def evict_idle(self, now: float) -> int:
        """Drop trajectories silent for longer than `evict_after_s` (they never sent traj_end)."""
        cutoff = now - self.evict_after_s
        stale = [t for t in self.trajs.values() if t.last_ts < cutoff]
        for t in stale:
            self._remove(t)
        self.evicted_total += len(stale)
        return len(stale)

    def _evict_oldest(self, n: int) -> None:
        oldest = sorted(self.trajs.values(), key=lambda t: t.last_ts)[:n]
        for t in oldest:
            self._remove(t)
        self.evicted_total += len(oldest)

    @property
    def in_flight(self) -> int:
        return len(self.trajs)

    def count(self, state: State) -> int:
        return self.count_by_state[state]
