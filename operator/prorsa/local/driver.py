"""Drive an agentic rollout through the router for real: the simulator's seeded workload,
scaled to what CPU workers serve in minutes.

Every turn is a token-id completion whose prompt is the trajectory's context plus the turn's
new tokens (first prompt or tool output); the answer's tokens are appended, the tool "runs"
(a real sleep, announced with the router's tool hints) and the next turn follows.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from prorsa.sim.workload import TrajectoryScript, Turn

VOCAB = 400  # token ids the tiny model's tokenizer knows


@dataclass(frozen=True)
class Scale:
    """From GPU-sized scripts to CPU-sized ones (same shape, same seed)."""

    tokens: float = 1 / 32
    time: float = 0.05
    max_turns: int = 8
    max_prompt_tokens: int = 1500
    max_output_tokens: int = 48


def scale_scripts(scripts: list[TrajectoryScript], s: Scale) -> list[TrajectoryScript]:
    out = []
    for tr in scripts:
        turns: list[Turn] = []
        context = 0
        for t in tr.turns[: s.max_turns]:
            new = max(4, round(t.new_tokens * s.tokens))
            output = min(s.max_output_tokens, max(1, round(t.output_tokens * s.tokens)))
            if turns and context + new + output > s.max_prompt_tokens:
                break
            turns.append(Turn(new, output, t.tool_s * s.time))
            context += new + output
        last = turns[-1]
        turns[-1] = Turn(last.new_tokens, last.output_tokens, 0.0)
        out.append(TrajectoryScript(tr.id, tr.group, tuple(turns)))
    return out


@dataclass(frozen=True)
class TurnRecord:
    """One turn as the agent loop saw it (times from the start of the rollout)."""

    trajectory: str
    turn: int
    start_s: float
    seconds: float  # submission to the whole answer (prefill, KV transfer, decode)
    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    ok: bool


@dataclass
class DriveResult:
    makespan_s: float = 0.0
    turns_ok: int = 0
    turns_failed: int = 0
    completion_s: list[float] = field(default_factory=list)  # per finished trajectory
    errors: list[str] = field(default_factory=list)
    retries: int = 0  # turns sent again because the router could not be reached
    turns_by_trajectory: dict[str, int] = field(default_factory=dict)  # completed turns
    turns: list[TurnRecord] = field(default_factory=list)


@dataclass
class Progress:
    total_turns: int
    total_trajectories: int
    turns_done: int = 0
    trajectories_done: int = 0
    failed: int = 0


async def drive(
    router_url: str,
    scripts: list[TrajectoryScript],
    *,
    model: str,
    seed: int = 0,
    concurrency: int = 0,
    on_progress: Callable[[Progress], None] | None = None,
    prefix: str = "",
    retry_s: float = 0.0,
) -> DriveResult:
    """Run every script; `concurrency` 0 starts them all at once (sync rollout).

    `retry_s` > 0: a turn the router did not answer at all (connection refused or dropped,
    503 while it has no worker) is sent again for up to that long, as an agent loop behind a
    restarting endpoint would; a refusal of the request itself is never retried."""
    result = DriveResult()
    prog = Progress(sum(len(s.turns) for s in scripts), len(scripts))
    gate = asyncio.Semaphore(concurrency or len(scripts))
    t0 = time.monotonic()

    def record(traj: str, i: int, sent: float, prompt: int, new: int, answer: int | None) -> None:
        """`answer`: the tokens answered, None when the turn failed."""
        end = time.monotonic()
        result.turns.append(TurnRecord(traj, i, sent - t0, end - sent, prompt, new, answer or 0,
                                       answer is not None))  # fmt: skip

    async def one(s: aiohttp.ClientSession, script: TrajectoryScript) -> None:
        async with gate:
            rng = random.Random(f"{seed}-{script.id}")
            traj = f"{prefix}{script.id}"
            context: list[int] = []
            started = time.monotonic()
            hints = f"{router_url}/prorsa/v1/trajectories/{traj}"
            for i, turn in enumerate(script.turns):
                context = context + [rng.randrange(3, VOCAB) for _ in range(turn.new_tokens)]
                body = {
                    "model": model,
                    "prompt": context,
                    "max_tokens": turn.output_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                sent = time.monotonic()
                deadline = sent + retry_s
                try:
                    while True:
                        try:
                            data = await _complete(s, router_url, body, traj)
                            break
                        except _Unreachable:
                            if time.monotonic() >= deadline:
                                raise
                            result.retries += 1
                            await asyncio.sleep(0.5)
                    answer = list(data["choices"][0]["token_ids"] or [])
                except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError) as e:
                    record(traj, i, sent, len(context), turn.new_tokens, None)
                    result.turns_failed += 1
                    prog.failed += 1
                    result.errors.append(f"{traj} turn {i}: {e}"[:300])
                    break
                record(traj, i, sent, len(context), turn.new_tokens, len(answer))
                context = context + answer
                result.turns_ok += 1
                result.turns_by_trajectory[traj] = result.turns_by_trajectory.get(traj, 0) + 1
                prog.turns_done += 1
                if on_progress:
                    on_progress(prog)
                if turn.tool_s > 0:
                    await _hint(s, f"{hints}/tool_start", {"expected_seconds": turn.tool_s})
                    await asyncio.sleep(turn.tool_s)
                    await _hint(s, f"{hints}/tool_end")
            await _hint(s, f"{hints}/end", {"reason": "done"})
            result.completion_s.append(time.monotonic() - started)
            prog.trajectories_done += 1
            if on_progress:
                on_progress(prog)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await asyncio.gather(*(one(s, sc) for sc in scripts))
    result.makespan_s = time.monotonic() - t0
    return result


class _Unreachable(RuntimeError):
    """The router gave no answer to the request itself (down, restarting, or no worker)."""


async def _complete(
    s: aiohttp.ClientSession, router_url: str, body: dict[str, object], traj: str
) -> dict[str, Any]:
    try:
        async with s.post(f"{router_url}/v1/completions", json=body,
                          headers={"X-Prorsa-Trajectory": traj}) as r:  # fmt: skip
            data = await r.json(content_type=None)
            if r.status == 503:
                raise _Unreachable(f"HTTP 503: {data}")
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data}")
            return data  # type: ignore[no-any-return]
    except aiohttp.ClientConnectionError as e:  # refused, reset, or dropped mid-answer
        raise _Unreachable(f"{type(e).__name__}: {e}") from e


async def _hint(s: aiohttp.ClientSession, url: str, body: dict[str, object] | None = None) -> None:
    """Tool and end hints are best effort: a router that is away misses one, nothing fails."""
    try:
        async with s.post(url, json=body) as r:
            await r.read()
    except (aiohttp.ClientError, TimeoutError):
        pass
