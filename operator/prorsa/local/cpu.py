"""The CPU the rest of a local stack takes from its engines: what separates a measurement
taken during a rollout from one taken on an idle machine (the offline calibration)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

ENGINE_PROCESS = "VLLM::Worker"  # the process a CPU vLLM engine computes in (one per pinned core)


def stack_cpu_seconds() -> float:
    """CPU seconds every process on this machine but the engines' compute has used so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        if not stat[stat.index("(") + 1 :].startswith(ENGINE_PROCESS):
            utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
            total += (int(utime) + int(stime)) / tick
    return total


class StackShare:
    """The share of the machine's cores everything but the engines' compute takes (the router,
    the agent loop and controller, the vLLM frontends and schedulers, Redis), sampled while a
    rollout runs: CPU time the engines, pinned one per core, do not get. On a GPU node that
    work runs on host cores beside the accelerators; here it runs on the engines' own."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), stack_cpu_seconds()))
            await asyncio.sleep(self.every_s)

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[StackShare]:
        """Sample while the block runs."""
        task = asyncio.create_task(self.run())
        try:
            yield self
        finally:
            task.cancel()

    def last(self, seconds: float) -> float:
        """The share over the last `seconds`."""
        end = time.monotonic()
        return self.over(end - seconds, end)

    def over(self, start: float, end: float) -> float:
        """The share over [start, end] (monotonic seconds), from the samples around it."""
        self.samples.append((time.monotonic(), stack_cpu_seconds()))
        t0, c0 = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
        t1, c1 = self.samples[-1]
        return min(max((c1 - c0) / ((os.cpu_count() or 1) * max(t1 - t0, 1e-9)), 0.0), 0.9)
