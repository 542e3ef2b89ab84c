from __future__ import annotations

from dataclasses import replace

import pytest

from prorsa.policy.allocate import (
    Allocation,
    AllocationSettings,
    ClusterView,
    PredictivePolicy,
    ReactivePolicy,
    Role,
    StaticPolicy,
    WorkerView,
    make_policy,
    plan_switches,
)
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.forecast import Forecast, Horizon

CAP = RoleCapacity(
    prefill_tokens_per_s=20_000.0,
    decode_base_step_s=0.006,
    decode_s_per_seq=2e-5,
    decode_s_per_kv_token=3e-8,
    kv_capacity_tokens=800_000.0,
)


def view(p: int, d: int, **kw: float) -> ClusterView:
    workers = [WorkerView(f"w{i}", Role.PREFILL) for i in range(p)]
    workers += [WorkerView(f"w{p + i}", Role.DECODE, **kw) for i in range(d)]  # type: ignore[arg-type]
    return ClusterView(tuple(workers))


def flat(
    prefill_tps: float, seqs: float, kv_per_seq: float = 20_000.0, backlog: float = 0.0
) -> Forecast:
    return Forecast(
        5.0,
        [prefill_tps] * 12,
        [seqs] * 12,
        [seqs * kv_per_seq] * 12,
        prefill_backlog_tokens=backlog,
        mean_prefill_tokens=1000.0,
        evidence=10_000,
    )


def test_predictive_adds_prefill_when_prefill_demand_dominates() -> None:
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0), CAP)
    d = pol.decide(view(1, 15), flat(prefill_tps=150_000, seqs=50), now=0.0)
    assert d.target.prefill >= 6
    assert all(s.from_role == Role.DECODE and s.to_role == Role.PREFILL for s in d.switches)


def test_predictive_adds_decode_when_kv_would_overflow() -> None:
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0), CAP)
    d = pol.decide(view(12, 4), flat(prefill_tps=5_000, seqs=400, kv_per_seq=30_000), now=0.0)
    assert d.target.decode >= 12


def test_predictive_respects_min_counts_and_the_cap_per_decision() -> None:
    s = AllocationSettings(min_prefill=2, min_decode=3, max_switches_per_decision=2, cooldown_s=0)
    pol = PredictivePolicy(s, CAP)
    d = pol.decide(view(8, 8), flat(prefill_tps=0, seqs=500, kv_per_seq=30_000), now=0.0)
    assert d.target.prefill == 2  # wants zero prefill, but the minimum is two
    assert len(d.switches) == 2
    assert pol.clamp(Allocation(16, 0), 16) == Allocation(13, 3)
    assert pol.clamp(Allocation(0, 16), 16) == Allocation(2, 14)


def test_hysteresis_holds_a_small_gain_from_growing_the_prefill_pool() -> None:
    pol = PredictivePolicy(AllocationSettings(hysteresis=0.5, cooldown_s=0), CAP)
    fc = flat(prefill_tps=60_000, seqs=100)
    assert pol.cost(fc, 3, 2, 16) < pol.cost(fc, 2, 2, 16)  # one more would help a little
    d = pol.decide(view(2, 14), fc, now=0.0)
    assert d.switches == [] and "hold" in d.reason


def test_a_prefill_pool_that_stopped_paying_goes_back_to_decode_without_hysteresis() -> None:
    """The cost is mostly trajectory-seconds no split can save, so a gain of a few percent of
    it is a large real difference; hysteresis there kept unneeded pools for many minutes."""
    pol = PredictivePolicy(AllocationSettings(hysteresis=0.5, cooldown_s=0), CAP)
    fc = flat(prefill_tps=60_000, seqs=100)
    gain = pol.cost(fc, 6, 6, 16) - pol.cost(fc, 3, 6, 16)
    assert 0 < gain < 0.5 * pol.cost(fc, 6, 6, 16)
    d = pol.decide(view(6, 10), fc, now=0.0)
    assert d.target.prefill == 3


