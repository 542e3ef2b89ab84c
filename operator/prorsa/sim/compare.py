"""Run one seeded workload under several policies and compare them.

`static` is reported at the best P:D split found in hindsight (a sweep over splits), which is
what a careful user would tune by hand; `oracle` is the predictive allocator fed the
simulator's ground truth.
"""

from __future__ import annotations

import json
import math
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prorsa.policy.allocate import make_policy
from prorsa.policy.placement import PlacementSettings
from prorsa.sim.config import Mode, SimConfig, SimResult, SimulationTooLong, timeline_row
from prorsa.sim.costmodel import Cost
from prorsa.sim.engine import Simulator
from prorsa.sim.oracle import oracle_forecast
from prorsa.sim.presets import preset
from prorsa.sim.roles import RoleCosts, role_costs
from prorsa.sim.workload import WorkloadSpec, generate

ALL_POLICIES = ("colocated", "static", "reactive", "predictive", "oracle")
_SWEEP_CUTOFF = 3.0  # sync sweep: stop a static split at this multiple of the best makespan

Progress = Callable[[str, float], None]


def batch_per_gpu(spec: WorkloadSpec, cost: Cost | RoleCosts) -> int:
    """Trajectories per GPU for `spec` on `cost`. A workload states its typical batch per GPU
    for the reference deployment, the dense 8B model on one H200; a team sizing a rollout
    batch for a model with less KV room per GPU keeps the batch in proportion to it."""
    reference = preset("h200-dense-8b").kv_capacity_tokens
    d = role_costs(cost).decode
    room = min(1.0, d.kv_capacity_tokens / d.gpus_per_worker / reference)
    return max(1, round(spec.trajectories_per_gpu * room))


def placement_for(cost: Cost | RoleCosts, rules: PlacementSettings) -> PlacementSettings:
    """The router's rules for the cost's workers. On expert-parallel units a local prefill
    idles every rank of the decode unit for its duration, while a pool prefill that must
    recompute the context occupies one rank of a prefill unit: so any append goes to the pool
    unless the pool would compute more than G times the append (G = the unit's ranks)."""
    ranks = role_costs(cost).decode.dp_ranks
    if ranks <= 1:
        return rules
    return replace(rules, local_prefill_max_tokens=0, remote_recompute_factor=ranks)


def run_policy(
    cost: Cost | RoleCosts,
    spec: WorkloadSpec,
    config: SimConfig,
    policy: str,
    progress: Progress | None = None,
    label: str | None = None,
) -> SimResult:
    cfg = replace(
        config,
        settings=replace(config.settings, policy=policy),
        per_gpu=batch_per_gpu(spec, cost),
        placement=placement_for(cost, config.placement),
    ).resolved()
    if policy != "predictive":  # forecast errors are reported for the predictive run only
        cfg = replace(cfg, shadow_forecasters=())
    scripts = generate(spec, cfg.trajectories, cfg.seed)
    colocated = policy == "colocated"  # the policy sees workers as the simulator lays them out
    true = role_costs(cost).laid_out(colocated).role_capacity(colocated)
    pol = make_policy(cfg.settings, cfg.capacity_prior or true)
    name = label or policy
    sim = Simulator(
        cost, scripts, cfg, pol, progress=(lambda f: progress(name, f)) if progress else None
    )
    if policy == "oracle":
        sim.oracle_forecast = oracle_forecast
    result = sim.run()
    result.label = name
    return result


def static_splits(workers: int) -> list[int]:
    """Prefill-worker (engine unit) counts a user might try: none (decode workers prefill
    locally), one, two, then eighths of the cluster."""
    eighths = {min(max(1, round(workers * k / 8)), workers - 1) for k in range(1, 8)}
    return sorted({0, 1, min(2, workers - 1)} | eighths)


def score(r: SimResult) -> float:
    """Lower is better: makespan in sync mode, inverse throughput in async mode."""
    if r.mode == "sync":
        return r.makespan_s
    return 1.0 / r.throughput_traj_per_min if r.throughput_traj_per_min > 0 else float("inf")


