"""Measure what one local worker can do, as the allocator's `RoleCapacity`.

Prefill throughput from two prompt lengths (the difference cancels fixed costs), decode step
time from one sequence generating 1 vs 33 tokens, the per-sequence cost from 8 sequences at
once, the cost per KV token from one sequence decoding over a long prompt, and the KV
capacity from the engine's cache size and the model's shape.

Each figure is timed twice: by the client (the request's wall time, what the simulator's
cost model needs: a turn pays the HTTP round trip and the frontend too) and by the engine
itself (its `/metrics`: prefill time from scheduled to first token, the steps between
tokens), the instrument the controller learns the capacity online with. `agreement` sets a
learned capacity against the engine's figures: like against like.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from prorsa.control.engine_metrics import EngineSample, parse_engine_metrics
from prorsa.policy.capacity import RoleCapacity, quoted_prefill_rate
from prorsa.worker.agent import engine_metrics_text

# The calibration's decode requests: 16-token prompts generating 33 tokens hold ~32 tokens of
# KV on average; over a long prompt, LONG_PROMPT more (under 1,024 with their output).
SHORT_KV = 32.0
LONG_PROMPT = 960


@dataclass(frozen=True)
class Calibration:
    prefill_tokens_per_s: float
    prefill_fixed_s: float
    decode_step_s: float  # one sequence holding SHORT_KV tokens
    decode_s_per_seq: float  # each extra sequence in the batch
    kv_capacity_tokens: float
    decode_s_per_kv_token: float = 0.0  # each token of context the step attends
    # the same figures as the engine timed them (None: its /metrics could not be read)
    engine: Calibration | None = None

    def capacity(self, switch_s: float = 0.0) -> RoleCapacity:
        # base + per_seq x batch + per_kv x kv, through the measured step at batch 1
        base = self.decode_step_s - self.decode_s_per_seq - self.decode_s_per_kv_token * SHORT_KV
        return RoleCapacity(
            prefill_tokens_per_s=quoted_prefill_rate(
                self.prefill_fixed_s, self.prefill_tokens_per_s
            ),
            prefill_request_s=self.prefill_fixed_s,
            decode_base_step_s=max(base, 0.0),
            decode_s_per_seq=self.decode_s_per_seq,
            decode_s_per_kv_token=self.decode_s_per_kv_token,
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
    `batch` sequences holding `kv` KV tokens (default: the calibration's own short sequences).
    The calibration has no context term for prefill: it measured fresh prompts. Against the
    engine's own timings where the calibration has them: the controller learns from those
    too, not from the client's wall time."""
    kv = SHORT_KV * batch if kv is None else kv
    cal = cal.engine or cal
    cal_prefill = cal.prefill_fixed_s + tokens / cal.prefill_tokens_per_s
    return {
        "prefill_s": learned.prefill_s(tokens, context) / cal_prefill - 1.0,
        "decode_step_s": learned.decode_step_s(batch, kv) / cal.capacity().decode_step_s(batch, kv)
        - 1.0,
    }


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    return int(2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes)