def test_cooldown_blocks_back_to_back_switches() -> None:
    pol = PredictivePolicy(AllocationSettings(cooldown_s=30), CAP)
    first = pol.decide(view(1, 15), flat(prefill_tps=200_000, seqs=20), now=0.0)
    assert first.switches
    again = pol.decide(view(1, 15), flat(prefill_tps=200_000, seqs=20), now=10.0)
    assert again.switches == [] and again.reason.startswith("cooldown")
    later = pol.decide(view(1, 15), flat(prefill_tps=200_000, seqs=20), now=31.0)
    assert later.switches


def test_plan_never_switches_a_draining_worker_and_prefers_idle_ones() -> None:
    workers = (
        WorkerView("busy", Role.DECODE, inflight_decode=30),
        WorkerView("idle", Role.DECODE),
        WorkerView("draining", Role.DECODE, draining=True, target_role=Role.PREFILL),
        WorkerView("p", Role.PREFILL),
    )
    v = ClusterView(workers)
    assert v.allocation == Allocation(2, 2)
    plan = plan_switches(v, Allocation(3, 1), max_switches=4)
    assert [s.worker for s in plan] == ["idle"]


def test_plan_never_drains_the_last_decode_worker() -> None:
    v = ClusterView((WorkerView("p", Role.PREFILL), WorkerView("d", Role.DECODE)))
    assert plan_switches(v, Allocation(2, 0), max_switches=4) == []


def test_static_and_colocated_targets() -> None:
    s = AllocationSettings(static_prefill=3, policy="static")
    pol = make_policy(s, CAP)
    assert isinstance(pol, StaticPolicy)
    assert pol.initial_roles(8).count(Role.PREFILL) == 3
    col = make_policy(AllocationSettings(policy="colocated"), CAP)
    assert col.initial_roles(4) == [Role.MIXED] * 4
    assert (
        col.decide(
            ClusterView(tuple(WorkerView(f"w{i}", Role.MIXED) for i in range(4))), None, 0
        ).switches
        == []
    )


def test_reactive_moves_one_worker_on_a_threshold() -> None:
    pol = ReactivePolicy(AllocationSettings(cooldown_s=0), CAP)
    hot_prefill = view(2, 6, kv_tokens=0.0)
    hot_prefill = ClusterView(
        tuple(
            WorkerView(w.id, w.role, queued_prefill_tokens=100_000 if w.role == Role.PREFILL else 0)
            for w in hot_prefill.workers
        )
    )
    d = pol.decide(hot_prefill, None, 0.0)
    assert d.target == Allocation(3, 5) and len(d.switches) == 1
    hot_decode = view(4, 4, kv_tokens=750_000.0)
    d = pol.decide(hot_decode, None, 10.0)
    assert d.target == Allocation(3, 5)


def test_reactive_gives_decode_priority_when_both_sides_are_hot() -> None:
    """Prefilled requests cannot join a full decode pool: holding on "both hot" starved it."""
    pol = ReactivePolicy(AllocationSettings(cooldown_s=0), CAP)
    workers = [WorkerView(f"p{i}", Role.PREFILL, queued_prefill_tokens=100_000) for i in range(3)]
    workers.append(WorkerView("d", Role.DECODE, kv_tokens=790_000.0))
    d = pol.decide(ClusterView(tuple(workers)), None, 0.0)
    assert d.target == Allocation(2, 2) and len(d.switches) == 1


def test_reactive_waits_out_an_engine_restart_between_switches() -> None:
    slow = replace(CAP, switch_s=300.0)
    pol = ReactivePolicy(AllocationSettings(cooldown_s=10), slow)
    hot_decode = view(4, 4, kv_tokens=750_000.0)
    assert pol.decide(hot_decode, None, 0.0).switches
    assert pol.decide(hot_decode, None, 590.0).reason.startswith("cooldown")
    assert pol.decide(hot_decode, None, 601.0).switches
    quick = ReactivePolicy(AllocationSettings(cooldown_s=10), CAP)
    assert quick.decide(hot_decode, None, 0.0).switches
    assert quick.decide(hot_decode, None, 11.0).switches


