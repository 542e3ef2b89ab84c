"""What the lifecycle table learns from completed work: the distributions the lifecycle
forecaster reads (tool latency and output size, output length, decode speed, continuation by
turn depth) and what a prefill pool computes per token of demand it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prorsa.policy.stats import Ewma, LogHistogram, LogMoments, RisingShare

TOOL_OUTPUT_PRIOR = 512.0  # tokens of a tool observation before any was seen
# Tool-call latencies fade with these half-lives. Agents change tools as a task moves on, and
# a phase of quick calls makes far more calls than the slower phase after it: remembered for
# ten minutes, its burst outweighed the calls agents make now, and the forecast's chain sent
# new calls back far too soon (docs/forecast-history.md). Chosen on the forecast benchmark's
# tuning seeds among 30, 60, 120 and 600 s (all depths together) and 60, 120 and 600 s (per
# turn depth, which has fewer calls each).
TOOL_HALF_LIFE_S = 60.0
TOOL_BY_DEPTH_HALF_LIFE_S = 120.0
# Decode durations fade with this half-life: they stretch with the load the decodes ran under
# and change with a task's phase. Chosen on the tuning seeds among 60, 90, 120, 180 and 360 s
# (shorter ones forecast better still but moved the MoE policy's decisions; see
# docs/forecast-history.md).
DECODE_HALF_LIFE_S = 120.0


@dataclass
class LearnedStats:
    """Distributions learned online from completed work."""

    tool_latency: LogHistogram
    tool_by_depth: list[LogHistogram]  # the same per `depth_class` of the turn it precedes
    tool_output_tokens: Ewma  # tokens a turn appends after the first (tool output)
    first_prompt_tokens: Ewma
    # what a first prompt costs to prefill: less than its size where a shared prefix is cached
    first_prompt_demand: Ewma
    output_len: LogMoments  # log output tokens per turn, all trajectories
    decode_s: Ewma  # decode request seconds (includes KV transfer and queueing)
    # decode durations divided by their GRPO group's length factor: a long-tailed, queue-aware
    # distribution, shared by all groups, that each group stretches or shrinks
    decode_duration: LogHistogram
    decode_tokens: Ewma  # output tokens per decode request
    prefill_latency_s: Ewma  # submit -> prefill done (queueing + compute)
    remote_share: Ewma  # fraction of submitted prefill tokens a prefill pool would take
    recompute_share: Ewma  # fraction of a returning trajectory's context recomputed (evicted)
    # ... by the tokens of the contexts used since it was: what an LRU cache keeps first
    recompute_by_tokens_since: RisingShare
    # Per pool-worthy turn: tokens its decode worker would compute, and tokens a prefill pool
    # computes for it (more: the held context it recomputes); their ratio prices the pool.
    worthy_tokens: Ewma
    pool_tokens: Ewma
    continue_count: float = 1.0  # Laplace prior: a turn is followed by another...
    stop_count: float = 1.0  # ...or by traj_end
    # After a reported tool call the trajectory has already chosen to go on: its result goes
    # back to the model unless the episode is cut short there. Learned from the calls that
    # ended; the prior (0.95, worth two calls) says the result almost always goes back.
    tool_continue_count: float = 1.9
    tool_stop_count: float = 0.1
    # Turns followed by another or not, by the context the trajectory held then
    # (`context_bins`) and the turn index (log-spaced bins): agents stop more often at some
    # depths (`continue_by_turn`, these summed over context) and as their context window
    # fills (`window_factor`).
    window_continue: np.ndarray = field(
        default_factory=lambda: np.zeros((_CONTEXT_BINS, _TURN_BINS))
    )
    window_stop: np.ndarray = field(default_factory=lambda: np.zeros((_CONTEXT_BINS, _TURN_BINS)))
    # ... and by the length class of the trajectory's recent answers (`length_classes`): the
    # phase of a task whose answers are long (or short) may be the one that ends it.
    continue_by_class: np.ndarray = field(default_factory=lambda: np.zeros((3, _TURN_BINS)))
    stop_by_class: np.ndarray = field(default_factory=lambda: np.zeros((3, _TURN_BINS)))
    # Tool output size per turn depth: agents plan with short observations, then act with long.
    tool_out_sum_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)
    tool_out_n_by_turn: list[float] = field(default_factory=lambda: [0.0] * _TURN_BINS)

    @classmethod
    def fresh(cls) -> LearnedStats:
        return cls(
            tool_latency=LogHistogram(half_life_s=TOOL_HALF_LIFE_S),
            tool_by_depth=[
                LogHistogram(half_life_s=TOOL_BY_DEPTH_HALF_LIFE_S) for _ in range(DEPTH_CLASSES)
            ],
            tool_output_tokens=Ewma(0.05),
            first_prompt_tokens=Ewma(0.05),
            first_prompt_demand=Ewma(0.05),
            output_len=LogMoments(),
            decode_s=Ewma(0.05),
            decode_duration=LogHistogram(half_life_s=DECODE_HALF_LIFE_S),
            decode_tokens=Ewma(0.05),
            prefill_latency_s=Ewma(0.1),
            remote_share=Ewma(0.02),
            recompute_share=Ewma(0.02),
            recompute_by_tokens_since=RisingShare(),
            worthy_tokens=Ewma(0.02),
            pool_tokens=Ewma(0.02),
        )

    def pool_amplification(self) -> float:
        """Tokens a prefill pool computes per token of demand it takes (>= 1): without a
        prefix pull it recomputes the context the trajectory's decode worker holds."""
        demand = self.worthy_tokens.get(0.0)
        return max(1.0, self.pool_tokens.get(0.0) / demand) if demand > 0 else 1.0

    def tpot(self, default: float = 0.02) -> float:
        """Decode seconds per output token: a ratio of means, so durations scale right."""
        if self.decode_s.value is None or not self.decode_tokens.value:
            return default
        return max(self.decode_s.value / self.decode_tokens.value, 1e-5)

    @property
    def p_continue(self) -> float:
        return self.continue_count / (self.continue_count + self.stop_count)

    @property
    def p_continue_after_tool(self) -> float:
        """P(another turn follows | the trajectory reported a tool call since its last turn)."""
        return self.tool_continue_count / (self.tool_continue_count + self.tool_stop_count)

    def p_continue_after(self, turns: np.ndarray, classes: np.ndarray | None = None) -> np.ndarray:
        """P(another turn follows turn k) for each k, shrunk toward the overall rate; with
        `classes` (each trajectory's answer-length class, -1: none yet), per class, shrunk
        toward that."""
        bins = turn_bins(turns)
        out: np.ndarray = np.take(self._p_continue_by_turn_bin(), bins)
        if classes is not None:
            known = classes >= 0
            k, b = classes[known], bins[known]
            cc, sc = self.continue_by_class[k, b], self.stop_by_class[k, b]
            out[known] = (cc + _CONTINUE_PRIOR * out[known]) / (cc + sc + _CONTINUE_PRIOR)
        return out

    @property
    def continue_by_turn(self) -> list[float]:
        return [float(x) for x in self.window_continue.sum(axis=0)]

    @property
    def stop_by_turn(self) -> list[float]:
        return [float(x) for x in self.window_stop.sum(axis=0)]

    def _p_continue_by_turn_bin(self) -> np.ndarray:
        c, s = self.window_continue.sum(axis=0), self.window_stop.sum(axis=0)
        out: np.ndarray = (c + _CONTINUE_PRIOR * self.p_continue) / (c + s + _CONTINUE_PRIOR)
        return out

    def window_factor(self, context: np.ndarray) -> np.ndarray:
        """How much less likely than its turn depth says a trajectory with this much context
        is to go on (at most 1): per context bin, the turns that went on against those the
        turn-depth model expects of the same turns. Agents stop as their context window
        fills, a limit no turn depth shows (big observations fill it in a few turns)."""
        out: np.ndarray = self.window_factors()[context_bins(context)]
        return out

    def window_factors(self) -> np.ndarray:
        """`window_factor` per context bin (`context_bins`), for reading many contexts."""
        c, s = self.window_continue, self.window_stop
        expected = (c + s) @ self._p_continue_by_turn_bin()
        ratio = (c.sum(axis=1) + WINDOW_PRIOR) / (expected + WINDOW_PRIOR)
        out: np.ndarray = np.minimum(1.0, ratio)
        return out

    def mean_tool_output(self) -> float:
        """Tokens a returning turn appends: as learned; before any was seen, a typical tool
        observation no larger than the task's first prompt (an agent's observations of a
        small task are small; those of a large task are not each as large as the task)."""
        first = self.first_prompt_tokens.get(TOOL_OUTPUT_PRIOR)
        return self.tool_output_tokens.get(min(first, TOOL_OUTPUT_PRIOR))

    def tool_output_after(self, turns: np.ndarray) -> np.ndarray:
        """Expected tokens appended before turn k + 1 for each k, shrunk toward the overall
        mean."""
        sums, n = np.array(self.tool_out_sum_by_turn), np.array(self.tool_out_n_by_turn)
        prior = 4.0
        overall = self.mean_tool_output()
        by_bin: np.ndarray = (sums + prior * overall) / (n + prior)
        return np.take(by_bin, turn_bins(turns + 1))

    def learn_continuations(
        self, continued_after: np.ndarray, ended_after: np.ndarray, after_tool: np.ndarray,
        continued_class: np.ndarray, ended_class: np.ndarray,
        continued_context: np.ndarray, ended_context: np.ndarray,
    ) -> None:  # fmt: skip
        """Turns another turn followed, turns the trajectory ended after, and for the gaps
        with a reported tool call, whether a turn followed (1) or the trajectory ended (0);
        the answer-length class of each trajectory then (-1: none) and its context."""
        for turns, classes, context, by_class, by_context, total in (
            (continued_after, continued_class, continued_context, self.continue_by_class,
             self.window_continue, "continue_count"),
            (ended_after, ended_class, ended_context, self.stop_by_class, self.window_stop,
             "stop_count"),
        ):  # fmt: skip
            if not turns.size:
                continue
            setattr(self, total, getattr(self, total) + turns.size)
            bins = turn_bins(turns)
            np.add.at(by_context, (context_bins(context), bins), 1.0)
            known = classes >= 0
            np.add.at(by_class, (classes[known], bins[known]), 1.0)
        went_on = float(np.count_nonzero(after_tool))
        self.tool_continue_count += went_on
        self.tool_stop_count += float(after_tool.size) - went_on

    def learn_appended(self, turns: np.ndarray, tokens: np.ndarray) -> None:
        """Tokens appended before each of `turns`, in order: decayed sums per turn depth."""
        bins = turn_bins(turns)
        for b in np.unique(bins).tolist():
            x = tokens[bins == b]
            decay = 0.98 ** np.arange(x.size - 1, -1, -1)  # the newest sample weighs 1
            self.tool_out_sum_by_turn[b] = 0.98**x.size * self.tool_out_sum_by_turn[b] + float(
                decay @ x
            )
            self.tool_out_n_by_turn[b] = 0.98**x.size * self.tool_out_n_by_turn[b] + float(
                decay.sum()
            )


