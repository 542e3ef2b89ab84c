"""Random workloads from wide, documented ranges: agents nobody tuned the forecaster for.

`sample_workload(seed)` draws every field of a `WorkloadSpec` (the same schema users write),
log-uniformly where a quantity spans orders of magnitude. The ranges below are the contract:
they are printed in the workload's description and documented in the README.
"""

from __future__ import annotations

import math
import random

import yaml

from prorsa.sim.workload import Dist, Phase, WorkloadSpec

# (low, high) of each median, drawn log-uniformly; p99 = median x a spread drawn from SPREAD.
PHASES = (1, 3)
TURNS = (1.0, 60.0)  # per trajectory, over all its phases
OUTPUT_TOKENS = (16.0, 16_000.0)
TOOL_OUTPUT_TOKENS = (8.0, 16_000.0)
FIRST_PROMPT_TOKENS = (64.0, 32_000.0)
TOOL_LATENCY_S = (0.05, 300.0)
SPREAD = (1.2, 8.0)  # p99 / median
GROUP_SIZES = (1, 2, 4, 8, 16, 32)
DIFFICULTY_SIGMA = (0.0, 1.0)
MAX_CONTEXT = (32_768, 65_536, 131_072)
SHARED_PREFIX_SHARE = 0.5  # workloads with a shared system prompt (up to half the first prompt)
# A batch per GPU that keeps the expected live context near this many tokens on the dense 8B
# reference (an H200 holds ~1.2M KV tokens of it); within 4-256 trajectories.
KV_TOKENS_PER_GPU = 600_000.0


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _dist(rng: random.Random, lo: float, hi: float, floor: float, cap: float | None) -> Dist:
    median = _log_uniform(rng, lo, hi)
    p99 = median * rng.uniform(*SPREAD)
    if cap is not None:
        median, p99 = min(median, cap), min(p99, cap)
    return Dist(median=round(median, 3), p99=round(max(p99, median), 3), min=floor, max=cap)


def sample_workload(seed: int) -> WorkloadSpec:
    rng = random.Random(f"prorsa-workload-{seed}")
    n_phases = rng.randint(*PHASES)
    total_turns = _log_uniform(rng, *TURNS)
    shares = [rng.uniform(0.2, 1.0) for _ in range(n_phases)]
    phases = []
    for i, share in enumerate(shares):
        turns = max(1.0, total_turns * share / sum(shares))
        phases.append(
            Phase(
                name=f"phase{i + 1}",
                turns=Dist(
                    median=round(turns, 2),
                    p99=round(turns * rng.uniform(*SPREAD), 2),
                    min=1,
                    max=TURNS[1],
                ),
                output_tokens=_dist(rng, *OUTPUT_TOKENS, floor=1, cap=32_768),
                tool_latency_s=_dist(rng, *TOOL_LATENCY_S, floor=0.01, cap=3_600),
                tool_output_tokens=_dist(rng, *TOOL_OUTPUT_TOKENS, floor=1, cap=65_536),
            )
        )
    first = _dist(rng, *FIRST_PROMPT_TOKENS, floor=16, cap=65_536)
    max_context = rng.choice(MAX_CONTEXT)
    shared = 0
    if rng.random() < SHARED_PREFIX_SHARE:
        shared = int(first.median * rng.uniform(0.05, 0.5))
    per_turn = sum(
        p.turns.median * (p.output_tokens.median + p.tool_output_tokens.median) for p in phases
    )
    live = min(float(max_context), first.median + per_turn / 2)  # a trajectory mid-way
    per_gpu = int(min(256, max(4, KV_TOKENS_PER_GPU / live)))
    return WorkloadSpec(
        name=f"sampled-{seed}",
        description=(
            f"sampled (prorsa workload sample --seed {seed}): {n_phases} phase(s), "
            f"~{total_turns:.0f} turns"
        ),
        first_prompt_tokens=first,
        shared_prefix_tokens=shared,
        group_size=rng.choice(GROUP_SIZES),
        trajectories_per_gpu=per_gpu,
        group_difficulty_sigma=round(rng.uniform(*DIFFICULTY_SIGMA), 3),
        max_context_tokens=max_context,
        phases=phases,
    )


def workload_yaml(spec: WorkloadSpec) -> str:
    """The spec as the YAML a user would write (loads back to the same spec)."""
    data = spec.model_dump(exclude_defaults=False)
    return yaml.safe_dump(data, sort_keys=False, width=100)