def test_predictive_holds_until_it_has_seen_enough() -> None:
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0, min_evidence=100), CAP)
    young = flat(prefill_tps=150_000, seqs=50)
    young.evidence = 10
    d = pol.decide(view(1, 15), young, now=0.0)
    assert d.switches == [] and d.reason.startswith("learning")


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        make_policy(AllocationSettings(policy="magic"), CAP)


def test_idle_prefill_workers_return_to_decode_even_when_decodes_are_long() -> None:
    """Returning a prefill worker to decode only drains the request it is prefilling, so long
    decodes (minutes of reasoning) must not pin an idle prefill pool in place; taking a
    decode worker away does wait for its long decodes."""
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0), CAP)
    fc = flat(prefill_tps=2_000, seqs=3_000, kv_per_seq=3_000)
    fc.mean_decode_s = 90.0
    d = pol.decide(view(3, 29), fc, now=0.0)
    assert d.target.prefill < 3
    assert all(s.from_role == Role.PREFILL for s in d.switches)
    cost = PredictivePolicy(AllocationSettings(), CAP).cost
    to_decode = cost(fc, 2, 3, 32) - cost(fc, 3, 3, 32)  # from 3P: leave the pool, or stay
    to_prefill = cost(fc, 3, 2, 32) - cost(fc, 2, 2, 32)  # from 2P: grow the pool, or stay
    assert to_decode < 0 < to_prefill


def test_a_prefill_pool_is_charged_the_recompute_its_lost_kv_causes() -> None:
    """When the live contexts only just fit the decode workers' KV, every worker taken from
    decode evicts some, and each returning turn then recomputes its context: a pool that is
    worth opening on the prefill rate alone is not. From a split that already evicts as much,
    nothing changes."""
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0), CAP)
    fc = flat(prefill_tps=200_000, seqs=100, kv_per_seq=10_000)
    fits = 16 * CAP.kv_capacity_tokens
    fc.resident_kv_tokens, fc.live_trajectories = 0.1 * fits, 0.1 * fits / 20_000
    assert pol.cost(fc, 2, 0, 16) < pol.cost(fc, 0, 0, 16)  # a pool pays, on the rate alone
    tight = replace(fc, resident_kv_tokens=0.98 * fits, live_trajectories=0.98 * fits / 20_000)
    roomy = replace(tight, resident_kv_tokens=0.5 * fits)  # the same contexts, half the size
    assert pol.cost(tight, 4, 0, 16) > pol.cost(roomy, 4, 0, 16)
    assert pol.cost(tight, 0, 0, 16) == pol.cost(roomy, 0, 0, 16)  # nothing evicted at 0P
    assert pol.decide(view(0, 16), tight, now=0.0).target.prefill == 0
    assert pol.cost(tight, 4, 4, 16) == pol.cost(roomy, 4, 4, 16)  # evicting as much already


def test_prefill_slows_with_the_context_it_attends_to() -> None:
    from prorsa.policy.capacity import RoleCapacity

    flat = RoleCapacity(1000.0, 0.01, 1e-5, 1e-8, 1e6)
    assert flat.prefill_slowdown(100_000) == 1.0
    cap = RoleCapacity(1000.0, 0.01, 1e-5, 1e-8, 1e6, prefill_s_per_token_per_context=1e-7)
    assert cap.prefill_slowdown(8192) == 1.0
    assert cap.prefill_slowdown(8192 + 10_000) == 2.0  # 1 ms per token becomes 2 ms
    assert cap.prefill_slowdown(0) >= 0.1


def test_a_prefill_requests_fixed_cost_slows_short_requests_not_the_quoted_rate() -> None:
    """The rate is quoted at 1,024-token requests; a request's fixed part (20 ms of the 51 ms
    there) makes 100-token requests run at well under half that rate."""
    quoted = RoleCapacity(20_000.0, 0.01, 1e-5, 1e-8, 1e6)
    fixed = replace(quoted, prefill_request_s=0.02)
    for c in (quoted, fixed):
        assert c.prefill_s(1024, c.prefill_context) == pytest.approx(1024 / 20_000)
    assert quoted.prefill_rate(100, quoted.prefill_context) == 20_000.0
    assert fixed.prefill_s(100, fixed.prefill_context) == pytest.approx(
        0.02 + 100 * 0.0512 / 1024 - 100 * 0.02 / 1024
    )
    assert fixed.prefill_rate(100, fixed.prefill_context) < 0.4 * 20_000


