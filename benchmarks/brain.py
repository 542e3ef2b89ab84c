"""Benchmark of the brain: policy comparison, forecast error, decision and simulation speed.

Prints figures, asserts nothing. Every ratio is against a baseline measured in the same run.

    .venv/bin/python benchmarks/brain.py            # everything (~35 min on 2 cores)
    .venv/bin/python benchmarks/brain.py --only table --workloads swe --modes sync
    .venv/bin/python benchmarks/brain.py --only moe     # DeepSeek-V3, 128 H200, EP units
    .venv/bin/python benchmarks/brain.py --only moe --moe-gpus 256 --prefix-pull off --seeds 1
    .venv/bin/python benchmarks/brain.py --only learn --preset h200-deepseek-v3 --gpus 128
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from prorsa.policy.allocate import (
    Allocation,
    AllocationSettings,
    ClusterView,
    Role,
    StaticPolicy,
    WorkerView,
    make_policy,
)
from prorsa.policy.events import Event, EventType
from prorsa.policy.forecast import Forecast, Horizon
from prorsa.policy.lifecycle import LifecycleTable
from prorsa.policy.lifecycle_forecast import LifecycleForecaster
from prorsa.sim.compare import compare, run_policy, score
from prorsa.sim.config import SimConfig, SimResult
from prorsa.sim.costmodel import Cost, CostModel, ScaledCost
from prorsa.sim.engine import Simulator
from prorsa.sim.lockstep import LockstepCost
from prorsa.sim.presets import STAGES, preset, role_preset
from prorsa.sim.roles import RoleCosts
from prorsa.sim.workload import BUILTIN, WorkloadSpec, generate, load_workload

# The expert-parallel regime's settings: a switch restarts engines (~300 s), so the horizon
# covers three of them; predictive and reactive start with one prefill slot instead of none.
EP_SETTINGS = replace(AllocationSettings(), horizon_s=900.0, interval_s=15.0, initial_prefill=1)


def table(
    workloads: list[str],
    modes: list[str],
    gpus: int,
    preset_name: str,
    prefix_pull: bool = False,
    settings: AllocationSettings | None = None,
    jobs: int = 1,
) -> None:
    cost = role_preset(preset_name)
    what_if = " · what-if: prefix pull" if prefix_pull else ""
    print(f"## policies · {gpus} GPUs · {preset_name} · seed 0{what_if}")
    print(
        "| workload | mode | colocated | best static | reactive | predictive | oracle |"
        " predictive vs colocated | vs best static | vs reactive | of oracle |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mapes: dict[str, dict[str, dict[str, float]]] = {}
    for wl in workloads:
        spec = load_workload(wl)
        for mode in modes:
            t0 = time.perf_counter()
            cfg = SimConfig(gpus=gpus, mode=mode, seed=0, prefix_pull=prefix_pull)  # type: ignore[arg-type]
            if settings is not None:
                cfg = replace(cfg, settings=settings)
            c = compare(cost, spec, cfg, jobs=jobs)
            r = c.results

            def fmt(name: str, r: dict[str, SimResult] = r, mode: str = mode) -> str:
                x = r[name]
                if mode == "sync":
                    return f"{x.makespan_s:.0f} s"
                return f"{x.throughput_traj_per_min:.1f}/min"

            pred = score(r["predictive"])
            print(
                f"| {wl} | {mode} | {fmt('colocated')}"
                f" | {fmt('static')} ({r['static'].label.split()[1]})"
                f" | {fmt('reactive')} | {fmt('predictive')} | {fmt('oracle')}"
                f" | {score(r['colocated']) / pred:.3f}x | {score(r['static']) / pred:.3f}x"
                f" | {score(r['reactive']) / pred:.3f}x | {score(r['oracle']) / pred:.3f}"
                f" |  <!-- {time.perf_counter() - t0:.0f} s -->",
                flush=True,
            )
            if mode == "sync":
                mapes[wl] = r["predictive"].forecast_mape
    if mapes:
        horizon = (settings or AllocationSettings()).horizon_s
        print(f"\n## forecast error (weighted MAPE over a {horizon:.0f} s horizon, sync runs)")
        print(
            "| workload | last prefill | ewma prefill | lifecycle prefill |"
            " last decode | ewma decode | lifecycle decode |"
        )
        print("|---|---|---|---|---|---|---|")
        for wl, m in mapes.items():
            cells = [
                "n/a" if math.isnan(x := m[f][k]) else f"{x:.1f}%"
                for k in ("prefill", "decode")
                for f in ("last", "ewma", "lifecycle")
            ]
            print(f"| {wl} | " + " | ".join(cells) + " |")


class _RouterStream:
    """Events like the router's: in-flight trajectories cycling through their turns."""

    def __init__(self, n_traj: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.n = n_traj
        self.phase = [self.rng.randrange(5) for _ in range(n_traj)]
        self.ts = 0.0

    def take(self, n_events: int, t0: float) -> list[Event]:
        rng = self.rng
        out: list[Event] = []
        self.ts = max(self.ts, t0)
        while len(out) < n_events:
            i = rng.randrange(self.n)
            tid = f"t{i}"
            self.ts += 0.0005
            ts = self.ts
            p = self.phase[i] % 5
            if p == 0:
                out.append(
                    Event(EventType.TURN_SUBMIT, tid, ts, prompt_tokens=8000, uncached_tokens=700)
                )
            elif p == 1:
                out.append(
                    Event(EventType.PREFILL_DONE, tid, ts, worker="w1", tokens=700, seconds=0.05)
                )
            elif p == 2:
                out.append(
                    Event(
                        EventType.DECODE_DONE,
                        tid,
                        ts,
                        worker="w2",
                        output_tokens=rng.randint(20, 2000),
                        seconds=rng.uniform(0.5, 20),
                    )
                )
            elif p == 3:
                out.append(Event(EventType.TOOL_START, tid, ts))
            else:
                out.append(Event(EventType.TOOL_END, tid, ts))
            self.phase[i] += 1
        return out


def decision_timing(reps: int = 15) -> None:
    """One predictive decision: ingest 10,000 events, forecast, allocate (256 workers)."""
    tab = LifecycleTable()
    n = 10_000
    for i in range(n):
        tab.apply(Event(EventType.TRAJ_START, f"t{i}", 0.0, group=f"g{i // 8}"))
    stream = _RouterStream(n)
    tab.ingest(stream.take(40_000, 0.0))  # warm the statistics
    fc = LifecycleForecaster("sync")
    cost = preset("h200")
    pol = make_policy(AllocationSettings(cooldown_s=0), cost.role_capacity())
    workers = tuple(
        WorkerView(f"w{i}", Role.PREFILL if i < 32 else Role.DECODE, inflight_decode=30)
        for i in range(256)
    )
    view = ClusterView(workers)
    horizon = Horizon(5.0, 12)
    t = 100.0
    ingest_ms, forecast_ms, decide_ms, total_ms, bare_ms = [], [], [], [], []
    for _ in range(reps):
        batch = stream.take(10_000, t)
        t = batch[-1].ts
        bare_ms.append(_bare_pass_ms(batch, tab))
        a = time.perf_counter()
        tab.ingest(batch)
        b = time.perf_counter()
        f = fc.forecast(tab, t, horizon)
        c = time.perf_counter()
        pol.decide(view, f, t)
        d = time.perf_counter()
        ingest_ms.append((b - a) * 1e3)
        forecast_ms.append((c - b) * 1e3)
        decide_ms.append((d - c) * 1e3)
        total_ms.append((d - a) * 1e3)
    print(
        f"\n## one predictive decision ({tab.in_flight} trajectories in flight, 10,000 new events,"
        f" 256 workers), median of {reps}"
    )
    print(
        f"ingest {statistics.median(ingest_ms):.1f} ms"
        f" · forecast {statistics.median(forecast_ms):.1f} ms"
        f" · allocate {statistics.median(decide_ms):.1f} ms"
        f" · total {statistics.median(total_ms):.1f} ms"
        f" (p90 {sorted(total_ms)[int(0.9 * reps)]:.1f} ms)"
    )
    bare = statistics.median(bare_ms)
    print(
        f"baseline, same run: a bare Python pass that looks up each event's trajectory takes"
        f" {bare:.1f} ms; the decision is {statistics.median(total_ms) / bare:.1f}x that"
    )


def _bare_pass_ms(events: list[Event], tab: LifecycleTable) -> float:
    """The floor of any Python consumer of the batch: read each event, find its row."""
    rows = tab.rows
    a = time.perf_counter()
    for ev in events:
        rows.get(ev.traj)
        _ = ev.ts, ev.type
    return (time.perf_counter() - a) * 1e3


def big_sim(workload: str = "swe") -> None:
    cost = preset("h200")
    spec = load_workload(workload)
    t0 = time.perf_counter()
    r = run_policy(cost, spec, SimConfig(gpus=256, trajectories=8192, seed=0), "predictive")
    wall = time.perf_counter() - t0
    print(f"\n## 256 GPUs, 8,192 {workload} trajectories, one sync step, predictive policy")
    print(
        f"simulated makespan {r.makespan_s:.0f} s, {r.turns} turns, {r.decisions} decisions:"
        f" {wall:.1f} s wall"
    )


@dataclass
class _TwoPhaseSplit(StaticPolicy):
    """P1 prefill workers until `switch_at`, then P2: a schedule chosen in hindsight."""

    p1: int = 1
    p2: int = 1
    switch_at: float = 0.0

    def initial_roles(self, n: int) -> list[Role]:
        return [Role.PREFILL] * self.p1 + [Role.DECODE] * (n - self.p1)

    def target(
        self, view: ClusterView, forecast: Forecast | None, now: float
    ) -> tuple[Allocation, str]:
        p = self.p1 if now < self.switch_at else self.p2
        return Allocation(p, len(view.workers) - p), f"two-phase {self.p1}->{self.p2}"


def headroom(workload: str = "shift", gpus: int = 32) -> None:
    """How much any allocation schedule could gain over the best static split: every
    two-phase schedule (P1 prefill workers, then P2 from a switch time on) of a grid, in sync
    mode, against the static splits, on the same seeded batch."""
    cost = preset("h200")
    spec = load_workload(workload)
    base = SimConfig(gpus=gpus, mode="sync", seed=0)
    settings = replace(
        base.settings, policy="static", cooldown_s=0.0, max_switches_per_decision=gpus
    )
    cfg = replace(base, settings=settings, per_gpu=spec.trajectories_per_gpu).resolved()
    scripts = generate(spec, cfg.trajectories, cfg.seed)

    def makespan(p1: int, p2: int, switch_at: float) -> float:
        pol = _TwoPhaseSplit(cfg.settings, cost.role_capacity(), p1=p1, p2=p2, switch_at=switch_at)
        r = Simulator(cost, scripts, cfg, pol).run()
        assert r.makespan_s is not None
        return r.makespan_s

    splits = [0, 1, 2, 4, 8, 16]
    static = {p: makespan(p, p, 0.0) for p in splits}
    best_p = min(static, key=lambda p: static[p])
    best = static[best_p]
    print(f"\n## headroom over the best static split · {workload} · sync · {gpus} GPUs")
    print("static: " + " · ".join(f"{p}P {m:.0f} s" for p, m in static.items()))
    schedules = {}
    for frac in (0.1, 0.25, 0.5, 0.75):
        for p1 in splits:
            for p2 in splits:
                if p1 != p2:
                    t = frac * best
                    schedules[(p1, p2, t)] = makespan(p1, p2, t)
    (p1, p2, t), m = min(schedules.items(), key=lambda kv: kv[1])
    print(
        f"best of {len(schedules)} two-phase schedules: {p1}P until {t:.0f} s, then {p2}P:"
        f" {m:.0f} s = {best / m:.3f}x the best static ({best_p}P, {best:.0f} s)"
    )


def _cases(workloads: list[str], modes: list[str]) -> Iterator[tuple[str, WorkloadSpec, str]]:
    for wl in workloads:
        spec = load_workload(wl)
        for mode in modes:
            yield wl, spec, mode


def _score_of(cost: Cost | RoleCosts, spec: WorkloadSpec, cfg: SimConfig, policy: str) -> float:
    return score(run_policy(cost, spec, cfg, policy))


def _scores(
    runs: Sequence[tuple[Cost | RoleCosts, WorkloadSpec, SimConfig, str]], jobs: int
) -> list[float]:
    """Independent seeded runs, in `jobs` processes."""
    if jobs <= 1:
        return [_score_of(*r) for r in runs]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_score_of, *zip(*runs, strict=True)))


