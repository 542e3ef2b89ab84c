"""The trajectory lifecycle table: what every in-flight trajectory is doing right now.

It is fed the lifecycle events of DESIGN.md (the router writes them to Redis; the simulator
emits the same ones) and keeps, per trajectory, its state, turn, context and timings, plus the
online statistics the lifecycle forecaster needs (tool latency, tool output size, output
length per GRPO group, decode speed, continuation probability).

Robustness rules, because events travel through a stream that may duplicate or reorder:
- an event identical (type, ts) to the trajectory's latest event of that type is a duplicate:
  ignored;
- an event older than the trajectory's latest applied event never moves its state backwards,
  but completed work it reports (output lengths, timings) still teaches the statistics;
- a trajectory silent for `evict_after_s` is evicted (it never sent `traj_end`);
- the number of live trajectories, ended ids and GRPO groups is capped, so memory is bounded.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prorsa.policy.events import Event, EventType, State, Trajectory
from prorsa.policy.learned import LearnedStats
from prorsa.policy.samples import DECODE_FIELDS, Samples
from prorsa.policy.stats import Recency

# State as plain ints, for the columns; DONE also marks a free row.
_WAITING, _PREFILL, _DECODE, _TOOL, _DONE = range(5)
_BETWEEN_TURNS, _BEFORE_DECODE, _IN_TURN = (
    (_WAITING, _TOOL),
    (_PREFILL, _WAITING),
    (_DECODE, _PREFILL),
)


_CODE = {e: i for i, e in enumerate(EventType)}  # event type -> small int, for the columns
_START, _SUBMIT, _PREFILLED, _DECODED, _TOOL_START, _TOOL_END, _END = range(7)
_TYPES = len(_CODE)
_NO_HINT = math.nan
# A trajectory's answer-length level (recency-weighted log output tokens): each answer moves
# it this far, as the phases of a task change how long its answers are.
_LEVEL_RATE = 0.5


def _grow(col: array[Any], n: int, fill: float) -> None:
    col.extend(array(col.typecode, [fill]) * n)


class LifecycleTable:
    """Per-trajectory state plus the aggregates the forecasters and policies read.

    Rows are columns: one `array` per field, indexed by a trajectory's row. A decision ingests
    thousands of events for trajectories scattered over the table, and then the forecaster
    reads every row; contiguous columns keep both inside the CPU caches (objects per
    trajectory cost a cache miss per field) and let the forecaster work on whole columns.
    """

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
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.stats = LearnedStats.fresh()
        self.now = 0.0
        self._last_sweep = 0.0
        self._recency: tuple[tuple[int, int], Recency] | None = None  # (as of, recency)
        # Cumulative counters (forecasters difference them between decisions).
        self.submitted_tokens_total = 0
        self.started_total = 0
        self.ended_total = 0
        self.events_total = 0
        self.duplicates_total = 0
        self.late_total = 0
        self.evicted_total = 0
        # Rows: live trajectory id -> row; freed rows are reused.
        self.rows: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._free: list[int] = []
        self.state = array("b")  # State; DONE marks a free row
        self.turn = array("q")  # turns submitted
        self.state_since = array("d")
        self.last_ts = array("d")  # latest applied event
        self.idle_since = array("d")  # when its context was last used (its last decode ended)
        self.started_at = array("d")
        self.context = array("q")  # tokens the next turn's prompt starts from
        self.pending = array("q")  # uncached tokens of the submitted, unprefilled turn
        self.tool_hint = array("d")  # client's expected tool seconds (NaN: none)
        self.tool_out_est = array("d")  # recency-weighted appended tokens (-1: none yet)
        self.out_log_est = array("d")  # recency-weighted log output tokens (NaN: none yet)
        self.after_tool = array("b")  # waiting after an explicit tool_end (not an inferred gap)
        self.group = array("q")  # group row (-1: none)
        self._latest_ts = array("d")  # per row and event type: its latest ts (duplicates)
        # GRPO groups: id -> group row; output-length sums per group row.
        self.groups: dict[str, int] = {}
        self._group_ids: list[str | None] = []
        self._group_free: list[int] = []
        self.group_n = array("d")
        self.group_log_sum = array("d")

    # ---- ingest -----------------------------------------------------------------------

    def ingest(self, events: Iterable[Event]) -> None:
        self._apply_all(events if isinstance(events, Sequence) else list(events))
        if self.now - self._last_sweep >= self.evict_after_s / 10:
            self._last_sweep = self.now
            self.evict_idle(self.now)

    def apply(self, ev: Event) -> None:
        self._apply_all((ev,))

    def _apply_all(self, events: Sequence[Event]) -> None:
        """The state machine, one loop with the columns in locals (a decision ingests ~10,000
        events). What events teach the statistics is collected and learned afterwards, in
        event order per statistic, so the loop stays small."""
        rows_get, ended, code_of = self.rows.get, self.ended, _CODE
        last_ts, state, since, turn = self.last_ts, self.state, self.state_since, self.turn
        idle_since = self.idle_since
        context, pending = self.context, self.pending
        tool_hint, tool_out_est, after_tool = self.tool_hint, self.tool_out_est, self.after_tool
        out_log_est = self.out_log_est
        latest_ts, group = self._latest_ts, self.group
        learn = Samples()
        remote, appended, decodes = learn.remote.extend, learn.appended.extend, learn.decodes.extend
        pool = learn.pool.extend
        prefill_s, tool_s = learn.prefill_s.append, learn.tool_s.extend
        first_prompt, continued = learn.first_prompts.extend, learn.continued.extend
        now = self.now
        dups = late_n = submitted = 0
        for ev in events:
            ts = ev.ts
            if ts > now:
                now = ts
            i = rows_get(ev.traj)
            if i is None:
                if ev.traj in ended:
                    late_n += 1
                    continue
                i = self._create(ev.traj, ts)
            code = code_of[ev.type]
            last = last_ts[i]
            slot = _TYPES * i + code
            if ts <= last and latest_ts[slot] == ts:  # only an old event can be a repeat
                dups += 1
                continue
            latest_ts[slot] = ts
            late = ts < last
            if late:
                late_n += 1
            else:
                last_ts[i] = ts
            old = state[i]
            new = old  # the state this event moves the trajectory to
            if code == _SUBMIT:
                # Demand: what a prefill on the trajectory's decode worker computes (the
                # prompt less the prefix it holds), wherever it runs; what a pool computes
                # for the pool-worthy turns prices the pool (unreported: the whole prompt).
                uncached, prompt, held = ev.uncached_tokens, ev.prompt_tokens, ev.held_tokens
                demand = uncached if held is None else max(prompt - held, 1)
                submitted += demand
                if demand > 0:
                    remote((demand, ev.remote))
                    if ev.remote:
                        pool((demand, max(ev.pool_tokens or prompt, demand)))
                k = turn[i]
                turn[i] = k + 1
                ctx = context[i]
                if k == 0:
                    first_prompt((prompt, demand))
                elif not late:
                    # What the turn appended (the tool's output) vs what its prefill computes:
                    # the excess is context the serving worker had evicted, recomputed.
                    grew = max(prompt - ctx, 0)
                    used = idle_since[i] if old in _BETWEEN_TURNS else -1.0
                    appended((k, grew, demand, ctx, used, ts))
                    # recency-weighted: an agent's observations change size as its task moves on
                    est = tool_out_est[i]
                    tool_out_est[i] = float(grew) if est < 0 else est + 0.4 * (grew - est)
                    if old in _BETWEEN_TURNS:
                        continued((k, out_log_est[i], len(learn.decodes) // DECODE_FIELDS, ctx))
                        if old == _TOOL or after_tool[i]:
                            learn.tool_gaps.append(1.0)
                        if old == _WAITING and not after_tool[i]:  # an inferred tool gap
                            tool_s((ts - since[i], ts, k))
                if not late:
                    after_tool[i] = 0
                    if prompt > ctx:
                        context[i] = prompt
                    tool_hint[i] = _NO_HINT
                    pending[i] = demand
                    new = _PREFILL
                    if old == _PREFILL:  # the previous turn's prefill_done was lost
                        since[i] = ts
            elif code == _PREFILLED:
                if ev.seconds >= 0:
                    prefill_s(ev.seconds)
                if not late and old in _BEFORE_DECODE:
                    new = _DECODE
            elif code == _DECODED:
                if ev.output_tokens > 0:
                    decodes((group[i], ev.output_tokens, ev.seconds, ts))
                    level = out_log_est[i]  # its answers change length as its task moves on
                    y = math.log(ev.output_tokens)
                    out_log_est[i] = y if level != level else level + _LEVEL_RATE * (y - level)
                if not late:
                    context[i] += ev.output_tokens  # the next turn's prompt contains it
                    idle_since[i] = ts
                    if old in _IN_TURN:
                        new = _WAITING
            elif code == _TOOL_START:
                if not late and old != _TOOL:
                    hint = ev.expected_seconds
                    tool_hint[i] = _NO_HINT if hint is None else hint
                    new = _TOOL
            elif code == _TOOL_END:
                if not late and old == _TOOL:
                    tool_s((ts - since[i], ts, turn[i]))
                    tool_hint[i] = _NO_HINT
                    after_tool[i] = 1
                    new = _WAITING
            elif code == _START:
                self._on_traj_start(i, ev)
            else:
                if old in _BETWEEN_TURNS:
                    decoded = len(learn.decodes) // DECODE_FIELDS
                    learn.ended.extend((turn[i], out_log_est[i], decoded, context[i]))
                    if old == _TOOL or after_tool[i]:
                        learn.tool_gaps.append(0.0)
                self._end(i)
            if new != old:
                state[i] = new
                since[i] = ts
        self.now = now
        self.events_total += len(events)
        self.duplicates_total += dups
        self.late_total += late_n
        self.submitted_tokens_total += submitted
        recency = self.recency() if learn.appended else None
        learn.teach(self.stats, self.group_n, self.group_log_sum, self.group_prior_weight, recency)

    def _create(self, traj_id: str, ts: float) -> int:
        if len(self.rows) >= self.max_trajectories:
            self._evict_oldest(max(1, self.max_trajectories // 10))
        if not self._free:
            self._add_rows(max(1024, len(self._ids)))
        i = self._free.pop()
        self.rows[traj_id] = i
        self._ids[i] = traj_id
        self.state[i] = _WAITING
        self.turn[i] = 0
        self.state_since[i] = self.last_ts[i] = self.started_at[i] = self.idle_since[i] = ts
        self.context[i] = self.pending[i] = 0
        self.tool_hint[i] = _NO_HINT
        self.tool_out_est[i] = -1.0
        self.out_log_est[i] = math.nan
        self.after_tool[i] = 0
        self.group[i] = -1
        for j in range(_TYPES * i, _TYPES * i + _TYPES):
            self._latest_ts[j] = -math.inf
        self.started_total += 1
        return i

    def _add_rows(self, n: int) -> None:
        first = len(self._ids)
        self._ids.extend([None] * n)
        self._free.extend(range(first + n - 1, first - 1, -1))  # pop() hands out low rows first
        _grow(self.state, n, _DONE)
        for int_col in (self.turn, self.context, self.pending, self.group, self.after_tool):
            _grow(int_col, n, 0)
        for col in (self.state_since, self.last_ts, self.started_at, self.idle_since,
                    self.tool_out_est):  # fmt: skip
            _grow(col, n, 0.0)
        _grow(self.out_log_est, n, math.nan)
        _grow(self.tool_hint, n, _NO_HINT)
        _grow(self._latest_ts, _TYPES * n, -math.inf)

    def _on_traj_start(self, i: int, ev: Event) -> None:
        if ev.group is not None and self.group[i] < 0:
            self.group[i] = self._group_row(ev.group)
        if ev.ts < self.started_at[i]:
            self.started_at[i] = ev.ts

    def _end(self, i: int) -> None:
        traj_id = self._ids[i]
        assert traj_id is not None
        self._remove(i)
        self.ended_total += 1
        self.ended[traj_id] = None
        if len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)

    def _remove(self, i: int) -> None:
        self.state[i] = _DONE
        traj_id = self._ids[i]
        assert traj_id is not None
        del self.rows[traj_id]
        self._ids[i] = None
        self._free.append(i)

    # ---- GRPO groups --------------------------------------------------------------------

    def _group_row(self, group: str) -> int:
        g = self.groups.get(group)
        if g is not None:
            return g
        if len(self.groups) >= self.max_trajectories:
            self._evict_groups(max(1, self.max_trajectories // 10))
        if not self._group_free:
            n = max(1024, len(self._group_ids))
            first = len(self._group_ids)
            self._group_ids.extend([None] * n)
            self._group_free.extend(range(first + n - 1, first - 1, -1))
            _grow(self.group_n, n, 0.0)
            _grow(self.group_log_sum, n, 0.0)
        g = self._group_free.pop()
        self.groups[group] = g
        self._group_ids[g] = group
        self.group_n[g] = self.group_log_sum[g] = 0.0
        return g

    def _evict_groups(self, n: int) -> None:
        """Forget the oldest groups; trajectories still in them fall back to the prior."""
        gone = []
        for group in list(itertools.islice(self.groups, n)):
            g = self.groups.pop(group)
            self._group_ids[g] = None
            self._group_free.append(g)
            gone.append(g)
        rows = np.frombuffer(self.group, dtype=np.int64)
        stale = np.flatnonzero(np.isin(rows, gone))
        del rows
        for i in stale.tolist():
            self.group[i] = -1

    def group_factor(self, group: str | None) -> float:
        """How much longer than average this group's outputs run (1.0: average)."""
        if self.stats.output_len.n <= 0:
            return 1.0
        return math.exp(self.group_log_mean(group) - self.stats.output_len.mean)

    def group_log_mean(self, group: str | None) -> float:
        """Shrunk estimate of log output tokens for one turn of a trajectory in `group`."""
        g = self.groups.get(group, -1) if group is not None else -1
        return float(self.group_log_means()[g]) if g >= 0 else self._prior_log_len()

    def _prior_log_len(self) -> float:
        return self.stats.output_len.mean if self.stats.output_len.n > 0 else math.log(256.0)

    def group_log_means(self) -> np.ndarray:
        """`group_log_mean` of every group row, for vectorised lookups by row."""
        prior = self._prior_log_len()
        n = np.frombuffer(self.group_n, dtype=np.float64)
        s = np.frombuffer(self.group_log_sum, dtype=np.float64)
        k = self.group_prior_weight
        return np.where(n > 0, (s + k * prior) / (n + k), prior)

    # ---- housekeeping -------------------------------------------------------------------

    def evict_idle(self, now: float) -> int:
        """Drop trajectories silent for longer than `evict_after_s` (they never sent traj_end)."""
        if not self.rows:
            return 0
        state = np.frombuffer(self.state, dtype=np.int8)
        last = np.frombuffer(self.last_ts, dtype=np.float64)
        stale = np.flatnonzero((state < _DONE) & (last < now - self.evict_after_s)).tolist()
        del state, last
        for i in stale:
            self._remove(i)
        self.evicted_total += len(stale)
        return len(stale)

    def _evict_oldest(self, n: int) -> None:
        live = list(self.rows.values())
        oldest = sorted(live, key=self.last_ts.__getitem__)[:n]
        for i in oldest:
            self._remove(i)
        self.evicted_total += len(oldest)

    # ---- reading ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.rows)

    def count(self, state: State) -> int:
        return self.count_by_state[state]

    # Occupancy is read once per decision and changes with every event: derive it from the
    # state column when asked instead of maintaining it per event. (Context does not change
    # while a trajectory decodes, nor pending tokens while it waits for its prefill.)

    @property
    def count_by_state(self) -> list[int]:
        """Live trajectories per State (DONE is always 0: ended ones are removed)."""
        counts = np.bincount(np.frombuffer(self.state, dtype=np.int8), minlength=_DONE + 1)
        return [*counts[:_DONE].tolist(), 0]

    @property
    def prefill_backlog_tokens(self) -> int:
        """Tokens submitted and not yet prefilled."""
        prefilling = np.frombuffer(self.state, dtype=np.int8) == _PREFILL
        return int(np.frombuffer(self.pending, dtype=np.int64)[prefilling].sum())

    @property
    def decode_context_tokens(self) -> int:
        """Context of the trajectories decoding: the KV they hold."""
        decoding = np.frombuffer(self.state, dtype=np.int8) == _DECODE
        return int(np.frombuffer(self.context, dtype=np.int64)[decoding].sum())

    @property
    def resident_context_tokens(self) -> int:
        """Context of every live trajectory: the KV decode workers try to keep between turns
        (what does not fit is evicted and recomputed when the trajectory comes back)."""
        live = np.frombuffer(self.state, dtype=np.int8) < _DONE
        return int(np.frombuffer(self.context, dtype=np.int64)[live].sum())

    def recency(self) -> Recency:
        """The live contexts by when each was last used: now for those in a turn. (Kept
        until the next event: ingest reads it, and the forecast right after.)"""
        as_of = (self.events_total, self.evicted_total)
        if self._recency is not None and self._recency[0] == as_of:
            return self._recency[1]
        state = np.frombuffer(self.state, dtype=np.int8)
        live = np.flatnonzero(state < _DONE)
        in_turn = (state[live] == _PREFILL) | (state[live] == _DECODE)
        touched = np.where(in_turn, self.now, np.frombuffer(self.idle_since)[live])
        recency = Recency(touched, np.frombuffer(self.context, dtype=np.int64)[live])
        self._recency = (as_of, recency)
        return recency

    def live_rows(self) -> Rows:
        """The columns of every live trajectory, as numpy arrays (copies)."""
        state = np.array(self.state, dtype=np.int8)
        live = np.flatnonzero(state < _DONE)
        return Rows(
            state=state[live],
            turn=np.array(self.turn, dtype=np.int64)[live],
            state_since=np.array(self.state_since, dtype=np.float64)[live],
            idle_since=np.array(self.idle_since, dtype=np.float64)[live],
            context=np.array(self.context, dtype=np.int64)[live],
            tool_out_est=np.array(self.tool_out_est, dtype=np.float64)[live],
            out_log_est=np.array(self.out_log_est, dtype=np.float64)[live],
            tool_hint=np.array(self.tool_hint, dtype=np.float64)[live],
            group=np.array(self.group, dtype=np.int64)[live],
            tool_seen=(state[live] == _TOOL) | (np.array(self.after_tool, dtype=np.int8)[live] > 0),
        )

    @property
    def trajs(self) -> Mapping[str, Trajectory]:
        """Live trajectories by id, as snapshots (insertion order)."""
        return _Snapshots(self)

    def snapshot(self, traj_id: str) -> Trajectory:
        i = self.rows[traj_id]
        g = self.group[i]
        est = self.tool_out_est[i]
        hint = self.tool_hint[i]
        return Trajectory(
            id=traj_id,
            group=self._group_ids[g] if g >= 0 else None,
            state=State(self.state[i]),
            turn=self.turn[i],
            context_tokens=self.context[i],
            pending_tokens=self.pending[i],
            started_at=self.started_at[i],
            state_since=self.state_since[i],
            last_ts=self.last_ts[i],
            tool_hint=None if math.isnan(hint) else hint,
            mean_tool_output=est if est >= 0 else None,
        )


@dataclass(frozen=True, slots=True)
class Rows:
    """Live trajectories as columns: what the lifecycle forecaster reads in one pass."""

    state: np.ndarray
    turn: np.ndarray
    state_since: np.ndarray
    idle_since: np.ndarray  # when the context was last used
    context: np.ndarray
    tool_out_est: np.ndarray  # -1: none yet
    out_log_est: np.ndarray  # recency-weighted log output tokens, NaN: none yet
    tool_hint: np.ndarray  # NaN: none
    group: np.ndarray  # group row, -1: none
    tool_seen: np.ndarray  # a tool call reported since the last turn (bool)


class _Snapshots(Mapping[str, Trajectory]):
    def __init__(self, table: LifecycleTable) -> None:
        self._table = table

    def __getitem__(self, traj_id: str) -> Trajectory:
        return self._table.snapshot(traj_id)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._table.rows))

    def __len__(self) -> int:
        return len(self._table.rows)

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._table.rows