def test_a_pool_of_short_requests_pays_their_fixed_cost_appends_in_decode_steps_do_not() -> None:
    """The same token demand in 100-token requests: with a fixed cost per request a pool
    worker serves under half the tokens it would at the quoted rate, while an append riding
    in a decode step shares that step's fixed work; the allocator keeps fewer in the pool."""
    demand = replace(flat(prefill_tps=60_000, seqs=50), mean_prefill_tokens=100.0)
    settings = AllocationSettings(cooldown_s=0)
    quoted = PredictivePolicy(settings, CAP).decide(view(1, 15), demand, now=0.0)
    fixed = replace(CAP, prefill_request_s=0.02)
    paid = PredictivePolicy(settings, fixed).decide(view(1, 15), demand, now=0.0)
    assert quoted.target.prefill >= 2
    assert paid.target.prefill < quoted.target.prefill


def test_on_expert_parallel_slots_a_local_append_costs_what_the_lockstep_step_says() -> None:
    """DeepSeek-V3 slots as the simulator lays them out (4 prefill EP8 engines or 1 decode
    EP32 engine): what the allocator charges a decode step for carrying an append (its tokens
    and their attention to the context) follows the simulator's lockstep step, for agentic
    appends of 1-4K tokens to 8-32K contexts; and a flood of first prompts that a prefill slot
    can take pays for one."""
    from prorsa.sim.presets import role_preset

    costs = role_preset("h200-deepseek-v3")
    cap = costs.laid_out(colocated=False).role_capacity(colocated=False)
    unit = costs.decode
    for batch, context, append in ((4_000, 8_192, 1_024), (4_000, 32_768, 4_096),
                                   (2_000, 16_384, 2_048)):  # fmt: skip
        kv = batch * context
        truth = unit.mixed_step_s(batch, kv, append, context, 1) - unit.decode_step_s(batch, kv)
        assert cap.local_prefill_first_s(append, context) == pytest.approx(truth, rel=0.15)
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0, horizon_s=900, interval_s=15), cap)
    h = Horizon(15.0, 60)
    flood = Forecast.flat(
        h, 150_000, 3_000, 3_000 * 8_000, mean_prefill_tokens=8_000.0, evidence=10_000
    )  # fmt: skip  (what one prefill slot can take)
    assert pol.decide(view(0, 4), flood, now=0.0).target.prefill >= 1


def test_a_prefill_backlog_never_makes_a_split_look_cheaper() -> None:
    """A pool working off a backlog serves more than the current demand; that must not count
    as decode workers prefilling less than nothing."""
    pol = PredictivePolicy(AllocationSettings(), CAP)
    fc = flat(prefill_tps=5_000, seqs=2_000, kv_per_seq=2_000)
    fc.mean_prefill_tokens = 500.0
    busy = replace(fc, prefill_backlog_tokens=5_000_000.0)
    for p in (1, 2, 4):
        assert pol.cost(busy, p, p, 16) >= pol.cost(fc, p, p, 16)


def test_an_idle_pool_goes_back_to_decode_even_when_a_switch_restarts_the_engine() -> None:
    """A switched worker is priced by the time it serves neither role (drain + restart), once:
    an idle prefill worker that will decode again after a 300 s restart is worth switching over
    a 450 s horizon, however many sequences the decode workers carry meanwhile."""
    cap = replace(CAP, switch_s=300.0)
    pol = PredictivePolicy(AllocationSettings(cooldown_s=0), cap)
    fc = Forecast(
        15.0,
        [0.0] * 30,
        [6000.0] * 30,
        [6000.0 * 20_000.0] * 30,
        mean_prefill_tokens=1000.0,
        mean_decode_s=60.0,
        evidence=10_000,
    )
    assert pol.cost(fc, 0, 1, 4) < pol.cost(fc, 1, 1, 4)
    d = pol.decide(view(1, 3), fc, now=0.0)
    assert d.target == Allocation(0, 4)