def seed_spread(
    workloads: list[str],
    modes: list[str],
    gpus: int,
    preset_name: str,
    seeds: int,
    settings: AllocationSettings | None = None,
    jobs: int = 1,
) -> None:
    """How much of a ratio is the seed: predictive and reactive vs colocated over seeds."""
    cost = role_preset(preset_name)
    policies = ("colocated", "predictive", "reactive")
    print(f"## seed spread · {gpus} GPUs · {preset_name} · seeds 0-{seeds - 1}")
    print("| workload | mode | predictive vs colocated | reactive vs colocated |")
    print("|---|---|---|---|")
    for wl, spec, mode in _cases(workloads, modes):
        cfg = SimConfig(gpus=gpus, mode=mode, settings=settings or AllocationSettings())  # type: ignore[arg-type]
        runs = [(cost, spec, replace(cfg, seed=k), p) for k in range(seeds) for p in policies]
        got = iter(_scores(runs, jobs))
        ratios: dict[str, list[float]] = {"predictive": [], "reactive": []}
        for _ in range(seeds):
            by = dict(zip(policies, (next(got) for _ in policies), strict=True))
            for name, out in ratios.items():
                out.append(by["colocated"] / by[name])

        def span(xs: list[float]) -> str:
            return f"{min(xs):.3f}-{max(xs):.3f}x (median {statistics.median(xs):.3f})"

        print(f"| {wl} | {mode} | {span(ratios['predictive'])} | {span(ratios['reactive'])} |")


