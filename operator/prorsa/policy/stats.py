"""Online statistics the lifecycle forecaster learns from events.

All of them are fixed-size (memory stays bounded however long the rollout runs) and cheap to
update, because the controller feeds them thousands of events per decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# The tail index of `LogHistogram.with_heavy_tail`. Chosen on the forecast benchmark's tuning
# seeds (0-89) against 1 (as long again as it has lasted), which helped prefill as much and
# decode less; checked on seeds 5000-5119 (docs/forecast-history.md).
HEAVY_TAIL_INDEX = 0.5
# Kaplan-Meier is read only while at least this many durations remain at risk (faded by
# the time since they reached that duration), or half the ended ones where fewer ended:
# past that a handful of ended durations set the hazard, and the last of them takes the
# survival to 0, so a cohort still running just short of it was forecast to end within one
# bin (a next phase's long decodes, all ending "now" from one forecast to the next).
# Survival curves are cut where few remain at risk for the same reason (Pocock, Clayton and
# Altman, Lancet 2002; 359:1686-89). Chosen on the forecast benchmark's tuning seeds among
# 3, 10 and 5% of the sample, and against a pseudo-count of 3 or 10 more at risk; checked on
# seeds 5000-5119 (docs/forecast-history.md).
MIN_AT_RISK = 10.0


def log_bins(x: np.ndarray, lo: float, ratio: float, bins: int) -> np.ndarray:
    """The log-spaced bin of every element: 0 up to `lo`, then one bin per factor `ratio`,
    the last open-ended."""
    i = ((np.log(np.maximum(x, lo)) - math.log(lo)) / math.log(ratio)).astype(np.int64) + 1
    out: np.ndarray = np.where(x <= lo, 0, np.minimum(i, bins - 1))
    return out


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean; `None` until the first sample."""

    alpha: float
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)

    def add_all(self, xs: np.ndarray, weights: np.ndarray | None = None) -> None:
        """`add` of every sample in order, in closed form. With `weights`, sample k moves the
        mean by alpha * weights[k] of the way (a weight of 1 is a plain sample)."""
        if xs.size == 0:
            return
        if self.value is None:
            self.value = float(xs[0])
            xs = xs[1:]
            weights = None if weights is None else weights[1:]
            if xs.size == 0:
                return
        step = self.alpha if weights is None else self.alpha * weights
        keep = np.broadcast_to(1.0 - step, xs.shape)
        # keep_after[k]: how much of sample k survives the samples after it
        keep_after = np.append(np.cumprod(keep[:0:-1])[::-1], 1.0)
        self.value = float(self.value * np.prod(keep) + np.sum(step * xs * keep_after))

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass(slots=True)
class LogMoments:
    """Welford mean and variance of log(x): the parameters of a log-normal fit."""

    n: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.add_log(math.log(max(x, 1e-9)))

    def add_log(self, y: float) -> None:
        self.n += 1.0
        delta = y - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (y - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / self.n if self.n > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)


