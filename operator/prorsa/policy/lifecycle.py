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


def _grow(col: array[Any], n: int, fill: float) -> None:
    col.extend(array(col.typecode, [fill]) * n)


class _Samples:
    """What one batch of events teaches the statistics, in event order: flat float columns
    (a record's fields side by side) that numpy reads without copying."""

    __slots__ = ("appended", "continued", "decodes", "ended", "first_prompts", "pool",
                 "prefill_s", "remote", "tool_gaps", "tool_s")  # fmt: skip

    def __init__(self) -> None:
        self.remote = array("d")  # (demand tokens, 1 if pool-worthy)
        self.pool = array("d")  # pool-worthy turns: (demand tokens, tokens a pool computes)
        self.first_prompts = array("d")  # (prompt tokens, demand tokens)
        self.appended = array("d")  # (turn, tokens appended, uncached, context before)
        self.continued = array("d")  # turns another turn followed
        self.ended = array("d")  # turns the trajectory ended after
        self.tool_gaps = array("d")  # gaps with a reported tool call: 1 a turn followed, 0 ended
        self.prefill_s = array("d")
        self.tool_s = array("d")  # (seconds, ts)
        self.decodes = array("d")  # (group row, output tokens, seconds, ts)

    @staticmethod
    def records(col: array[float], width: int) -> np.ndarray:
        """Column `j` of the result: field j of every record."""
        return np.frombuffer(col, dtype=np.float64).reshape(-1, width).T.copy()


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
        self.started_at = array("d")
        self.context = array("q")  # tokens the next turn's prompt starts from
        self.pending = array("q")  # uncached tokens of the submitted, unprefilled turn
        self.tool_hint = array("d")  # client's expected tool seconds (NaN: none)
        self.tool_out_est = array("d")  # recency-weighted appended tokens (-1: none yet)
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
        context, pending = self.context, self.pending
        tool_hint, tool_out_est, after_tool = self.tool_hint, self.tool_out_est, self.after_tool
        latest_ts, group = self._latest_ts, self.group
        learn = _Samples()
        remote, appended, decodes = learn.remote.extend, learn.appended.extend, learn.decodes.extend
        pool = learn.pool.extend
        prefill_s, tool_s = learn.prefill_s.append, learn.tool_s.extend
        first_prompt, continued = learn.first_prompts.extend, learn.continued.append
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
                    appended((k, grew, demand, ctx))
                    # recency-weighted: an agent's observations change size as its task moves on
                    est = tool_out_est[i]
                    tool_out_est[i] = float(grew) if est < 0 else est + 0.4 * (grew - est)
                    if old in _BETWEEN_TURNS:
                        continued(k)
                        if old == _TOOL or after_tool[i]:
                            learn.tool_gaps.append(1.0)
                        if old == _WAITING and not after_tool[i]:  # an inferred tool gap
                            tool_s((ts - since[i], ts))
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
                if not late:
                    context[i] += ev.output_tokens  # the next turn's prompt contains it
                    if old in _IN_TURN:
                        new = _WAITING
            elif code == _TOOL_START:
                if not late and old != _TOOL:
                    hint = ev.expected_seconds
                    tool_hint[i] = _NO_HINT if hint is None else hint
                    new = _TOOL
            elif code == _TOOL_END:
                if not late and old == _TOOL:
                    tool_s((ts - since[i], ts))
                    tool_hint[i] = _NO_HINT
                    after_tool[i] = 1
                    new = _WAITING
            elif code == _START:
                self._on_traj_start(i, ev)
            else:
                if old in _BETWEEN_TURNS:
                    learn.ended.append(turn[i])
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
        self._learn(learn)

    def _learn(self, learn: _Samples) -> None:
        st = self.stats
        tokens, is_remote = learn.records(learn.remote, 2)
        # token-weighted: a big remote prefill counts more than a small local append
        st.remote_share.add_all(is_remote, np.minimum(1.0, tokens / 4096.0))
        demand, computed = learn.records(learn.pool, 2)
        st.worthy_tokens.add_all(demand)
        st.pool_tokens.add_all(computed)
        prompts, demands = learn.records(learn.first_prompts, 2)
        st.first_prompt_tokens.add_all(prompts)
        st.first_prompt_demand.add_all(demands)
        turn, grew, uncached, ctx = learn.records(learn.appended, 4)
        st.tool_output_tokens.add_all(grew)
        has_ctx = ctx > 0
        st.recompute_share.add_all(
            np.minimum(np.maximum(uncached - grew, 0.0)[has_ctx] / ctx[has_ctx], 1.0)
        )
        st.learn_appended(turn.astype(np.int64) + 1, grew)
        st.learn_continuations(
            learn.records(learn.continued, 1)[0].astype(np.int64),
            learn.records(learn.ended, 1)[0].astype(np.int64),
            learn.records(learn.tool_gaps, 1)[0],
        )
        st.prefill_latency_s.add_all(learn.records(learn.prefill_s, 1)[0])
        seconds, ts = learn.records(learn.tool_s, 2)
        # weighted as of the call's start, like the calls still running (see survival_table)
        st.tool_latency.add_all(seconds, ts - seconds)
        self._learn_decodes(*learn.records(learn.decodes, 4))

    def _learn_decodes(
        self, g_col: np.ndarray, out: np.ndarray, seconds: np.ndarray, ts: np.ndarray
    ) -> None:
        """Output lengths (overall and per GRPO group) and decode durations. A duration is
        learned relative to its group's length factor as of that sample: the running
        statistics before each sample are rebuilt with cumulative sums."""
        if not g_col.size:
            return
        st, k = self.stats, self.group_prior_weight
        g = g_col.astype(np.int64)
        m = g.size
        y = np.log(np.maximum(out, 1.0))
        earlier = np.arange(m)
        moments = st.output_len
        n0, mean0 = moments.n, moments.mean
        seen_n = n0 + earlier  # overall samples before each one, and their mean
        seen_mean = (n0 * mean0 + np.cumsum(y) - y) / np.maximum(seen_n, 1.0)
        # the same per group: sort by group, cumulative sums restart at each group's run
        grouped = g >= 0
        order = np.argsort(g, kind="stable")  # ungrouped samples (-1) form their own run
        sorted_g, sorted_y = g[order], y[order]
        run_start = np.maximum.accumulate(
            np.where(np.r_[True, sorted_g[1:] != sorted_g[:-1]], earlier, 0)
        )
        cum = np.cumsum(sorted_y)
        gn, gsum = np.empty(m), np.empty(m)
        gn[order] = earlier - run_start
        gsum[order] = (cum - sorted_y) - (cum[run_start] - sorted_y[run_start])
        gi = g[grouped]
        group_n = np.frombuffer(self.group_n, dtype=np.float64)
        group_sum = np.frombuffer(self.group_log_sum, dtype=np.float64)
        gn[grouped] += group_n[gi]
        gsum[grouped] += group_sum[gi]
        has_factor = grouped & (seen_n > 0) & (gn > 0)
        log_factor = (gsum + k * seen_mean) / (gn + k) - seen_mean
        factor = np.exp(np.where(has_factor, log_factor, 0.0))
        np.add.at(group_n, gi, 1.0)
        np.add.at(group_sum, gi, y[grouped])
        del group_n, group_sum  # views into the columns: release before they can grow
        # overall log-length moments: Chan's parallel combination of (n, mean, M2)
        batch_mean = float(y.mean())
        delta = batch_mean - mean0
        n = n0 + m
        moments.n = n
        moments.mean = mean0 + delta * m / n
        moments.m2 += float(((y - batch_mean) ** 2).sum()) + delta * delta * n0 * m / n
        timed = seconds > 0
        # at the decode's start: see `LogHistogram.survival_table` on censored durations
        st.decode_duration.add_all(seconds[timed] / factor[timed], ts[timed] - seconds[timed])
        st.decode_s.add_all(seconds[timed])
        st.decode_tokens.add_all(out[timed])

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
        self.state_since[i] = self.last_ts[i] = self.started_at[i] = ts
        self.context[i] = self.pending[i] = 0
        self.tool_hint[i] = _NO_HINT
        self.tool_out_est[i] = -1.0
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
        for col in (self.state_since, self.last_ts, self.started_at, self.tool_out_est):
            _grow(col, n, 0.0)
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

    def live_rows(self) -> Rows:
        """The columns of every live trajectory, as numpy arrays (copies)."""
        state = np.array(self.state, dtype=np.int8)
        live = np.flatnonzero(state < _DONE)
        return Rows(
            state=state[live],
            turn=np.array(self.turn, dtype=np.int64)[live],
            state_since=np.array(self.state_since, dtype=np.float64)[live],
            context=np.array(self.context, dtype=np.int64)[live],
            tool_out_est=np.array(self.tool_out_est, dtype=np.float64)[live],
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
    context: np.ndarray
    tool_out_est: np.ndarray  # -1: none yet
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
