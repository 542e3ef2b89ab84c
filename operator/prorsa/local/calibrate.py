"""Measure what one local worker can do, as the allocator's `RoleCapacity`.

Prefill throughput from two prompt lengths (the difference cancels fixed costs), decode step
time from one sequence generating 1 vs 33 tokens, the per-sequence cost from 8 sequences at
once, and the KV capacity from the engine's cache size and the model's shape.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from prorsa.policy.capacity import RoleCapacity, quoted_prefill_rate


@dataclass(frozen=True)
class Calibration:
    prefill_tokens_per_s: float
    prefill_fixed_s: float
    decode_step_s: float  # one sequence
    decode_s_per_seq: float  # each extra sequence in the batch
    kv_capacity_tokens: float

    def capacity(self, switch_s: float = 0.0) -> RoleCapacity:
        return RoleCapacity(
            prefill_tokens_per_s=quoted_prefill_rate(
                self.prefill_fixed_s, self.prefill_tokens_per_s
            ),
            prefill_request_s=self.prefill_fixed_s,
            decode_base_step_s=self.decode_step_s,
            decode_s_per_seq=self.decode_s_per_seq,
            decode_s_per_kv_token=0.0,
            kv_capacity_tokens=self.kv_capacity_tokens,
            switch_s=switch_s,
        )


def agreement(
    cal: Calibration,
    learned: RoleCapacity,
    tokens: float = 1024.0,
    context: float = 0.0,
    batch: float = 8.0,
    kv: float | None = None,
) -> dict[str, float]:
    """How far a capacity learned online lies from the offline calibration, relative: the
    seconds to prefill `tokens` new tokens over `context` cached ones, and a decode step of
    `batch` sequences holding `kv` KV tokens (default: the calibration's own short sequences,
    ~50 tokens each). The calibration has no context or KV term: it measured fresh prompts
    and short sequences."""
    kv = 50.0 * batch if kv is None else kv
    cal_prefill = cal.prefill_fixed_s + tokens / cal.prefill_tokens_per_s
    cal_step = cal.decode_step_s + cal.decode_s_per_seq * max(batch - 1, 0.0)
    prefill = learned.prefill_s(tokens, context)
    return {
        "prefill_s": prefill / cal_prefill - 1.0,
        "decode_step_s": learned.decode_step_s(batch, kv) / cal_step - 1.0,
    }


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    return int(2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes)


async def _timed(s: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                 max_tokens: int) -> float:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"calibration request failed: HTTP {r.status}")
    return time.perf_counter() - t0


async def calibrate(url: str, model: str, model_dir: Path, kv_cache_gib: float,
                    repeats: int = 3) -> Calibration:  # fmt: skip
    def prompt(n: int, salt: int) -> list[int]:
        return [3 + (i * 7 + salt * 13) % 390 for i in range(n)]  # distinct: no prefix hits

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await _timed(s, url, model, prompt(64, 0), 4)  # warm-up
        short, long_ = 128, 1024
        t_short = min([await _timed(s, url, model, prompt(short, i), 1) for i in range(repeats)])
        t_long = min([await _timed(s, url, model, prompt(long_, 10 + i), 1)
                      for i in range(repeats)])  # fmt: skip
        tps = (long_ - short) / max(t_long - t_short, 1e-4)
        fixed = max(t_short - short / tps, 0.0)
        one = min([await _timed(s, url, model, prompt(16, 20 + i), 1) for i in range(repeats)])
        many = min([await _timed(s, url, model, prompt(16, 30 + i), 33) for i in range(repeats)])
        step = max((many - one) / 32, 1e-4)
        batch = 8
        t0 = time.perf_counter()
        await asyncio.gather(*(_timed(s, url, model, prompt(16, 40 + i), 33) for i in range(batch)))
        step_b = max((time.perf_counter() - t0 - one) / 32, step)
        per_seq = max((step_b - step) / (batch - 1), 0.0)
    kv_tokens = kv_cache_gib * 2**30 / kv_bytes_per_token(model_dir)
    return Calibration(tps, fixed, step, per_seq, kv_tokens)
