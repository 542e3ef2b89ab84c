"""A small OpenAI-protocol client for the end-to-end tests (aiohttp; token ids requested)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MODEL = "tiny"


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
