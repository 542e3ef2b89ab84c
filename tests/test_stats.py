from __future__ import annotations

import random

import numpy as np
import pytest

from prorsa.policy.stats import Ewma, LogHistogram, LogMoments, Recency, RisingShare
from prorsa.sim.workload import Dist


def test_histogram_survival_matches_the_samples() -> None:
    rng = random.Random(0)
    dist = Dist(median=2.0, p99=120.0, min=0.1, max=300.0)
    xs = [dist.sample(rng) for _ in range(20000)]
    h = LogHistogram()
    for x in xs:
        h.add(x)
    table = h.survival_table()
    for t in (0.5, 2.0, 10.0, 60.0):
        empirical = sum(x > t for x in xs) / len(xs)
        assert abs(h.survival(t, table) - empirical) < 0.02, t


def test_censored_calls_lengthen_the_tail() -> None:
    h = LogHistogram()
    for _ in range(100):
        h.add(1.0, now=100.0)  # every call seen so far returned after a second...
    plain = h.survival_table()
    cens = [0.0] * h.bins
    cens[h.index(50.0)] = 100.0  # ...but as many are still running after 50 s
    with_cens = h.survival_table(cens, now=100.0)
    assert h.survival(2.0, plain) < 0.01
    assert h.survival(2.0, with_cens) > 0.4


def test_old_samples_fade_with_their_age() -> None:
    h = LogHistogram(half_life_s=60.0)
    for i in range(2000):
        h.add(1.0, now=i * 0.1)  # the first 200 s: one-second calls
    for i in range(2000):
        h.add(100.0, now=1000.0 + i * 0.1)  # 13 half-lives later: 100-second calls
    assert h.survival(10.0, h.survival_table()) > 0.95
    assert h.effective(1200.0) < 2000.0


def test_log_moments_and_ewma() -> None:
    m = LogMoments()
    for x in (10.0, 100.0, 1000.0):
        m.add(x)
    assert abs(m.mean - 4.605) < 1e-3
    e = Ewma(0.5)
    assert e.get(7.0) == 7.0
    e.add(2.0)
    e.add(4.0)
    assert e.get(0.0) == 3.0


def test_batched_updates_equal_one_sample_at_a_time() -> None:
    """The lifecycle table learns a batch of events at once: the closed forms must agree
    with the plain recurrences, including the first sample and per-sample weights."""
    rng = np.random.default_rng(0)
    xs = rng.lognormal(5.0, 1.0, 3000)
    weights = rng.uniform(0.0, 1.0, 3000)
    for start in (None, 40.0):
        batched, single = Ewma(0.05, start), Ewma(0.05, start)
        batched.add_all(xs)
        for x in xs:
            single.add(float(x))
        assert batched.value == pytest.approx(single.value, rel=1e-9)
        weighted, stepwise = Ewma(0.05, start), Ewma(0.05, start)
        weighted.add_all(xs, weights)
        for x, w in zip(xs.tolist(), weights.tolist(), strict=True):
            v = stepwise.value
            stepwise.value = x if v is None else v + 0.05 * w * (x - v)
        assert weighted.value == pytest.approx(stepwise.value, rel=1e-9)
    times = np.sort(rng.uniform(0.0, 30_000.0, 3000))  # long enough to rebase the weights
    batched_h, single_h = LogHistogram(), LogHistogram()
    batched_h.add_all(xs[:1500], times[:1500])
    batched_h.add_all(xs[1500:], times[1500:])
    for x, t in zip(xs.tolist(), times.tolist(), strict=True):
        single_h.add(x, t)
    assert batched_h.n == single_h.n == 3000
    table_b, table_s = batched_h.survival_table(), single_h.survival_table()
    assert table_b == pytest.approx(table_s, abs=1e-9)
    probes = np.array([-1.0, 0.0, 0.005, 0.01, 0.5, 3.0, 150.0, 1e4, 1e9])
    assert batched_h.index_array(probes).tolist() == [batched_h.index(p) for p in probes]
    assert batched_h.survival_array(probes, table_b).tolist() == pytest.approx(
        [batched_h.survival(p, table_b) for p in probes], abs=1e-12
    )


def _steady_stream(h: LogHistogram, now: float, by_start: bool) -> list[float]:
    """One duration starts each second until `now`, alternately 100 s and 1,000 s long (both
    longer than the half-life): ended ones added at their start (or end), running ones
    censored at their elapsed time, weighted as of their start (or in full)."""
    cens = [0.0] * h.bins
    for k in range(int(now)):
        d = 100.0 if k % 2 else 1000.0
        if k + d <= now:
            h.add(d, now=float(k) if by_start else k + d)
        else:
            w = float(h.start_weights(np.array([now - k]))[0]) if by_start else 1.0
            cens[h.index(now - k)] += w
    return cens


def test_durations_weighted_by_their_start_give_the_true_survival() -> None:
    """Half of the durations last 100 s: S just past 100 s is 0.5. Weighted by their end,
    ended durations fade while the running ones count in full, and the long ones count
    for more than half."""
    now = 3000.0
    cohort = LogHistogram(half_life_s=180.0)
    s_cohort = cohort.survival(150.0, cohort.survival_table(_steady_stream(cohort, now, True), now))
    by_end = LogHistogram(half_life_s=180.0)
    s_end = by_end.survival(150.0, by_end.survival_table(_steady_stream(by_end, now, False), now))
    assert s_cohort == pytest.approx(0.5, abs=0.05)
    assert s_end > 0.6


