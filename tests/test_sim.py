from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from prorsa.policy.allocate import AllocationSettings, Role, make_policy
from prorsa.policy.events import EventType
from prorsa.sim.compare import compare, run_policy
from prorsa.sim.config import SimConfig
from prorsa.sim.engine import Simulator
from prorsa.sim.oracle import oracle_forecast
from prorsa.sim.presets import preset
from prorsa.sim.workload import generate, load_workload

COST = preset("h200")


def _sim(
    workload: str, policy: str, gpus: int = 4, n: int = 48, mode: str = "sync", **cfg: object
) -> Simulator:
    spec = load_workload(workload)
    config = SimConfig(
        gpus=gpus,
        mode=mode,
        trajectories=n,
        concurrency=16,
        seed=3,  # type: ignore[arg-type]
        settings=AllocationSettings(policy=policy, cooldown_s=5.0),
        **cfg,  # type: ignore[arg-type]
    ).resolved()
    sim = Simulator(
        COST,
        generate(spec, config.trajectories, 3),
        config,
        make_policy(config.settings, COST.role_capacity()),
    )
    if policy == "oracle":
        sim.oracle_forecast = oracle_forecast
    sim.event_log = []
    return sim


@pytest.mark.parametrize("policy", ["colocated", "static", "reactive", "predictive", "oracle"])
@pytest.mark.parametrize("workload", ["swe", "shift"])
def test_every_turn_is_prefilled_and_decoded_exactly_once(workload: str, policy: str) -> None:
    sim = _sim(workload, policy)
    violations: list[str] = []
    tick = sim._on_tick

    def checked_tick() -> None:
        violations.extend(sim.invariant_violations())
        tick()

    sim._on_tick = checked_tick  # type: ignore[method-assign]
    result = sim.run()
    assert violations == []
    scripts = [tr.script for tr in sim.trajs]
    assert result.trajectories == len(scripts)
    assert result.turns == sum(len(s.turns) for s in scripts)
    assert result.output_tokens == sum(s.total_output for s in scripts)
    assert sim.event_log is not None
    per_type = Counter(ev.type for ev in sim.event_log)
    turns = sum(len(s.turns) for s in scripts)
    assert per_type[EventType.TURN_SUBMIT] == turns
    assert per_type[EventType.PREFILL_DONE] == turns
    assert per_type[EventType.DECODE_DONE] == turns
    assert per_type[EventType.TRAJ_END] == len(scripts)
    # every decode_done reports exactly the scripted output of its turn
    outs: dict[str, list[int]] = {}
    for ev in sim.event_log:
        if ev.type == EventType.DECODE_DONE:
            outs.setdefault(ev.traj, []).append(ev.output_tokens)
    for s in scripts:
        assert outs[s.id] == [t.output_tokens for t in s.turns]
    # at the end nothing is left anywhere
    for w in sim.workers:
        assert not w.pq and w.count == 0 and not w.pending and w.incoming == 0
    if policy == "colocated":
        assert result.switches == 0


def test_same_seed_same_result_other_seed_other_result() -> None:
    a = _sim("swe", "predictive").run()
    b = _sim("swe", "predictive").run()
    assert (a.makespan_s, a.switches, a.turns) == (b.makespan_s, b.switches, b.turns)
    spec = load_workload("swe")
    other = run_policy(COST, spec, SimConfig(gpus=4, trajectories=48, seed=4), "predictive")
    assert other.makespan_s != a.makespan_s


def test_async_mode_keeps_concurrency_bounded_and_reports_throughput() -> None:
    sim = _sim("search", "predictive", mode="async", n=64)
    peak = 0
    tick = sim._on_tick

    def watch() -> None:
        nonlocal peak
        peak = max(peak, sim.started - sim.done)
        tick()

    sim._on_tick = watch  # type: ignore[method-assign]
    r = sim.run()
    assert r.trajectories == 64
    assert peak <= 16
    assert r.throughput_traj_per_min > 0


def test_restart_mode_costs_time_per_switch() -> None:
    spec = load_workload("shift")
    cfg = SimConfig(
        gpus=4, trajectories=48, seed=1, settings=replace(AllocationSettings(), cooldown_s=0)
    )
    routing = run_policy(preset("h200", "routing"), spec, cfg, "reactive")
    restart = run_policy(preset("h200", "restart"), spec, cfg, "reactive")
    assert routing.switches > 0 and restart.switches > 0
    assert restart.makespan_s > routing.makespan_s


def test_static_split_is_honoured() -> None:
    sim = _sim("swe", "static", gpus=8)
    sim.settings = sim.cfg.settings
    assert sum(1 for w in sim.workers if w.role == "prefill") == 2  # a quarter by default


def test_presets_and_bad_names() -> None:
    for name in ("h200", "h100", "h200-moe-30b", "h100-moe-30b"):
        cm = preset(name)
        assert cm.kv_capacity_tokens > 10_000
        assert cm.prefill_s(1000, 0) > 0 and cm.decode_step_s(8, 50_000) > cm.decode_step_s(8, 0)
    assert preset("h100").kv_capacity_tokens < preset("h200").kv_capacity_tokens
    with pytest.raises(ValueError, match="unknown preset"):
        preset("tpu")
    with pytest.raises(ValueError, match="switch mode"):
        preset("h200", "teleport")


