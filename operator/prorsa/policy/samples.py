"""What one batch of lifecycle events teaches the learned statistics.

The lifecycle table's state machine collects, in event order, the samples each event holds
(a decode's length and duration, a tool call's latency, whether another turn followed); they
are learned here afterwards, in numpy, per statistic. A batch teaches what the same events
one at a time would: where a sample is learned relative to running statistics (a decode
relative to its GRPO group's length factor, a continuation relative to the answer-length
classes), those are rebuilt as of each sample with cumulative sums.
"""

from __future__ import annotations

from array import array

import numpy as np

from prorsa.policy.learned import LearnedStats, depth_class, length_classes
from prorsa.policy.stats import Recency

DECODE_FIELDS = 4  # a decode record: (group row, output tokens, seconds, ts)


class Samples:
    """What one batch of events teaches the statistics, in event order: flat float columns
    (a record's fields side by side) that numpy reads without copying."""

    __slots__ = ("appended", "continued", "decodes", "ended", "first_prompts", "pool",
                 "prefill_s", "remote", "tool_gaps", "tool_s")  # fmt: skip

    def __init__(self) -> None:
        self.remote = array("d")  # (demand tokens, 1 if pool-worthy)
        self.pool = array("d")  # pool-worthy turns: (demand tokens, tokens a pool computes)
        self.first_prompts = array("d")  # (prompt tokens, demand tokens)
        # (turn, tokens appended, uncached, context before, when it was last used (-1:
        # unknown), ts)
        self.appended = array("d")
        # (turn another turn followed / the trajectory ended after, its answer-length level,
        # decodes recorded before it in this batch, its context then)
        self.continued = array("d")
        self.ended = array("d")
        self.tool_gaps = array("d")  # gaps with a reported tool call: 1 a turn followed, 0 ended
        self.prefill_s = array("d")
        self.tool_s = array("d")  # (seconds, ts, the turn it precedes)
        self.decodes = array("d")  # DECODE_FIELDS per record

    @staticmethod
    def records(col: array[float], width: int) -> np.ndarray:
        """Column `j` of the result: field j of every record."""
        return np.frombuffer(col, dtype=np.float64).reshape(-1, width).T.copy()

    def teach(
        self,
        stats: LearnedStats,
        group_n: array[float],
        group_log_sum: array[float],
        k: float,
        recency: Recency | None = None,
    ) -> None:
        """Teach `stats` (and the GRPO groups' running log-length sums, `group_n` and
        `group_log_sum`, with `k` the weight of the overall mean in a group's) what this
        batch of events saw."""
        st = stats
        tokens, is_remote = self.records(self.remote, 2)
        # token-weighted: a big remote prefill counts more than a small local append
        st.remote_share.add_all(is_remote, np.minimum(1.0, tokens / 4096.0))
        demand, computed = self.records(self.pool, 2)
        st.worthy_tokens.add_all(demand)
        st.pool_tokens.add_all(computed)
        prompts, demands = self.records(self.first_prompts, 2)
        st.first_prompt_tokens.add_all(prompts)
        st.first_prompt_demand.add_all(demands)
        turn, grew, uncached, ctx, used, ts = self.records(self.appended, 6)
        st.tool_output_tokens.add_all(grew)
        has_ctx = ctx > 0
        recomputed = np.minimum(np.maximum(uncached - grew, 0.0), ctx)
        st.recompute_share.add_all(recomputed[has_ctx] / ctx[has_ctx])
        timed = has_ctx & (used >= 0)
        if timed.any() and recency is not None:
            # the tokens used since it was last used (its own use now among them: less its size)
            since = recency.tokens_after(used[timed]) - (ctx + grew)[timed]
            st.recompute_by_tokens_since.add_all(
                np.maximum(since, 0.0), recomputed[timed], ctx[timed], float(ts[timed].max())
            )
        st.learn_appended(turn.astype(np.int64) + 1, grew)
        decodes = self.records(self.decodes, DECODE_FIELDS)
        went_on, went_on_level, went_on_at, went_on_ctx = self.records(self.continued, 4)
        stopped, stopped_level, stopped_at, stopped_ctx = self.records(self.ended, 4)
        # the answer-length classes as of each event: the overall mean after the decodes
        # before it (one by one or in a batch, the same)
        n0, mean0 = st.output_len.n, st.output_len.mean
        cum = np.concatenate(([0.0], np.cumsum(np.log(np.maximum(decodes[1], 1.0)))))

        def mean_at(at: np.ndarray) -> np.ndarray:
            j = at.astype(np.int64)
            n = n0 + j
            out: np.ndarray = np.where(n > 0, (n0 * mean0 + cum[j]) / np.maximum(n, 1), np.nan)
            return out

        st.learn_continuations(
            went_on.astype(np.int64),
            stopped.astype(np.int64),
            self.records(self.tool_gaps, 1)[0],
            length_classes(went_on_level, mean_at(went_on_at)),
            length_classes(stopped_level, mean_at(stopped_at)),
            went_on_ctx,
            stopped_ctx,
        )
        st.prefill_latency_s.add_all(self.records(self.prefill_s, 1)[0])
        seconds, ts, next_turn = self.records(self.tool_s, 3)
        # weighted as of the call's start, like the calls still running (see survival_table)
        st.tool_latency.add_all(seconds, ts - seconds)
        dc = depth_class(next_turn)
        for c in np.unique(dc).tolist():
            sel = dc == c
            st.tool_by_depth[c].add_all(seconds[sel], (ts - seconds)[sel])
        _learn_decodes(st, group_n, group_log_sum, k, *decodes)


def _learn_decodes(
    st: LearnedStats,
    group_n_col: array[float],
    group_log_sum_col: array[float],
    k: float,
    g_col: np.ndarray,
    out: np.ndarray,
    seconds: np.ndarray,
    ts: np.ndarray,
) -> None:
    """Output lengths (overall and per GRPO group) and decode durations. A duration is
    learned relative to its group's length factor as of that sample: the running
    statistics before each sample are rebuilt with cumulative sums."""
    if not g_col.size:
        return
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
    group_n = np.frombuffer(group_n_col, dtype=np.float64)
    group_sum = np.frombuffer(group_log_sum_col, dtype=np.float64)
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
