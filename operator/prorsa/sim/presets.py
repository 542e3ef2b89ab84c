"""Named hardware + model pairs for `prorsa simulate --preset` and the allocator's capacity.

Dense and small-MoE presets are one GPU per worker (`CostModel`); the large MoE presets are
engine units of several GPUs with DP attention and expert parallelism (`LockstepCost`), sized
to the smallest unit the FP8 weights fit in with room for KV.
"""

from __future__ import annotations

from prorsa.policy.capacity import RoleCapacity
from prorsa.sim.costmodel import Cost, CostModel, Efficiency
from prorsa.sim.hardware import HARDWARE, MODELS
from prorsa.sim.lockstep import LockstepCost
from prorsa.sim.roles import RoleCosts

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

# `capacityModel: auto`: the capacity is learned online from the workers' metrics, starting from
# this datasheet with a wide prior (1 sd = the figure itself); a preset the user names is
# trusted more (1 sd = half of it), since they picked the hardware and model class.
AUTO_PRIOR = "h200-dense-8b"
AUTO_PRIOR_REL_SD = 1.0
PRESET_PRIOR_REL_SD = 0.5


def prior_name(capacity_model: str) -> tuple[str, float]:
    """The preset a capacity model starts from, and how far it may be off (1 sd, relative)."""
    if capacity_model == "auto":
        return AUTO_PRIOR, AUTO_PRIOR_REL_SD
    return capacity_model, PRESET_PRIOR_REL_SD


def prior_capacity(capacity_model: str) -> tuple[RoleCapacity, float]:
    """One-GPU workers' capacity for a capacity model (auto or a preset) and how far it may
    be off: the prior `prorsa controller` and `prorsa local` learn from. The operator sizes
    expert-parallel engines per role (`kube.handlers.worker_capacity`)."""
    name, rel_sd = prior_name(capacity_model)
    return preset(name).role_capacity(), rel_sd


# Stage-specific parallelism of the expert-parallel presets: GPUs per prefill, decode and
# colocated engine. Prefill needs no more than the weights' unit (its throughput per GPU is
# flat in EP size); decode gains KV room and fewer expert weights read per GPU from larger EP
# (DeepSeek's production: prefill EP32, decode EP144 on 80 GB H800; here on 141 GB H200:
# prefill EP8, decode EP32). A colocated cluster runs one configuration: the decode one.
STAGES: dict[str, tuple[int, int, int]] = {
    "h200-deepseek-v3": (8, 32, 32),
    "h100-deepseek-v3": (16, 64, 64),
    "h200-qwen3-235b": (8, 32, 32),
}


def role_preset(
    name: str,
    switch_mode: str = "routing",
    prefill_gpus: int = 0,
    decode_gpus: int = 0,
    colocated_gpus: int = 0,
) -> RoleCosts:
    """Each role's engine configuration of a preset (0 = the preset's; one-GPU presets run
    one configuration for all roles)."""
    key = name if name in PRESETS else f"{name}-dense-8b"
    if key not in STAGES:
        if prefill_gpus or decode_gpus or colocated_gpus:
            raise ValueError(f"{key} is a one-GPU model: per-role GPUs apply to expert-"
                             f"parallel presets ({', '.join(STAGES)})")  # fmt: skip
        return RoleCosts.single(preset(name, switch_mode))
    p, d, c = STAGES[key]
    p, d, c = prefill_gpus or p, decode_gpus or d, colocated_gpus or c
    big, small = max(p, d), min(p, d)
    if big % small:
        raise ValueError(f"prefill and decode engines of {p} and {d} GPUs cannot share slots "
                         "of one size: one must divide the other")  # fmt: skip
    return RoleCosts(
        preset(key, switch_mode, p), preset(key, switch_mode, d), preset(key, switch_mode, c)
    )


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
