"""Named hardware + model pairs for `prorsa simulate --preset` and the allocator's capacity.

Dense and small-MoE presets are one GPU per worker (`CostModel`); the large MoE presets are
engine units of several GPUs with DP attention and expert parallelism (`LockstepCost`), sized
to the smallest unit the FP8 weights fit in with room for KV.
"""

from __future__ import annotations

from prorsa.sim.costmodel import Cost, CostModel, Efficiency
from prorsa.sim.hardware import HARDWARE, MODELS
from prorsa.sim.lockstep import LockstepCost

# name: (hardware, model, GPUs per worker; 0 = the one-GPU model)
PRESETS: dict[str, tuple[str, str, int]] = {
    "h200-dense-8b": ("h200", "dense-8b", 0),
    "h100-dense-8b": ("h100", "dense-8b", 0),
    "h200-moe-30b": ("h200", "moe-30b-a3b", 0),
    "h100-moe-30b": ("h100", "moe-30b-a3b", 0),
    # One 8 x H200 node holds DeepSeek-V3 in FP8 (671 GB) with ~24 GB of KV per GPU; on 80 GB
    # GPUs it takes two nodes. Qwen3-235B in FP8 fits one node with far more KV.
    "h200-deepseek-v3": ("h200", "deepseek-v3", 8),
    "h100-deepseek-v3": ("h100", "deepseek-v3", 16),
    "h200-qwen3-235b": ("h200", "qwen3-235b", 8),
}


def preset(name: str, switch_mode: str = "routing", gpus_per_worker: int = 0) -> Cost:
    """A named hardware+model pair; `h200` alone means the dense 8B model on H200.
    `gpus_per_worker` overrides an expert-parallel preset's unit size."""
    key = name if name in PRESETS else f"{name}-dense-8b"
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    if switch_mode not in ("routing", "restart"):
        raise ValueError(f"switch mode must be 'routing' or 'restart', not {switch_mode!r}")
    hw, model, unit = PRESETS[key]
    cost: Cost
    if unit == 0:
        if gpus_per_worker > 1:
            raise ValueError(f"{key} is a one-GPU model; --gpus-per-worker applies to "
                             "expert-parallel presets")  # fmt: skip
        cost = CostModel(HARDWARE[hw], MODELS[model], Efficiency(), switch_mode)
    else:
        cost = LockstepCost(HARDWARE[hw], MODELS[model], gpus_per_worker or unit,
                            switch_mode=switch_mode)  # fmt: skip
    _ = cost.kv_capacity_tokens  # fail early when the model does not fit
    return cost
