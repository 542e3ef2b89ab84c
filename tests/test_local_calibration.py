"""The offline calibration of a local worker: the engine's own timings read from real vLLM
metrics, and a `RoleCapacity` that passes through the points the calibration measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorsa.control.engine_metrics import parse_engine_metrics
from prorsa.local.calibrate import SHORT_KV, Calibration, _Engine, agreement
from prorsa.policy.learn import CapacityEstimator
from prorsa.sim.costmodel import MeasuredCost

DATA = Path(__file__).parent / "data"


def test_the_engine_times_the_requests_of_a_window_of_real_metrics() -> None:
    before = parse_engine_metrics((DATA / "vllm-metrics-before.txt").read_text(), 0.0)
    after = parse_engine_metrics((DATA / "vllm-metrics-after.txt").read_text(), 10.0)
    assert before is not None and after is not None
    e = _Engine.between(before, after, 6)  # six prompts, 16 tokens each (tests/data/README.md)
    steps = after.counts["step_tokens"] - before.counts["step_tokens"]
    assert e.prefill_s == pytest.approx((after.sums["prefill_s"] - before.sums["prefill_s"]) / 6)
    assert e.step_s == pytest.approx((after.sums["itl"] - before.sums["itl"]) / 90)
    assert e.batch == pytest.approx(90 / steps)
    # another request ran on the engine meanwhile (or the metrics were unreadable): no figures
    assert _Engine.between(before, after, 5) == _Engine(None, None, None)
    assert _Engine.between(None, after, 6) == _Engine(None, None, None)


def test_the_calibrated_capacity_passes_through_the_measured_steps() -> None:
    cal = Calibration(20_000.0, 0.004, 0.007, 0.0002, 1e6, decode_s_per_kv_token=3e-7)
    cap = cal.capacity()
    assert cap.decode_step_s(1, SHORT_KV) == pytest.approx(cal.decode_step_s)
    # each extra short sequence adds its per-sequence cost and its KV
    step8 = cal.decode_step_s + 7 * (cal.decode_s_per_seq + cal.decode_s_per_kv_token * SHORT_KV)
    assert cap.decode_step_s(8, 8 * SHORT_KV) == pytest.approx(step8)
    assert cap.prefill_s(1024, 0) == pytest.approx(0.004 + 1024 / 20_000)


def test_agreement_is_against_the_engines_own_timings_where_there_are_some() -> None:
    engine = Calibration(25_000.0, 0.002, 0.006, 0.0001, 1e6)
    wall = Calibration(20_000.0, 0.010, 0.008, 0.0002, 1e6, engine=engine)
    got = agreement(wall, engine.capacity(), tokens=300, batch=3, kv=900)
    assert got == pytest.approx({"prefill_s": 0.0, "decode_step_s": 0.0}, abs=1e-9)
    off = agreement(Calibration(20_000.0, 0.010, 0.008, 0.0002, 1e6), engine.capacity())
    assert off["prefill_s"] < -0.1 and off["decode_step_s"] < -0.1


def test_the_simulators_measured_cost_steps_as_the_calibration_priced() -> None:
    """`benchmarks/sim_vs_real.py` simulates with the calibration: the decode step it models
    at any batch and KV is the one the allocator prices, long contexts included."""
    cal = Calibration(20_000.0, 0.004, 0.007, 0.0002, 1e6, decode_s_per_kv_token=3e-7)
    cap = cal.capacity()
    cost = MeasuredCost.from_capacity(cap)
    assert cost.prefill_s(500, 0.0) == pytest.approx(0.004 + 500 / 20_000.0)
    for batch, kv in ((1, SHORT_KV), (32, 32 * 300.0), (8, 8 * 4000.0)):
        assert cost.decode_step_s(batch, kv) == pytest.approx(cap.decode_step_s(batch, kv))
    assert cost.decode_step_s(32, 32 * 300.0) > cost.decode_step_s(32, 32 * SHORT_KV) * 1.15
    assert cost.role_capacity().decode_step_s(8, 1e4) == pytest.approx(cap.decode_step_s(8, 1e4))


def test_the_simulator_prices_a_capacity_learned_online_as_the_controller_does() -> None:
    """`sim_vs_real` also simulates with what the controller learned during the run: prefill
    with its context term, the decode step, the KV capacity, priced back as learned."""
    est = CapacityEstimator(Calibration(20_000.0, 0.004, 0.007, 0.0002, 1e6).capacity(),
                            prior_rel_sd=0.5, noise_rel=0.05)  # fmt: skip
    for i in range(60):  # a slower cluster than the prior: prefill slows with context
        tokens, context = 200.0 + 30 * (i % 7), 1000.0 * (i % 5)
        est.observe_prefill(tokens, context, 0.006 + tokens * (8e-5 + 2e-8 * context), float(i))
        est.observe_decode_step(4.0 + i % 9, 300.0 * (4 + i % 9), 0.012 + 4e-4 * (4 + i % 9),
                                float(i))  # fmt: skip
    learned = est.capacity()
    assert learned.prefill_s_per_token_per_context > 0
    cost = MeasuredCost.from_capacity(learned)
    for tokens, context in ((100.0, 0.0), (400.0, 3000.0), (1024.0, 8192.0)):
        assert cost.prefill_s(tokens, context) == pytest.approx(learned.prefill_s(tokens, context))
        assert cost.role_capacity().prefill_s(tokens, context) == pytest.approx(
            learned.prefill_s(tokens, context)
        )
    assert cost.prefill_s(400.0, 3000.0) > cost.prefill_s(400.0, 0.0) * 1.1
    for batch, kv in ((1, 300.0), (8, 2400.0)):
        assert cost.decode_step_s(batch, kv) == pytest.approx(learned.decode_step_s(batch, kv))
    assert cost.mixed_step_s(4, 1200.0, 300.0, 2000.0) == pytest.approx(
        learned.decode_step_s(4, 1200.0) + learned.prefill_s(300.0, 2000.0) - cost.prefill_fixed_s
    )
