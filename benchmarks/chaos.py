"""Chaos soak of the real system on this machine: a rollout under the predictive policy while
a seeded script kills a worker's engine, restarts the controller, stops Redis for 10 s and
restarts the router at random moments.

    .venv/bin/python benchmarks/chaos.py [--minutes 10] [--seed 0] [--json F]

Real parts throughout: Redis (append-only, so a restart keeps the stream), two vLLM CPU
workers with NIXL KV transfer under `prorsa worker`, the router and `prorsa controller` as
processes. The agent loops retry a turn the endpoint did not answer (as a client behind a
restarting Service would) and count those retries. At the end it prints turns sent, completed
and failed, trajectories lost, lifecycle events lost or duplicated (each completed turn must
appear exactly once as `decode_done` on the stream), and switches done or rolled back.
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis

from prorsa.events.keys import ClusterKeys
from prorsa.events.schema import decode
from prorsa.local.driver import DriveResult, Scale, drive, scale_scripts
from prorsa.local.model import make_tiny_model
from prorsa.local.processes import Child, free_port
from prorsa.local.redis_server import RedisServer
from prorsa.local.registry import Registry
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import Role
from prorsa.policy.events import EventType
from prorsa.sim.workload import generate, load_workload

KEYS = ClusterKeys("chaos", "soak")


@dataclass
class Soak:
    stack: LocalStack
    redis: RedisServer
    workdir: Path
    controller: Child | None = None
    controller_port: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    switches: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.1f}s  {what}"
        self.log.append(line)
        print(line, flush=True)

    # ---- the processes ---------------------------------------------------------------------

    def start_controller(self) -> None:
        self.controller_port = self.controller_port or free_port()
        argv = [
            sys.executable, "-m", "prorsa.cli", "controller", "--redis-url", self.redis.url,
            "--cluster", f"{KEYS.namespace}/{KEYS.name}", "--policy", "predictive",
            "--interval", "2", "--horizon", "20", "--cooldown", "4", "--min-evidence", "20",
            "--drain-timeout", "30", "--metrics-port", str(self.controller_port),
        ]  # fmt: skip
        self.controller = Child("controller", argv, self.workdir / "controller.log").start()

    def count_switches(self) -> None:
        """Add the running controller's switch counters (they restart with it)."""
        try:
            url = f"http://127.0.0.1:{self.controller_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return
        for line in text.splitlines():
            if line.startswith("prorsa_switches_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                self.switches[outcome] += float(line.rsplit(" ", 1)[1])

    # ---- the faults ------------------------------------------------------------------------

    async def kill_worker(self, rng: random.Random) -> None:
        async with Redis.from_url(self.redis.url, socket_timeout=5) as r:
            records = [w for w in await Registry(r, KEYS).list() if w.pid > 0 and w.ready]
        if not records:
            self.note("kill worker: none ready, skipped")
            return
        victim = rng.choice(records)
        try:
            os.killpg(victim.pid, signal.SIGKILL)
            self.note(f"killed the engine of {victim.name} ({victim.role.value})")
        except ProcessLookupError:
            self.note(f"kill worker: {victim.name} already gone")

    async def restart_controller(self, rng: random.Random) -> None:
        assert self.controller is not None
        self.count_switches()
        self.controller.signal(signal.SIGKILL)
        self.note("killed the controller (SIGKILL)")
        await asyncio.sleep(rng.uniform(1, 5))
        self.start_controller()
        self.note("controller started again")

    async def stop_redis(self, rng: random.Random) -> None:
        self.redis.stop()
        self.note("stopped Redis for 10 s")
        await asyncio.sleep(10)
        self.redis.child.start()
        self.redis.child.wait_until(self.redis._answers, 30, "PONG")
        self.note("Redis back")

    async def restart_router(self, rng: random.Random) -> None:
        assert self.stack.router is not None
        self.stack.router.stop(10)
        self.note("stopped the router")
        await asyncio.sleep(rng.uniform(0.5, 3))
        self.stack.start_router()
        self.note("router started again (same port)")

    async def chaos(self, until: float, seed: int) -> None:
        rng = random.Random(seed)
        faults = [self.kill_worker, self.restart_controller, self.stop_redis, self.restart_router]
        while True:
            wait = rng.uniform(20, 60)
            if time.monotonic() + wait >= until:
                return
            await asyncio.sleep(wait)
            fault = rng.choice(faults)
            self.actions[fault.__name__] += 1
            await fault(rng)


async def rollouts(router_url: str, until: float, seed: int) -> tuple[DriveResult, int]:
    """Rollouts back to back until `until`; each a fresh seeded batch of the shift workload."""
    total = DriveResult()
    spec = load_workload("shift")
    batch = 0
    scale = Scale(max_turns=6, max_output_tokens=32)
    while time.monotonic() < until:
        scripts = scale_scripts(generate(spec, 12, seed + batch), scale)
        r = await drive(router_url, scripts, model=SERVED_MODEL, seed=seed + batch,
                        concurrency=8, prefix=f"b{batch}-", retry_s=120.0)  # fmt: skip
        total.turns_ok += r.turns_ok
        total.turns_failed += r.turns_failed
        total.retries += r.retries
        total.errors += r.errors
        total.completion_s += r.completion_s
        total.turns_by_trajectory.update(r.turns_by_trajectory)
        batch += 1
    return total, batch * 12


async def events_vs_turns(redis_url: str, turns: dict[str, int]) -> tuple[int, int, int]:
    """(lost, duplicated, malformed): decode_done events per trajectory vs completed turns."""
    async with Redis.from_url(redis_url, socket_timeout=30) as r:
        entries = await r.xrange(KEYS.events)
    seen: Counter[str] = Counter()
    malformed = 0
    for _, fields in entries:
        try:
            ev = decode(fields)
        except Exception:
            malformed += 1
            continue
        if ev.type is EventType.DECODE_DONE:
            seen[ev.traj] += 1
    lost = sum(max(0, n - seen[t]) for t, n in turns.items())
    dup = sum(max(0, seen[t] - turns.get(t, 0)) for t in seen)
    return lost, dup, malformed


async def main_async(minutes: float, seed: int, workdir: Path) -> dict[str, object]:
    workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(workdir / "tiny-llama")
    with RedisServer(workdir / "redis", persist=True) as redis:
        cfg = StackConfig(model=model, workdir=workdir / "stack", redis_url=redis.url,
                          roles=[Role.PREFILL, Role.DECODE], keys=KEYS)  # fmt: skip
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        with LocalStack(cfg) as stack:
            soak = Soak(stack, redis, workdir)
            soak.start_controller()
            soak.note(f"cluster ready; soaking for {minutes:g} min")
            until = time.monotonic() + minutes * 60
            chaos = asyncio.create_task(soak.chaos(until, seed))
            result, trajectories = await rollouts(stack.router_url, until, seed)
            await chaos
            await asyncio.sleep(5)  # the router's buffered events reach Redis
            lost, dup, malformed = await events_vs_turns(redis.url, result.turns_by_trajectory)
            out: dict[str, object] = {
                "minutes": minutes,
                "faults": dict(soak.actions),
                "turns_sent": result.turns_ok + result.turns_failed,
                "turns_completed": result.turns_ok,
                "turns_failed": result.turns_failed,
                "client_retries": result.retries,
                "trajectories_started": trajectories,
                "trajectories_completed": len(result.completion_s),
                "trajectories_lost": trajectories - len(result.completion_s),
                "events_lost": lost,
                "events_duplicated": dup,
                "events_malformed": malformed,
                "errors": result.errors[:5],
                "log": soak.log,
            }
            soak.count_switches()
            out["switches_done"] = soak.switches["done"]
            out["switches_rolled_back"] = soak.switches["rolled_back"]
            if soak.controller is not None:
                soak.controller.stop(10)
            return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path(".prorsa/chaos"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = asyncio.run(main_async(a.minutes, a.seed, a.workdir))
    print()
    for k, v in out.items():
        if k != "log":
            print(f"{k:24s} {v}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
