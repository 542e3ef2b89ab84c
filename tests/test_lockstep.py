"""The expert-parallel unit: lockstep of DP-attention ranks, the mixed-step penalty, units in
the simulator and the allocator, and the published configurations it is calibrated on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prorsa.policy.allocate import Role
from prorsa.sim.calibration import ROWS
from prorsa.sim.compare import placement_for, run_policy, static_splits
from prorsa.sim.config import SimConfig
from prorsa.sim.engine import Simulator
from prorsa.sim.hardware import HARDWARE, MODELS, low_latency_a2a_s
from prorsa.sim.lockstep import LockstepCost
from prorsa.sim.presets import preset, role_preset
from prorsa.sim.workload import generate, load_workload

DS = MODELS["deepseek-v3"]


def _unit(gpus: int = 8) -> LockstepCost:
    return LockstepCost(HARDWARE["h200"], DS, gpus)


@pytest.mark.parametrize("row", [r for r in ROWS if not r.open_question], ids=lambda r: r.name)
def test_calibrated_rows_are_within_15_percent_of_the_published_figure(row: object) -> None:
    assert abs(row.error_pct) <= 15.0, (row.name, row.published, row.simulated)  # type: ignore[attr-defined]


def test_every_row_cites_a_source_and_open_rows_say_why() -> None:
    assert len(ROWS) >= 7
    for r in ROWS:
        assert r.source and r.published > 0 and r.simulated > 0
    assert all(len(r.open_question) > 20 for r in ROWS if r.open_question)


def test_one_ranks_prefill_chunk_stalls_every_ranks_decode() -> None:
    """Same decodes on every rank; a 1K-token append on one rank makes the whole unit's step
    slower by far more than that chunk's share of the unit's work."""
    u = _unit()
    batch, kv = 8 * 32, 8 * 32 * 8192
    decode = u.decode_step_s(batch, kv)
    mixed = u.mixed_step_s(batch, kv, 1024, 8192, jobs=1)
    alone = u.prefill_s(1024, 8192) * u.gpus  # that chunk on one rank of a prefill unit
    assert mixed > decode + 0.5 * alone
    assert mixed > 1.3 * decode  # graphs, TBO and low-latency kernels are lost too


def test_the_step_is_the_slowest_ranks_and_idle_ranks_wait_for_it() -> None:
    u = _unit()
    # Four jobs on four ranks vs one rank doing the same chunk: the step is one rank's chunk,
    # not four of them, and the unit computes four times the tokens in it.
    one = u.mixed_step_s(64, 64 * 4096, 2048, 4096, jobs=1)
    four = u.mixed_step_s(64, 64 * 4096, 4 * 2048, 4096, jobs=4)
    assert four < 1.5 * one
    assert u.mixed_chunk_tokens(64, 10**6, jobs=4) > 3 * u.mixed_chunk_tokens(64, 10**6, jobs=1)


def test_all_to_all_follows_deepep_and_one_gpu_has_none() -> None:
    assert low_latency_a2a_s(8, 128, 7168) == pytest.approx((77 + 114) * 1e-6)
    assert low_latency_a2a_s(1, 128, 7168) == 0.0
    assert low_latency_a2a_s(64, 256, 7168) == pytest.approx(2 * (173 + 314) * 1e-6)


def test_a_unit_must_hold_the_weights_and_kv_grows_with_it() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        _ = LockstepCost(HARDWARE["h100"], DS, 8).kv_capacity_tokens
    assert _unit(16).kv_capacity_tokens > 2 * _unit(8).kv_capacity_tokens


def test_the_allocator_sees_a_lone_append_on_an_ep_unit_stall_every_rank() -> None:
    """The first append of a step runs on one rank while all wait (far below the unit's
    prefill rate); appends on the other ranks of that step ride almost free. One-GPU workers
    have no such step cost."""
    ep = preset("h200-deepseek-v3").role_capacity()
    dense = preset("h200").role_capacity()
    assert ep.local_prefill_rank_tokens_per_s < 0.5 * ep.prefill_tokens_per_s
    assert ep.local_prefill_first_s(1024) > 2 * 1024 / ep.prefill_tokens_per_s
    assert ep.local_prefill_rate > ep.prefill_tokens_per_s  # the marginal append
    assert dense.local_prefill_first_s(1024) == 0.0
    assert dense.local_prefill_rate == dense.prefill_tokens_per_s


def test_the_simulator_and_static_sweep_count_engine_units() -> None:
    cost = preset("h200-deepseek-v3")
    cfg = SimConfig(gpus=32, trajectories=24, seed=0)
    spec = load_workload("math")
    sim = Simulator(cost, generate(spec, 24, 0), cfg.resolved())
    assert len(sim.workers) == 4  # 32 GPUs in units of 8
    assert static_splits(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at least 2"):
        SimConfig(gpus=8).workers(cost.gpus_per_worker)
    r = run_policy(cost, spec, SimConfig(gpus=32, trajectories=24, seed=0), "static")
    assert r.trajectories == 24
    assert placement_for(cost, cfg.placement).local_prefill_max_tokens == 0


def test_one_gpu_presets_are_unchanged_by_units() -> None:
    cost = preset("h200")
    assert cost.gpus_per_worker == 1 and cost.dp_ranks == 1
    assert placement_for(cost, SimConfig(gpus=2).placement) == SimConfig(gpus=2).placement
    with pytest.raises(ValueError, match="one-GPU model"):
        preset("h200", gpus_per_worker=8)


# ---- stage-specific parallelism ------------------------------------------------------------


def test_roles_run_their_own_configuration_in_slots_of_the_larger_unit() -> None:
    costs = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=32)
    assert costs.staged and costs.slot_gpus(colocated=False) == 32
    laid = costs.laid_out(colocated=False)
    prefill, decode = laid.of(Role.PREFILL), laid.of(Role.DECODE)
    assert prefill.gpus_per_worker == decode.gpus_per_worker == 32
    # Four EP8 prefill engines in a slot prefill four times as fast as one.
    one = costs.prefill.prefill_s(2048, 0)
    assert prefill.prefill_s(2048, 0) == pytest.approx(one / 4)
    # A 32-GPU decode engine holds more KV than four 8-GPU ones (weights spread wider).
    assert decode.kv_capacity_tokens > 4 * costs.prefill.kv_capacity_tokens
    # Switching between different configurations restarts the engines, even in routing mode.
    assert costs.switch_s(Role.DECODE, Role.PREFILL) == MODELS["deepseek-v3"].restart_s
    same = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=8)
    assert not same.staged and same.switch_s(Role.DECODE, Role.PREFILL) == 0.0


def test_the_allocator_prices_each_role_with_its_own_engines() -> None:
    costs = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=32)
    cap = costs.laid_out(colocated=False).role_capacity(colocated=False)
    slot_prefill = costs.laid_out(colocated=False).prefill.role_capacity()
    assert cap.prefill_tokens_per_s == pytest.approx(slot_prefill.prefill_tokens_per_s)
    assert cap.kv_capacity_tokens == pytest.approx(costs.decode.kv_capacity_tokens)
    assert cap.switch_s > 0


def test_a_staged_cluster_simulates_and_a_bad_layout_is_refused() -> None:
    costs = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=32)
    spec = load_workload("math")
    cfg = SimConfig(gpus=64, trajectories=32, seed=0)
    r = run_policy(costs, spec, cfg, "static")
    assert r.trajectories == 32
    sim = Simulator(costs, generate(spec, 32, 0), cfg.resolved())
    assert len(sim.workers) == 2  # 64 GPUs in 32-GPU slots
    with pytest.raises(ValueError, match="divide"):
        role_preset("h200-deepseek-v3", prefill_gpus=24, decode_gpus=32)
    with pytest.raises(ValueError, match="one-GPU model"):
        role_preset("h200", decode_gpus=8)


def test_prefix_pull_what_if_computes_only_the_appends_on_the_pool() -> None:
    """With prefix pull a pool prefill pulls what the trajectory's decode worker holds instead
    of recomputing it: the same rollout computes far fewer prefill tokens."""
    costs = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=8)
    spec = load_workload("swe")
    base = SimConfig(gpus=32, trajectories=48, seed=1)
    base = replace(base, settings=replace(base.settings, static_prefill=2))
    plain = run_policy(costs, spec, base, "static")
    pulled = run_policy(costs, spec, replace(base, prefix_pull=True), "static")
    assert plain.trajectories == pulled.trajectories == 48
    assert pulled.prefill_tokens_computed < 0.7 * plain.prefill_tokens_computed


def test_turn_latencies_show_the_mixed_step_stall() -> None:
    """Colocated EP units pay a prefill on any rank in every rank's inter-token latency; the
    same rollout with a prefill pool (prefix pull, so the pool computes only appends) decodes
    with a lower ITL."""
    costs = role_preset("h200-deepseek-v3", prefill_gpus=8, decode_gpus=8, colocated_gpus=8)
    spec = load_workload("swe")
    cfg = SimConfig(gpus=32, trajectories=48, seed=2, prefix_pull=True)
    colocated = run_policy(costs, spec, cfg, "colocated")
    pooled = run_policy(
        costs, spec, replace(cfg, settings=replace(cfg.settings, static_prefill=1)), "static"
    )
    for r in (colocated, pooled):
        assert 0 < r.ttft_s[0] <= r.ttft_s[1] and 0 < r.itl_s[0] <= r.itl_s[1]
    assert pooled.itl_s[0] < colocated.itl_s[0]


def test_a_worker_switched_with_local_prefills_queued_finishes_them_and_resumes() -> None:
    """A decode worker's queued local prefills are decode-role work: it drains them before it
    switches; a worker that restarts into a new configuration resumes its queue (both used to
    leave a rollout stuck forever under the reactive policy)."""
    spec = load_workload("shift")
    cfg = SimConfig(gpus=64, trajectories=256, seed=0, max_sim_s=50_000)
    r = run_policy(role_preset("h200-deepseek-v3"), spec, cfg, "reactive")
    assert r.trajectories == 256 and r.switches >= 1