_TURN_BINS = 16
_CONTINUE_PRIOR = 4.0  # turns: a depth's (or class's) own rate outweighs the overall after a few


def length_class(factor: np.ndarray) -> np.ndarray:
    """Short (0), average (1) or long (2) answers, from a length factor (answer length over
    the overall mean: below 0.7, up to 1.4, beyond)."""
    out: np.ndarray = np.where(factor < 0.7, 0, np.where(factor < 1.4, 1, 2))
    return out


DEPTH_CLASSES = 6


def depth_class(turn: np.ndarray) -> np.ndarray:
    """Turn 0, 1, 2-3, 4-7, 8-15, 16 and beyond: agents call other tools as a task moves on."""
    t = np.maximum(np.asarray(turn, dtype=np.int64), 1)
    out: np.ndarray = np.where(
        np.asarray(turn) <= 0, 0, np.minimum(np.log2(t).astype(np.int64) + 1, DEPTH_CLASSES - 1)
    )
    return out


def length_classes(log_levels: np.ndarray, log_mean: np.ndarray | float) -> np.ndarray:
    """`length_class` of log answer lengths against the overall log mean (one, or one per
    level); -1 where either is unknown (NaN)."""
    diff = log_levels - log_mean
    known = ~np.isnan(diff)
    out = np.full(log_levels.shape, -1, dtype=np.int64)
    out[known] = length_class(np.exp(diff[known]))
    return out


_CONTEXT_BINS = 48
WINDOW_PRIOR = 4.0  # expected continuations: a bin's own evidence outweighs it after a few


def context_bins(tokens: np.ndarray) -> np.ndarray:
    """Context tokens in quarter octaves from 1K (bin 0: below 1K; the last from 3M on):
    fine enough that one bin sits below a context window and the next at it."""
    quarter = np.floor(4.0 * np.log2(np.maximum(np.asarray(tokens, np.float64), 1.0) / 1024.0))
    out: np.ndarray = np.clip(quarter + 1, 0, _CONTEXT_BINS - 1).astype(np.int64)
    return out


def turn_bins(turns: np.ndarray) -> np.ndarray:
    """1, 2, 3, 4, 5-6, 7-8, 9-11, 12-16, ... (two bins per doubling), capped."""
    safe = np.maximum(turns, 1)
    return np.where(
        turns <= 1, 0, np.minimum((2.0 * np.log2(safe)).astype(np.int64), _TURN_BINS - 1)
    )


def turn_bin(turn: int) -> int:
    return int(turn_bins(np.array([turn]))[0])