@dataclass
class LogHistogram:
    """Histogram over log-spaced bins, used as an empirical distribution of durations.

    `survival(t)` interpolates linearly in log-time between bin edges, so the conditional
    probability that a tool call which has run for `e` seconds returns in [e+a, e+b) is cheap
    to evaluate for every bin of elapsed time at once. Samples fade with `half_life_s` of
    event time, so the distribution follows a rollout whose tools or queues change.
    """

    lo: float = 0.01
    ratio: float = math.sqrt(2.0)
    bins: int = 48
    half_life_s: float = 600.0
    counts: list[float] = field(default_factory=list)
    total: float = 0.0  # weighted, in the units of `counts`

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0.0] * self.bins
        self._log_lo = math.log(self.lo)
        self._log_ratio = math.log(self.ratio)
        self._rate = math.log(2.0) / self.half_life_s
        self._t0 = 0.0  # weights are exp(rate * (t - t0)); t0 moves forward to keep them small
        self.n = 0
        # rate * each bin's lower edge: the log of the factor that counts a duration in the
        # bin as of when it reached it, not as of its start (`survival_table`)
        self._reached = [0.0] + [self._rate * self.lo * self.ratio**i for i in range(self.bins - 1)]

    def index(self, x: float) -> int:
        if x <= self.lo:
            return 0
        i = int((math.log(x) - self._log_lo) / self._log_ratio) + 1
        return i if i < self.bins else self.bins - 1

    def index_array(self, x: np.ndarray) -> np.ndarray:
        """`index` of every element."""
        return log_bins(x, self.lo, self.ratio, self.bins)

    def mid(self, i: np.ndarray) -> np.ndarray:
        """A representative value of each bin (geometric middle; half of `lo` for bin 0)."""
        return np.where(i == 0, self.lo * 0.5, self.lo * self.ratio ** (i - 0.5))

    def add(self, x: float, now: float = 0.0) -> None:
        # Newer samples get a growing weight instead of scaling every bin on each sample.
        exponent = self._rate * (now - self._t0)
        if exponent > 30.0:
            self._rebase(now)
            exponent = 0.0
        w = math.exp(exponent)
        self.counts[self.index(x)] += w
        self.total += w
        self.n += 1

    def _rebase(self, now: float) -> None:
        """Move the weights' time origin to `now` (keeps them small; same distribution)."""
        scale = math.exp(-self._rate * (now - self._t0))
        self.counts = [c * scale for c in self.counts]
        self.total *= scale
        self._t0 = now

    def add_all(self, xs: np.ndarray, t: np.ndarray) -> None:
        """`add` of many samples at once (same distribution, one numpy pass)."""
        if not xs.size:
            return
        latest = float(t.max())
        if self._rate * (latest - self._t0) > 30.0:
            self._rebase(latest)
        w = np.exp(self._rate * (t - self._t0))
        bins = self.index_array(xs)
        self.counts = (np.asarray(self.counts) + np.bincount(bins, w, self.bins)).tolist()
        self.total += float(w.sum())
        self.n += xs.size

    def effective(self, now: float) -> float:
        """Samples seen, discounted by age: the weight recent evidence carries."""
        return self.total * math.exp(-self._rate * (now - self._t0))

    def start_weights(self, elapsed: np.ndarray) -> np.ndarray:
        """The weight, now, of durations that began `elapsed` seconds ago: what a censored
        duration counts in `survival_table` when ended ones were added at their start."""
        w: np.ndarray = np.exp(-self._rate * np.maximum(elapsed, 0.0))
        return w

    def survival_table(self, censored: list[float] | None = None, now: float = 0.0) -> list[float]:
        """S at each upper bin edge: P(X > edge(i)).

        `censored[i]` counts durations still running with their elapsed time in bin i (tool
        calls in flight). Without them a long tool call only counts once it returns, so early
        in a rollout the tail is missing and returns are predicted too soon; with them the
        estimate is Kaplan-Meier over the bins. Both must fade alike: ended durations added
        at their start time pair with censored ones weighted by `start_weights` (then the
        decayed estimate is exact for a steady stream; weighted by their end, the ended ones
        fade while the running ones count in full, and durations longer than the half-life
        come out longer still).

        Kaplan-Meier says nothing past the longest duration that ended, and little where
        fewer than `MIN_AT_RISK` remain at risk: S stays flat from there (see
        `with_heavy_tail`).
        """
        if self.total <= 0:
            return [0.0] * self.bins
        scale = math.exp(-self._rate * (now - self._t0))  # weights as of now: effective counts
        done = [c * scale for c in self.counts]
        cens = censored or [0.0] * self.bins
        at_risk = sum(done, 0.0) + sum(cens, 0.0)
        # How many remain at risk in bin i, each weighted as of when it reached the bin (the
        # weights above date a duration from its start, so a long one always counts as old):
        # log(at_risk) + rate * (the bin's lower edge).
        reached = self._reached
        ended = sum(math.exp(min(r, 50.0)) * d for r, d in zip(reached, done, strict=True))
        log_enough = math.log(max(min(MIN_AT_RISK, 0.5 * ended), 1e-300))
        out: list[float] = []
        s = 1.0
        for i in range(self.bins):
            if at_risk > 0 and math.log(at_risk) + reached[i] >= log_enough:
                s *= max(0.0, 1.0 - done[i] / at_risk)
            out.append(s)
            at_risk -= done[i] + cens[i]
        return out

    def with_heavy_tail(self, table: list[float]) -> list[float]:
        """`table` continued past where Kaplan-Meier was read (the longest duration that
        ended, or where few remained at risk), where it is flat, by a Pareto tail of index
        `HEAVY_TAIL_INDEX`: what has lasted t is as likely as not to last 3t more, so what is
        still running is neither held forever nor dropped. For durations that may have
        changed regime (a task's next phase calls slower tools, gives longer answers), where
        a memoryless tail (as long again) would bring them all back too soon."""
        last = max(  # the last bin where the table fell
            (i for i in range(self.bins) if table[i] < (table[i - 1] if i else 1.0)), default=-1
        )
        if not 0 <= last < self.bins - 1 or table[last] <= 0:
            return table
        t_last = self.lo * self.ratio**last  # the upper edge of bin `last`
        return table[: last + 1] + [
            table[last] * (self.lo * self.ratio**i / t_last) ** -HEAVY_TAIL_INDEX
            for i in range(last + 1, self.bins)
        ]

    def survival_array(self, t: np.ndarray, table: list[float]) -> np.ndarray:
        """`survival` of every element."""
        if self.total <= 0:
            return np.zeros_like(t, dtype=np.float64)
        s = np.asarray(table)
        i = self.index_array(t)
        upper = s[i]
        lower = np.where(i > 0, s[np.maximum(i - 1, 0)], 1.0)
        log_t = np.log(np.maximum(t, 1e-300))
        frac = np.where(
            i == 0,
            t / self.lo,
            (log_t - self._log_lo - (i - 1) * self._log_ratio) / self._log_ratio,
        )
        frac = np.clip(frac, 0.0, 1.0)
        return np.where(t <= 0, 1.0, lower + (upper - lower) * frac)

    def survival(self, t: float, table: list[float]) -> float:
        """P(X > t), interpolated in log-time between the table's bin edges."""
        return float(self.survival_array(np.array([t], dtype=np.float64), table)[0])