class _Timer:
    """One worker, timed by the client (wall seconds) and by its engine (`/metrics` deltas)."""

    def __init__(self, s: aiohttp.ClientSession, url: str, model: str) -> None:
        self.s, self.url, self.model = s, url, model

    async def sample(self) -> EngineSample | None:
        text = await engine_metrics_text(self.url, self.s)
        return None if text is None else parse_engine_metrics(text, time.monotonic())

    async def request(self, prompt: list[int], max_tokens: int) -> float:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        t0 = time.perf_counter()
        async with self.s.post(self.url + "/v1/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"calibration request failed: HTTP {r.status}")
        return time.perf_counter() - t0

    async def timed(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, _Engine]:
        """Wall seconds for `prompts` sent at once, and what the engine timed of them."""
        before = await self.sample()
        t0 = time.perf_counter()
        await asyncio.gather(*(self.request(p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        after = await self.sample()
        for _ in range(20):  # the frontend records a request's stats as it answers: wait
            if (
                before is None
                or after is None
                or (after.counts["prefill_s"] - before.counts["prefill_s"] >= len(prompts))
            ):
                break
            await asyncio.sleep(0.05)
            after = await self.sample()
        return wall, _Engine.between(before, after, len(prompts))


@dataclass(frozen=True)
class _Engine:
    """What the engine timed of some requests: prefill seconds per request, and the mean
    step between tokens with the sequences per step (None: not reported)."""

    prefill_s: float | None
    step_s: float | None
    batch: float | None

    @classmethod
    def between(cls, a: EngineSample | None, b: EngineSample | None, requests: int) -> _Engine:
        if a is None or b is None:
            return cls(None, None, None)
        d_sum = {k: b.sums[k] - a.sums[k] for k in a.sums}
        d_cnt = {k: b.counts[k] - a.counts[k] for k in a.counts}
        n, itl, steps = d_cnt["prefill_s"], d_cnt["itl"], d_cnt["step_tokens"]
        ok = n == requests  # nothing else ran on the engine meanwhile
        return cls(
            d_sum["prefill_s"] / n if ok and n > 0 else None,
            d_sum["itl"] / itl if ok and itl > 0 else None,
            itl / steps if ok and itl > 0 and steps > 0 else None,
        )


_SHORT, _LONG = 128, 1024  # the prefill calibration's prompt lengths


def _figures(prefill_short: float, prefill_long: float, step: float, step_long: float,
             step_b: float, batch: float, kv_tokens: float) -> Calibration:  # fmt: skip
    """A calibration from what was timed: prefills of the two prompt lengths (the difference
    cancels fixed costs), a step of one short sequence and of one over LONG_PROMPT, and the
    mean step of `batch` short ones."""
    tps = (_LONG - _SHORT) / max(prefill_long - prefill_short, 1e-4)
    fixed = max(prefill_short - _SHORT / tps, 0.0)
    per_kv = max(step_long - step, 0.0) / (LONG_PROMPT - 16)
    # each extra sequence: the batch's step over one sequence's, less the KV it adds
    per_seq = max((step_b - step) / max(batch - 1.0, 1.0) - per_kv * SHORT_KV, 0.0)
    return Calibration(tps, fixed, step, per_seq, kv_tokens, per_kv)


async def calibrate(url: str, model: str, model_dir: Path, kv_cache_gib: float,
                    repeats: int = 3) -> Calibration:  # fmt: skip
    def prompt(n: int, salt: int) -> list[int]:
        return [3 + (i * 7 + salt * 13) % 390 for i in range(n)]  # distinct: no prefix hits

    def best(runs: list[tuple[float, _Engine]], pick: str) -> tuple[float, float | None]:
        """The fastest wall time, and the fastest the engine timed (each its own minimum:
        the engine's is not slowed by what delayed the client)."""
        engine = [v for _, e in runs if (v := getattr(e, pick)) is not None]
        return min(w for w, _ in runs), (min(engine) if len(engine) == len(runs) else None)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        timer = _Timer(s, url, model)
        await timer.timed([prompt(64, 0)], 4)  # warm-up
        t_short, e_short = best([await timer.timed([prompt(_SHORT, i)], 1)
                                 for i in range(repeats)], "prefill_s")  # fmt: skip
        t_long, e_long = best([await timer.timed([prompt(_LONG, 10 + i)], 1)
                               for i in range(repeats)], "prefill_s")  # fmt: skip
        one, _ = best([await timer.timed([prompt(16, 20 + i)], 1) for i in range(repeats)],
                      "step_s")  # fmt: skip
        many, e_step = best([await timer.timed([prompt(16, 30 + i)], 33)
                             for i in range(repeats)], "step_s")  # fmt: skip
        one_long, _ = best([await timer.timed([prompt(LONG_PROMPT, 50 + i)], 1)
                            for i in range(repeats)], "step_s")  # fmt: skip
        many_long, e_long_step = best([await timer.timed([prompt(LONG_PROMPT, 60 + i)], 33)
                                       for i in range(repeats)], "step_s")  # fmt: skip
        batch = 8
        wall_b, eng_b = await timer.timed([prompt(16, 40 + i) for i in range(batch)], 33)
    kv_tokens = kv_cache_gib * 2**30 / kv_bytes_per_token(model_dir)
    # the client's steps: a request of 33 tokens less one of 1, over the 32 tokens between
    step = max((many - one) / 32, 1e-4)
    wall = _figures(t_short, t_long, step, (many_long - one_long) / 32,
                    max((wall_b - one) / 32, step), batch, kv_tokens)  # fmt: skip
    engine = None
    if (
        e_short is not None and e_long is not None and e_step is not None
        and e_long_step is not None and eng_b.step_s is not None and eng_b.batch is not None
    ):  # fmt: skip
        # the engine's steps as ITL reports them: the batch's weighted by its sequences
        engine = _figures(e_short, e_long, e_step, e_long_step, eng_b.step_s, eng_b.batch,
                          kv_tokens)  # fmt: skip
    return replace(wall, engine=engine)
