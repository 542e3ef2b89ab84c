"""A small OpenAI-protocol client for the end-to-end tests (aiohttp; token ids requested),
and an agent-like rollout that keeps it busy."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MODEL = "tiny"
VOCAB = 400  # token ids below the tiny tokenizer's vocabulary size
TIMEOUT = aiohttp.ClientTimeout(total=300)


@dataclass
class Completion:
    status: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: Any = None


async def complete(
    session: aiohttp.ClientSession,
    base: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    traj: str | None = None,
    stream: bool = False,
    stream_usage: bool = True,
) -> Completion:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream and stream_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"X-Prorsa-Trajectory": traj} if traj else {}
    async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
        if not stream or r.status != 200:
            data = await r.json(content_type=None)
            if r.status != 200:
                return Completion(r.status, error=data)
            choice = data["choices"][0]
            return Completion(200, choice["token_ids"], choice["finish_reason"], data["usage"])
        out = Completion(200)
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            for c in chunk.get("choices") or ():
                out.token_ids += c.get("token_ids") or []
                out.finish_reason = c.get("finish_reason") or out.finish_reason
            if chunk.get("usage"):
                out.usage = chunk["usage"]
        return out


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    """Sum of every sample of one metric on a /metrics page."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


class Rollout:
    """Concurrent multi-turn trajectories: each turn appends the answer and an observation."""

    def __init__(self, base: str, trajectories: int, seed: int = 1) -> None:
        self.base = base
        self.n = trajectories
        self.rng = random.Random(seed)
        self.turns: dict[str, list[Completion]] = defaultdict(list)
        self.failures: list[tuple[str, Any]] = []
        self.stop = asyncio.Event()

    async def trajectory(self, s: aiohttp.ClientSession, slot: int) -> None:
        gen = 0
        while not self.stop.is_set():
            traj, gen = f"sw-{slot}-{gen}", gen + 1
            context = [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randrange(20, 200))]
            for turn in range(20):
                c = await complete(s, self.base, context, 8, traj=traj, stream=slot % 5 == 4)
                self.turns[traj].append(c)
                if c.status != 200 or c.error or len(c.token_ids) != 8:
                    self.failures.append((traj, c.error or c.status))
                    break
                if self.stop.is_set():
                    break
                hint = slot % 2 == 0
                if hint:
                    await s.post(f"{self.base}/prorsa/v1/trajectories/{traj}/tool_start", json={})
                await asyncio.sleep(self.rng.uniform(0.02, 0.2))  # the tool runs
                if hint:
                    await s.post(f"{self.base}/prorsa/v1/trajectories/{traj}/tool_end")
                obs = [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randrange(5, 60))]
                context = context + c.token_ids + obs
                if turn == 19:
                    await s.post(f"{self.base}/prorsa/v1/trajectories/{traj}/end")

    @property
    def total_turns(self) -> int:
        return sum(len(v) for v in self.turns.values())