@dataclass
class RisingShare:
    """A share that rises with a level, over log-spaced bins of it, samples fading with
    `half_life_s`: what a prefix cache has evicted of a context, by the tokens of the
    contexts used since it was (`Recency`).

    An LRU prefix cache (vLLM's, the simulator's) keeps the contexts used most recently and
    evicts the rest, so the share of a returning trajectory's context that is recomputed
    rises with the tokens used since it was last used, up to whole once they pass the
    cache's capacity; one average share spreads over every return the recompute that only
    the ones left deepest pay. The bins' ratios (token-weighted) are fitted nondecreasing
    (pool adjacent violators) and interpolated between; levels past the highest seen take
    the last bin's share, those short of the lowest the first's.
    """

    lo: float = 64.0  # tokens; 48 bins reach 10^9
    ratio: float = math.sqrt(2.0)
    bins: int = 48
    # The caches' share of the KV changes as workers switch roles and the load moves between
    # them; chosen on the forecast benchmark's tuning seeds among 40, 150 and 1000 s
    # (docs/forecast-history.md).
    half_life_s: float = 40.0
    part: np.ndarray = field(init=False)  # faded sums per bin of the share's numerator
    whole: np.ndarray = field(init=False)  # ... and denominator
    _t: float = field(init=False, default=0.0)  # when they were last faded
    _fit: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.part, self.whole = np.zeros(self.bins), np.zeros(self.bins)

    def index_array(self, x: np.ndarray) -> np.ndarray:
        return log_bins(x, self.lo, self.ratio, self.bins)

    def add_all(self, levels: np.ndarray, part: np.ndarray, whole: np.ndarray,
                now: float) -> None:  # fmt: skip
        """Samples of `part` out of `whole` (tokens recomputed, context) at `levels`."""
        if not levels.size:
            return
        if now > self._t:
            fade = 0.5 ** ((now - self._t) / self.half_life_s)
            self.part *= fade
            self.whole *= fade
            self._t = now
        i = self.index_array(levels)
        self.part += np.bincount(i, part, self.bins)
        self.whole += np.bincount(i, whole, self.bins)
        self._fit = None

    def at(self, levels: np.ndarray, default: float) -> np.ndarray:
        """The share at each level; `default` everywhere before any sample."""
        fit = self._fitted()
        if fit is None:
            return np.full(np.shape(levels), default)
        out: np.ndarray = fit[self.index_array(np.asarray(levels, dtype=np.float64))]
        return out

    def _fitted(self) -> np.ndarray | None:
        if self._fit is not None:
            return self._fit
        seen = np.flatnonzero(self.whole > 0)
        if not seen.size:
            return None
        # pool adjacent violators over the bins with samples, weighted by their context;
        # between them, interpolated over the log-spaced bins
        vals: list[float] = []
        wts: list[float] = []
        sizes: list[int] = []
        for b in seen.tolist():
            v, w, n = float(self.part[b] / self.whole[b]), float(self.whole[b]), 1
            while vals and vals[-1] > v:
                pv, pw, pn = vals.pop(), wts.pop(), sizes.pop()
                v, w, n = (pv * pw + v * w) / (pw + w), pw + w, pn + n
            vals.append(v)
            wts.append(w)
            sizes.append(n)
        at_seen = np.clip(np.repeat(vals, sizes), 0.0, 1.0)
        fit: np.ndarray = np.interp(np.arange(self.bins), seen, at_seen)
        self._fit = fit
        return fit


class Recency:
    """Live contexts ordered by when each was last used: how many tokens were used more
    recently than a given time. An LRU prefix cache keeps those ahead of a context idle since
    then, so that, against the cache's capacity, says how much of it is evicted."""

    __slots__ = ("_after", "_touched")

    def __init__(self, touched: np.ndarray, tokens: np.ndarray) -> None:
        order = np.argsort(touched, kind="stable")
        self._touched = touched[order]
        w = np.asarray(tokens, dtype=np.float64)[order]
        self._after = np.concatenate((np.cumsum(w[::-1])[::-1], [0.0]))

    def tokens_after(self, at: np.ndarray) -> np.ndarray:
        """Tokens of the contexts last used after each time in `at`."""
        out: np.ndarray = self._after[np.searchsorted(self._touched, at, side="right")]
        return out