def _half_ended(ended_s: float, running_s: float) -> tuple[LogHistogram, list[float]]:
    """50 durations that ended after `ended_s`, as many still running after `running_s`:
    the histogram and its (Kaplan-Meier) survival table."""
    h = LogHistogram()
    for _ in range(50):
        h.add(ended_s)
    cens = [0.0] * h.bins
    cens[h.index(running_s)] = 50.0
    return h, h.survival_table(cens)


def _cohort_short_of_a_few_long(long_n: int) -> tuple[LogHistogram, list[float]]:
    """100 durations of 1-30 s and `long_n` of 60 s ended, all begun at 100 s; 50 more have
    run 40 s so far (a next phase's long decodes, short of the few long ones that ended)."""
    h = LogHistogram()
    for i in range(100):
        h.add(1.0 + 0.29 * i, now=100.0)
    for _ in range(long_n):
        h.add(60.0, now=100.0)
    cens = [0.0] * h.bins
    cens[h.index(40.0)] = 50.0
    return h, h.survival_table(cens, now=100.0)


def test_a_handful_of_long_durations_does_not_end_a_cohort_running_short_of_them() -> None:
    """Three durations ended at 60 s and nothing ran longer: read as they are, every one
    that reaches 60 s ends there, so the 50 running at 40 s would all be gone by 64 s.
    Fewer than `MIN_AT_RISK` remain at risk there: the table stays flat and the heavy tail
    takes over from where it was read. With 30 such durations the table is read to 0."""
    h, few = _cohort_short_of_a_few_long(3)
    assert h.survival(90.0, few) == h.survival(45.0, few) > 0.0
    tail = h.with_heavy_tail(few)
    running_at_70 = h.survival(70.0, tail) / h.survival(45.0, tail)
    assert 0.5 < running_at_70 < 0.95  # the heavy tail past where it was read: some end
    h, many = _cohort_short_of_a_few_long(30)
    assert h.survival(90.0, many) == 0.0


def test_long_durations_that_ended_recently_are_read_however_long() -> None:
    """The weights date a duration from its start, so 50 durations of 1,000 s that ended
    just now weigh 0.3% each with a two-minute half-life; counted as of when they reached
    each duration they are 50 at risk, enough to read: none outlasts their bin (to 1,311 s)."""
    h = LogHistogram(half_life_s=120.0)
    for i in range(50):
        h.add(1000.0, now=1000.0 + 0.1 * i)
    cens = [0.0] * h.bins
    table = h.survival_table(cens, now=2005.0)
    assert h.survival(1400.0, table) == 0.0


def test_recency_counts_the_tokens_of_the_contexts_used_since_a_time() -> None:
    """Contexts of 100, 200, 400 and 800 tokens last used at 1, 2, 2 and 5 s."""
    r = Recency(np.array([5.0, 2.0, 1.0, 2.0]), np.array([800, 200, 100, 400]))
    got = r.tokens_after(np.array([0.0, 1.0, 1.5, 2.0, 4.9, 5.0]))
    assert got.tolist() == [1500.0, 1400.0, 1400.0, 800.0, 800.0, 0.0]
    assert Recency(np.array([]), np.array([])).tokens_after(np.array([1.0])).tolist() == [0.0]


def test_a_rising_share_rises_with_its_level_and_holds_past_the_highest_seen() -> None:
    """What an LRU cache evicted of contexts with tokens used since: nothing behind 10K,
    half (noisily) behind 100K, all behind 1M. The fit is nondecreasing, and holds its last
    share past the highest level seen."""
    s = RisingShare()
    assert s.at(np.array([5e4]), 0.3).tolist() == [0.3]  # nothing learned: the default
    since = np.array([1e4] * 20 + [1e5] * 20 + [1.2e5] * 20 + [1e6] * 20)
    share = np.array([0.0] * 20 + [0.6] * 20 + [0.4] * 20 + [1.0] * 20)  # 120K below 100K
    ctx = np.full(since.size, 1000.0)
    s.add_all(since, share * ctx, ctx, now=10.0)
    got = s.at(np.array([5e3, 1e4, 1e5, 1.2e5, 1e6, 5e7]), 0.3)
    assert got[0] == got[1] == 0.0
    assert got[2] == pytest.approx(0.5) == got[3]  # pooled: the fit never falls
    assert got[4] == got[5] == 1.0
    assert np.all(np.diff(s.at(np.geomspace(10.0, 1e9, 50), 0.3)) >= 0)


def test_a_rising_share_follows_the_cache_as_it_changes() -> None:
    """The decode workers' caches hold 300K tokens, then fewer once some became prefill
    workers: contexts behind 200K are gone. The old samples fade with the half-life."""
    s = RisingShare(half_life_s=40.0)
    ctx = np.full(50, 1000.0)
    s.add_all(np.full(50, 2e5), np.zeros(50), ctx, now=100.0)
    assert s.at(np.array([2e5]), 0.5)[0] == 0.0
    s.add_all(np.full(50, 2e5), ctx, ctx, now=300.0)  # five half-lives later
    assert s.at(np.array([2e5]), 0.5)[0] > 0.95


def test_the_heavy_tail_sends_calls_in_flight_past_the_longest_ended_back_slowly() -> None:
    """Kaplan-Meier says a call that has outlasted every ended one never returns; the heavy
    tail says it returns within three times as long again with even odds."""
    h, flat = _half_ended(1.0, running_s=10.0)
    tail = h.with_heavy_tail(flat)
    assert h.survival(100.0, flat) == pytest.approx(0.5)  # never returns
    assert h.survival(0.9, tail) == h.survival(0.9, flat)  # up to the last ended: the same
    for e in (10.0, 100.0):
        back = 1.0 - h.survival(4.0 * e, tail) / h.survival(e, tail)
        assert back == pytest.approx(0.5, abs=0.08)
