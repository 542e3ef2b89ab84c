"""The capacity estimator: a prior corrected by evidence, robust to outliers, with its
uncertainty, forgetting slowly."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.learn import CapacityEstimator

PRIOR = RoleCapacity(
    prefill_tokens_per_s=20_000.0,
    decode_base_step_s=0.008,
    decode_s_per_seq=4e-5,
    decode_s_per_kv_token=2e-9,
    kv_capacity_tokens=1e6,
    prefill_s_per_token_per_context=1e-9,
    prefill_context=8192.0,
)
# The cluster as it really is: half the prefill speed, 1.5x every decode step.
TRUE_PREFILL_PER_TOKEN = 2.0 / PRIOR.prefill_tokens_per_s


def true_prefill_s(tokens: float, context: float) -> float:
    c1 = TRUE_PREFILL_PER_TOKEN - 2e-9 * 8192
    return 0.004 + tokens * (c1 + 2e-9 * context)


def true_step_s(batch: float, kv: float) -> float:
    return 1.5 * PRIOR.decode_step_s(batch, kv)


def feed(est: CapacityEstimator, n: int, rng: random.Random, outliers: float = 0.0,
         t0: float = 0.0) -> None:  # fmt: skip
    for i in range(n):
        tokens, ctx = rng.uniform(100, 4000), rng.uniform(0, 30_000)
        slow = 20.0 if rng.random() < outliers else 1.0
        est.observe_prefill(tokens, ctx, true_prefill_s(tokens, ctx) * slow
                            * rng.uniform(0.9, 1.1), t0 + i)  # fmt: skip
        batch = rng.uniform(1, 256)
        kv = batch * rng.uniform(500, 20_000)
        est.observe_decode_step(batch, kv, true_step_s(batch, kv) * slow
                                * rng.uniform(0.9, 1.1), t0 + i)  # fmt: skip


def typical_prefill_rate() -> float:
    return 1024 / true_prefill_s(1024, PRIOR.prefill_context)


def test_without_evidence_it_is_the_prior() -> None:
    cap = CapacityEstimator(PRIOR).capacity()
    assert cap.prefill_tokens_per_s == pytest.approx(PRIOR.prefill_tokens_per_s, rel=1e-6)
    assert cap.decode_step_s(64, 1e6) == pytest.approx(PRIOR.decode_step_s(64, 1e6), rel=1e-6)
    assert cap.kv_capacity_tokens == PRIOR.kv_capacity_tokens


def test_evidence_moves_it_to_the_truth_and_shrinks_the_uncertainty() -> None:
    est = CapacityEstimator(PRIOR)
    before = est.evidence()
    feed(est, 300, random.Random(1))
    cap, after = est.capacity(), est.evidence()
    assert cap.prefill_tokens_per_s == pytest.approx(typical_prefill_rate(), rel=0.05)
    for batch, kv in ((8, 1e5), (64, 1e6), (200, 3e6)):
        assert cap.decode_step_s(batch, kv) == pytest.approx(true_step_s(batch, kv), rel=0.05)
    assert after["prefill_rel_sd"] < 0.2 * before["prefill_rel_sd"]
    assert after["decode_rel_sd"] < 0.2 * before["decode_rel_sd"]
    assert after["prefill_samples"] > 250


def test_it_learns_what_a_request_costs_whatever_its_size() -> None:
    """The cluster pays 4 ms per prefill request: the learned capacity prices short and long
    requests as the cluster runs them, where the rate quoted at 1,024 tokens alone would
    price a 100-token request 30% too fast."""
    est = CapacityEstimator(PRIOR)
    feed(est, 300, random.Random(2))
    cap = est.capacity()
    assert cap.prefill_request_s == pytest.approx(0.004, rel=0.25)
    for tokens, ctx in ((100, 0.0), (1024, 8192.0), (4000, 30_000.0)):
        assert cap.prefill_s(tokens, ctx) == pytest.approx(true_prefill_s(tokens, ctx), rel=0.06)
    rate_only = replace(cap, prefill_request_s=0.0)
    assert rate_only.prefill_s(100, 0.0) < 0.75 * true_prefill_s(100, 0.0)


def test_a_window_of_few_steps_teaches_less_than_one_of_many() -> None:
    """A worker's metrics between two reads are a mean over its steps: a window in which a
    mostly idle decode worker ran a handful of them is a noisy mean and counts for less."""
    moved = {}
    for steps in (4.0, 400.0):
        est = CapacityEstimator(PRIOR)
        est.observe_decode_step(2, 1e3, 1.2 * PRIOR.decode_step_s(2, 1e3), 1.0, steps=steps)
        moved[steps] = est.capacity().decode_step_s(2, 1e3) / PRIOR.decode_step_s(2, 1e3) - 1
        assert est.evidence()["decode_samples"] == pytest.approx(steps / (steps + 32))
    assert 0 < moved[4.0] < 0.7 * moved[400.0]


def test_outliers_barely_move_it() -> None:
    est = CapacityEstimator(PRIOR)
    feed(est, 400, random.Random(2), outliers=0.05)
    cap = est.capacity()
    assert cap.prefill_tokens_per_s == pytest.approx(typical_prefill_rate(), rel=0.10)
    assert cap.decode_step_s(64, 1e6) == pytest.approx(true_step_s(64, 1e6), rel=0.10)


def test_old_evidence_fades_back_toward_the_prior() -> None:
    est = CapacityEstimator(PRIOR, half_life_s=60.0)
    feed(est, 200, random.Random(3))
    learned = est.capacity().prefill_tokens_per_s
    est.observe_decode_step(16, 1e5, true_step_s(16, 1e5), now=200 + 60 * 20)  # 20 half-lives
    faded = est.capacity().prefill_tokens_per_s
    assert abs(faded - PRIOR.prefill_tokens_per_s) < 0.2 * abs(learned - PRIOR.prefill_tokens_per_s)


def test_broken_reports_teach_nothing() -> None:
    est = CapacityEstimator(PRIOR)
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        est.observe_prefill(1000, 0, bad, 1.0)
        est.observe_decode_step(10, 1e4, bad, 1.0)
    est.observe_kv_capacity("w", float("nan"))
    assert est.capacity() == CapacityEstimator(PRIOR).capacity()
    assert est.evidence()["prefill_samples"] == 0


def test_kv_is_the_smallest_workers_and_switches_are_smoothed() -> None:
    est = CapacityEstimator(replace_switch(PRIOR, 10.0))
    est.observe_kv_capacity("a", 9e5)
    est.observe_kv_capacity("b", 7e5)
    assert est.capacity().kv_capacity_tokens == 7e5
    est.forget_worker("b")
    assert est.capacity().kv_capacity_tokens == 9e5
    for s in (300.0, 320.0, 280.0):
        est.observe_switch(s)
    assert est.capacity().switch_s == pytest.approx(300.0, rel=0.05)
    assert est.evidence()["switches"] == 3


def replace_switch(c: RoleCapacity, s: float) -> RoleCapacity:
    from dataclasses import replace

    return replace(c, switch_s=s)


def test_the_simulator_teaches_the_allocator_its_true_capacity() -> None:
    """A cluster with half the datasheet's prefill speed and 1.5x its decode step: the
    policy starts from the datasheet and, fed the workers' own timings, ends near the truth."""
    from dataclasses import replace

    from prorsa.policy.allocate import AllocationSettings
    from prorsa.sim.config import SimConfig
    from prorsa.sim.costmodel import ScaledCost
    from prorsa.sim.engine import Simulator
    from prorsa.sim.presets import preset
    from prorsa.sim.workload import generate, load_workload

    base = preset("h200")
    true = ScaledCost(base, prefill_speed=0.5, decode_slowdown=1.5)
    prior, truth = base.role_capacity(), true.role_capacity()
    settings = replace(AllocationSettings(), policy="static", static_prefill=1)
    cfg = SimConfig(gpus=4, trajectories=64, seed=1, settings=settings,
                    capacity_prior=prior, learn_capacity=True)  # fmt: skip
    spec = load_workload("swe")
    sim = Simulator(true, generate(spec, 64, 1), cfg)
    sim.run()
    assert sim.learner is not None
    learned = sim.learner.capacity()
    assert learned == sim.policy.capacity  # the policy prices with what was learned
    at = (32.0, 32 * 8000.0)
    for got, want, was in (
        (learned.prefill_tokens_per_s, truth.prefill_tokens_per_s, prior.prefill_tokens_per_s),
        (learned.decode_step_s(*at), truth.decode_step_s(*at), prior.decode_step_s(*at)),
    ):
        assert got == pytest.approx(want, rel=0.25)
        assert abs(got - want) < 0.5 * abs(was - want)
    # without learning the policy keeps the datasheet's figures to the end
    plain = Simulator(true, generate(spec, 64, 1), replace(cfg, learn_capacity=False))
    plain.run()
    assert plain.learner is None and plain.policy.capacity == prior
