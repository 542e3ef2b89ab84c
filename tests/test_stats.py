from __future__ import annotations

import random

from prorsa.policy.stats import Ewma, LogHistogram, LogMoments
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