def _nudged(cost: RoleCosts, k: int) -> RoleCosts:
    """The colocated engine with its fixed per-step overhead nudged by k parts per million."""
    c = cost.colocated
    if isinstance(c, LockstepCost):
        ep = replace(c.ep, graph_step_s=c.ep.graph_step_s * (1 + 1e-6 * k))
        return replace(cost, colocated=replace(c, ep=ep))
    assert isinstance(c, CostModel)
    eff = replace(c.eff, step_overhead_s=c.eff.step_overhead_s * (1 + 1e-6 * k))
    return RoleCosts.single(replace(c, eff=eff))


def noise_floor(
    workloads: list[str],
    modes: list[str],
    gpus: int,
    preset_name: str,
    runs: int,
    settings: AllocationSettings | None = None,
    jobs: int = 1,
) -> None:
    """How chaotic the rollout is: the same colocated run with the engine's fixed per-step
    overhead nudged by one part per million. Ratios between policies closer than this spread
    are not differences of policy."""
    base = role_preset(preset_name)
    print(f"## noise floor · colocated · {gpus} GPUs · {preset_name} · seed 0 · {runs} runs")
    print("| workload | mode | spread (max/min) | runs |")
    print("|---|---|---|---|")
    for wl, spec, mode in _cases(workloads, modes):
        cfg = SimConfig(gpus=gpus, mode=mode, seed=0, settings=settings or AllocationSettings())  # type: ignore[arg-type]
        scores = _scores([(_nudged(base, k), spec, cfg, "colocated") for k in range(runs)], jobs)
        spread = max(scores) / min(scores)
        shown = ", ".join(f"{s:.0f} s" if mode == "sync" else f"{1 / s:.1f}/min" for s in scores)
        print(f"| {wl} | {mode} | {spread:.3f}x | {shown} |")