def test_chunked_prefill_slows_the_decodes_it_rides_with() -> None:
    alone = COST.decode_step_s(16, 200_000)
    mixed = COST.mixed_step_s(16, 200_000, chunk=2048, chunk_ctx=20_000)
    assert mixed > 3 * alone


def test_oracle_acts_on_its_forecast_from_the_first_decision() -> None:
    """The oracle knows the future: it must not wait, like a forecaster, for decodes to learn
    from (an oracle that never switches is only the initial split in disguise)."""
    sim = _sim("search", "oracle", gpus=4, n=64)
    reasons: list[str] = []
    backlogs: list[tuple[float, float]] = []
    decide = sim.policy.decide

    def recorded(view, forecast, now):  # type: ignore[no-untyped-def]
        d = decide(view, forecast, now)
        reasons.append(d.reason)
        assert forecast is not None
        backlogs.append((forecast.prefill_backlog_tokens, sim.table.prefill_backlog_tokens))
        return d

    sim.policy.decide = recorded  # type: ignore[method-assign]
    sim.run()
    assert reasons and not any("learning" in r for r in reasons)
    assert all(f == t for f, t in backlogs)
    assert any(f > 0 for f, _ in backlogs)


def test_colocated_workers_shed_trajectories_like_the_router_does() -> None:
    """The router applies its rebalancing rule to every worker that decodes, mixed ones too;
    the simulated colocated baseline must get the same placement, not a stickier one."""
    sim = _sim("swe", "colocated", gpus=4, n=48)
    crowded, others = sim.workers[0], sim.workers[1:]
    for tr in sim.trajs[:20]:
        sim.router.set_home(tr, crowded)
    tr = sim.trajs[0]
    # a later turn whose context the crowded worker no longer holds: the new home recomputes
    w, local, _ = sim.router.place_prefill(tr, 3000, 200)
    assert w in others and local and sim.workers[tr.decode_home] is w
    # one it still holds: the crowded worker prefills it and the new home pulls the KV
    moved = sim.trajs[1]
    crowded.cache[moved.idx] = 2800
    w, local, _ = sim.router.place_prefill(moved, 3000, 200)
    assert w is crowded and not local and sim.workers[moved.decode_home] in others
    # a worker hosting its fair share keeps its trajectories
    calm = sim.trajs[30]
    sim.router.set_home(calm, others[0])
    w, local, _ = sim.router.place_prefill(calm, 3000, 200)
    assert w is others[0] and local


def test_a_moved_trajectorys_turn_reports_the_prefix_its_old_home_holds() -> None:
    """The crowded home that prefills a moved trajectory's turn holds its context: the turn's
    demand is its new tokens, as computed, not a recompute of the whole context (which
    the forecast would learn as evictions that never happened)."""
    sim = _sim("swe", "colocated", gpus=4, n=48)
    crowded = sim.workers[0]
    for tr in sim.trajs[:20]:
        sim.router.set_home(tr, crowded)
    moved = sim.trajs[1]
    moved.context = 2800
    crowded.cache[moved.idx] = 2800
    new = moved.script.turns[moved.turn].new_tokens
    sim._submit_turn(moved)
    ev = sim.events[-1]
    assert ev.type == EventType.TURN_SUBMIT and sim.workers[moved.decode_home] is not crowded
    assert ev.uncached_tokens == new
    assert ev.held_tokens == 2800 and ev.prompt_tokens - ev.held_tokens == new


def test_a_colocated_cluster_is_a_decode_pool_without_a_prefill_pool() -> None:
    """Mixed workers are placed by the router's rules like decode workers, and with no prefill
    pool every decode worker prefills its own turns: the same cluster, the same run."""
    colocated = _sim("swe", "colocated", gpus=4, n=64).run()
    decode_only = _sim("swe", "static", gpus=4, n=64)
    decode_only.policy.settings = replace(decode_only.settings, static_prefill=0)
    for w in decode_only.workers:
        w.role = Role.DECODE
    decode_only.router.invalidate()
    result = decode_only.run()
    assert result.switches == 0
    assert result.makespan_s == colocated.makespan_s
    assert result.prefill_tokens_computed == colocated.prefill_tokens_computed


def test_policies_simulated_in_parallel_give_the_results_of_one_process() -> None:
    spec = load_workload("search")
    cfg = SimConfig(gpus=4, mode="sync", seed=3, trajectories=48)
    seen: dict[int, set[str]] = {1: set(), 2: set()}
    runs = {
        jobs: compare(
            preset("h200"), spec, cfg, progress=lambda n, f, j=jobs: seen[j].add(n), jobs=jobs
        )
        for jobs in (1, 2)
    }
    one, two = runs[1], runs[2]
    assert list(two.results) == list(one.results)
    for name, r in one.results.items():
        assert (two.results[name].makespan_s, two.results[name].label) == (r.makespan_s, r.label)
    assert {p: r.makespan_s for p, r in two.static_sweep.items()} == {
        p: r.makespan_s for p, r in one.static_sweep.items()
    }
    assert seen[2] == seen[1] and "predictive" in seen[1] and "static 0P" in seen[1]
