"""The published configurations the expert-parallel cost model is checked against.

Each row is one measurement from the anchors (`COSTMODEL-ANCHORS.md` beside the design page):
the configuration as published, the figure per node, and what `LockstepCost` says for the same
configuration. `benchmarks/calibration.py` prints them; a test keeps them within 15%.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prorsa.sim.hardware import HARDWARE, MODELS
from prorsa.sim.lockstep import LockstepCost

GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    source: str
    unit: str  # what `published` and `simulated` count, per node
    published: float
    simulate: Callable[[], float]
    # Why a row cannot be held to 15% (its configuration is not fully published); "" = held.
    open_question: str = ""

    @property
    def simulated(self) -> float:
        return self.simulate()

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.simulated / self.published - 1.0)


def _unit(hw: str, gpus: int) -> LockstepCost:
    return LockstepCost(HARDWARE[hw], MODELS["deepseek-v3"], gpus)


def prefill_per_node(hw: str, gpus: int, prompt: float, cached: float = 0.0) -> float:
    """Input tokens/s per node of a prefill unit kept full of `prompt`-token requests whose
    first `cached` tokens hit the prefix cache (counted as input, not computed)."""
    u = _unit(hw, gpus)
    seconds = u.prefill_s(prompt - cached, cached) * gpus  # one rank's time per request
    return GPUS_PER_NODE * prompt / seconds


def decode_per_node(hw: str, gpus: int, per_gpu: float, kv_per_seq: float) -> float:
    """Output tokens/s per node of a decode unit with `per_gpu` sequences on each rank."""
    u = _unit(hw, gpus)
    step = u.decode_step_s(per_gpu * gpus, per_gpu * gpus * kv_per_seq)
    return GPUS_PER_NODE * per_gpu / step


def decode_at_user_rate(hw: str, gpus: int, tok_s_per_user: float, kv_per_seq: float) -> float:
    """Output tokens/s per node at the largest batch that still gives each user this rate."""
    best = 0.0
    for per_gpu in range(1, 513):
        u = _unit(hw, gpus)
        step = u.decode_step_s(per_gpu * gpus, per_gpu * gpus * kv_per_seq)
        if 1.0 / step < tok_s_per_user:
            break
        best = GPUS_PER_NODE * per_gpu / step
    return best


SGLANG = "SGLang large-scale EP blog (lm-sys, 2025-05-05), DeepSeek-V3 on 12 x 8 H100"
DEEPSEEK_DAY6 = "DeepSeek-V3/R1 inference system overview (open-infra-index, day 6)"
DEEPSEEK_PROFILE = "DeepSeek profile-data README"

ROWS = [
    Row("sglang prefill EP32, 1K prompts", SGLANG, "input tok/s", 57674.0,
        lambda: prefill_per_node("h100", 32, 1024.0)),
    Row("sglang prefill EP32, 2K prompts", SGLANG, "input tok/s", 54543.0,
        lambda: prefill_per_node("h100", 32, 2048.0)),
    Row("sglang prefill EP32, 4K prompts", SGLANG, "input tok/s", 50302.0,
        lambda: prefill_per_node("h100", 32, 4096.0)),
    Row("sglang decode EP72, 256 req/GPU, 2K input", SGLANG, "output tok/s", 22282.0,
        lambda: decode_per_node("h100", 72, 256.0, 2048.0 + 50.0)),
    # The profile gives no throughput: ~55 ms per step at 128 requests/GPU (anchors, derived).
    Row("deepseek profile decode EP128, 128 req/GPU, 4K KV", DEEPSEEK_PROFILE, "output tok/s",
        GPUS_PER_NODE * 128 / 0.055, lambda: decode_per_node("h800", 128, 128.0, 4096.0),
        "DeepSeek's engine overlaps the all-to-all with compute in ways SGLang's TBO figures"
        " (used here) do not describe; the ~55 ms step is itself read off a profile"),
    # Production prefill counts cache hits as input: 56.3% of input tokens hit the on-disk
    # KV cache (same source); prompts taken at the reported average KV length, 4,989.
    Row("deepseek production prefill EP32, 56% cache hits", DEEPSEEK_DAY6, "input tok/s",
        73700.0, lambda: prefill_per_node("h800", 32, 4989.0, 0.563 * 4989.0),
        "the cost of loading cache hits from disk and the prompt-length mix are unpublished"),
    Row("deepseek production decode EP144, 20-22 tok/s/user", DEEPSEEK_DAY6, "output tok/s",
        14800.0, lambda: decode_at_user_rate("h800", 144, 21.0, 4989.0)),
]  # fmt: skip