def learn(workloads: list[str], modes: list[str], gpus: int, preset_name: str, jobs: int,
          prefill_speed: float = 0.5, decode_slowdown: float = 1.5,
          settings: AllocationSettings | None = None) -> None:  # fmt: skip
    """The capacity learned online (`policy/learn.py`): the cluster is `prefill_speed` times
    as fast at prefill and `decode_slowdown` times as slow per decode step as the preset the
    allocator starts from. Predictive given the true capacity, given only the preset, and
    given the preset plus what its workers report."""
    base = role_preset(preset_name)
    true = RoleCosts(*(ScaledCost(c, prefill_speed, decode_slowdown)
                       for c in (base.prefill, base.decode, base.colocated)))  # fmt: skip
    prior = base.laid_out(False).role_capacity(False)
    print(f"## capacity learned online · {gpus} GPUs · {preset_name} x (prefill {prefill_speed}x,"
          f" decode step {decode_slowdown}x) · seed 0")  # fmt: skip
    print("| workload | mode | true capacity | preset only | learned | preset / true |"
          " learned / true |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for wl, spec, mode in _cases(workloads, modes):
        cfg = SimConfig(gpus=gpus, mode=mode, seed=0,  # type: ignore[arg-type]
                        settings=settings or AllocationSettings())  # fmt: skip
        runs = [(true, spec, c, "predictive") for c in (
            cfg, replace(cfg, capacity_prior=prior),
            replace(cfg, capacity_prior=prior, learn_capacity=True))]  # fmt: skip
        t, p, lrn = _scores(runs, jobs)

        def shown(x: float, mode: str = mode) -> str:
            return f"{x:.0f} s" if mode == "sync" else f"{1 / x:.1f}/min"

        print(f"| {wl} | {mode} | {shown(t)} | {shown(p)} | {shown(lrn)} | {t / p:.3f} |"
              f" {t / lrn:.3f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--only",
        choices=["table", "moe", "seeds", "noise", "decision", "bigsim", "headroom", "learn"],
        default=None,
    )
    ap.add_argument("--workloads", default=",".join(BUILTIN))
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--preset", default="h200")
    ap.add_argument(
        "--seeds", type=int, default=4, help="seeds (--only seeds) or nudged runs (--only noise)"
    )
    ap.add_argument("--prefix-pull", choices=["on", "off"], default=None,
                    help="--only moe: one of the two tables (default: both)")  # fmt: skip
    ap.add_argument("--moe-gpus", default="128", help="--only moe: comma-separated GPU counts")
    ap.add_argument("--prefill-speed", type=float, default=0.5,
                    help="--only learn: true prefill speed / the preset's")  # fmt: skip
    ap.add_argument("--decode-slowdown", type=float, default=1.5,
                    help="--only learn: true decode step / the preset's")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="simulations in parallel processes (default: one per CPU)")  # fmt: skip
    a = ap.parse_args()
    if a.only in (None, "table"):
        table(a.workloads.split(","), a.modes.split(","), a.gpus, a.preset, jobs=a.jobs)
    if a.only in (None, "moe"):
        # The expert-parallel regime: DeepSeek-V3 on H200, prefill EP8 / decode EP32 engines
        # (colocated: EP32), with and without the prefix-pull what-if. A switch restarts the
        # engines (~300 s), so the horizon covers three of them. Predictive and reactive
        # start with one prefill slot instead of none: every switch costs an engine restart.
        ep = EP_SETTINGS
        wls, modes = a.workloads.split(","), a.modes.split(",")
        for gpus in (int(g) for g in a.moe_gpus.split(",")):
            for pull in (False, True) if a.prefix_pull is None else (a.prefix_pull == "on",):
                table(wls, modes, gpus, "h200-deepseek-v3", pull, ep, a.jobs)
        if a.seeds > 1:  # at the first GPU count
            gpus = int(a.moe_gpus.split(",")[0])
            seed_spread(wls, modes, gpus, "h200-deepseek-v3", a.seeds, ep, a.jobs)
            noise_floor(wls, modes, gpus, "h200-deepseek-v3", a.seeds, ep, a.jobs)
    dense = (a.workloads.split(","), a.modes.split(","), a.gpus, a.preset, a.seeds)
    if a.only in (None, "seeds"):
        seed_spread(*dense, jobs=a.jobs)
    if a.only in (None, "noise"):
        noise_floor(*dense, jobs=a.jobs)
    if a.only in (None, "decision"):
        decision_timing()
    if a.only in (None, "bigsim"):
        big_sim()
    if a.only in (None, "headroom"):
        headroom()
    if a.only in (None, "learn"):
        staged = a.preset in STAGES  # expert-parallel engines: the settings of --only moe
        learn(a.workloads.split(","), a.modes.split(","), a.gpus, a.preset, a.jobs,
              a.prefill_speed, a.decode_slowdown, EP_SETTINGS if staged else None)  # fmt: skip


if __name__ == "__main__":
    main()