@dataclass
class Comparison:
    workload: str
    mode: Mode
    gpus: int
    preset: str
    seed: int
    results: dict[str, SimResult]
    static_sweep: dict[int, SimResult]

    def speedup(self, policy: str, baseline: str = "colocated") -> float:
        return score(self.results[baseline]) / score(self.results[policy])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": "simulated",
            "workload": self.workload,
            "mode": self.mode,
            "gpus": self.gpus,
            "preset": self.preset,
            "seed": self.seed,
            "results": {},
        }
        for name, r in self.results.items():
            row: dict[str, Any] = {
                "throughput_traj_per_min": r.throughput_traj_per_min,
                "p50_completion_s": r.p50_completion_s,
                "p99_completion_s": r.p99_completion_s,
                "prefill_util": r.prefill_util,
                "decode_util": r.decode_util,
                "switches": r.switches,
                "trajectories": r.trajectories,
                "turns": r.turns,
                "decisions": r.decisions,
                "label": r.label,
                "ttft_p50_s": r.ttft_s[0],
                "ttft_p99_s": r.ttft_s[1],
                "itl_p50_s": r.itl_s[0],
                "itl_p99_s": r.itl_s[1],
            }
            if r.mode == "sync":
                row["makespan_s"] = r.makespan_s
            if "colocated" in self.results:
                row["speedup_vs_colocated"] = self.speedup(name)
            row["timeline"] = [timeline_row(p) for p in r.timeline]
            row["completions_s"] = [round(x, 2) for x in r.completions_s]
            if name == "predictive":
                row["forecast_mape_pct"] = {  # null: no horizon scored (a short run)
                    f: {k: None if math.isnan(v) else v for k, v in m.items()}
                    for f, m in r.forecast_mape.items()
                }
            out["results"][name] = row
        if self.static_sweep:
            out["static_sweep"] = {
                str(p): {
                    "makespan_s": r.makespan_s,
                    "throughput_traj_per_min": r.throughput_traj_per_min,
                }
                for p, r in self.static_sweep.items()
            }
        return out

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _static_sweep(
    cost: Cost | RoleCosts, spec: WorkloadSpec, cfg: SimConfig, progress: Progress | None
) -> tuple[dict[int, SimResult], SimResult]:
    """Every static split in turn (one task: the cutoff depends on the splits before it)."""
    units = cfg.workers(role_costs(cost).slot_gpus(colocated=False))
    splits = static_splits(units)
    sweep: dict[int, SimResult] = {}
    for p in splits:
        c = replace(cfg, settings=replace(cfg.settings, static_prefill=p))
        if sweep and cfg.mode == "sync":  # a split far behind the best is cut short
            bound = _SWEEP_CUTOFF * min(r.makespan_s for r in sweep.values())
            c = replace(c, max_sim_s=min(c.max_sim_s, bound))
        try:
            sweep[p] = run_policy(cost, spec, c, "static", progress, f"static {p}P")
        except SimulationTooLong:
            continue
    best_p = min(sweep, key=lambda p: score(sweep[p]))
    best = sweep[best_p]
    best.label = f"static {best_p}P:{units - best_p}D (best of {len(splits)})"
    return sweep, best


def _task(
    cost: Cost | RoleCosts,
    spec: WorkloadSpec,
    cfg: SimConfig,
    policy: str,
    progress: Progress | None,
) -> tuple[dict[int, SimResult], SimResult]:
    if policy == "static" and cfg.settings.static_prefill is None:
        return _static_sweep(cost, spec, cfg, progress)
    return {}, run_policy(cost, spec, cfg, policy, progress)


def _queue_progress(queue: Any) -> Progress:
    return lambda name, frac: queue.put((name, frac))


def _task_in_pool(
    cost: Cost | RoleCosts, spec: WorkloadSpec, cfg: SimConfig, policy: str, queue: Any
) -> tuple[dict[int, SimResult], SimResult]:
    return _task(cost, spec, cfg, policy, _queue_progress(queue) if queue is not None else None)


def compare(
    cost: Cost | RoleCosts,
    spec: WorkloadSpec,
    config: SimConfig,
    policies: Sequence[str] = ALL_POLICIES,
    preset_name: str = "",
    progress: Progress | None = None,
    jobs: int = 1,
) -> Comparison:
    """Each policy's run (the static sweep as one) is independent and seeded, so `jobs`
    processes give the same results as one, sooner."""
    cfg = replace(config, per_gpu=batch_per_gpu(spec, cost)).resolved()
    outcomes: dict[str, tuple[dict[int, SimResult], SimResult]] = {}
    if jobs <= 1 or len(policies) <= 1:
        for policy in policies:
            outcomes[policy] = _task(cost, spec, cfg, policy, progress)
    else:
        outcomes = _in_processes(cost, spec, cfg, policies, progress, jobs)
    results = {policy: outcomes[policy][1] for policy in policies}
    sweep = next((s for s, _ in outcomes.values() if s), {})
    return Comparison(spec.name, cfg.mode, cfg.gpus, preset_name, cfg.seed, results, sweep)


def _in_processes(
    cost: Cost | RoleCosts,
    spec: WorkloadSpec,
    cfg: SimConfig,
    policies: Sequence[str],
    progress: Progress | None,
    jobs: int,
) -> dict[str, tuple[dict[int, SimResult], SimResult]]:
    ctx = multiprocessing.get_context("fork")
    with ctx.Manager() as manager:
        queue = manager.Queue() if progress is not None else None
        with ProcessPoolExecutor(max_workers=min(jobs, len(policies)), mp_context=ctx) as pool:
            futures = {pool.submit(_task_in_pool, cost, spec, cfg, p, queue): p for p in policies}
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                while queue is not None and progress is not None and not queue.empty():
                    progress(*queue.get())
            return {futures[f]: f.result() for f in futures}
