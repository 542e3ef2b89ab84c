"""Agentic rollout workloads: distributions of turns, tokens and tool latencies.

A workload is a list of phases a trajectory goes through in order (most have one phase; the
`shift` workload plans with long reasoning, then acts with many tool-heavy turns). Each phase
draws its number of turns, per-turn output length, tool latency and tool output size from
log-normal distributions given by median and p99. Samples of one GRPO group share a difficulty
factor that scales their output lengths, so their lengths are correlated.

Built-in workloads live as YAML files next to this module; users describe their own the same
way and pass the path to `--workload`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prorsa.sim.costmodel import lognormal_sigma

Positive = Annotated[float, Field(gt=0)]


class Dist(BaseModel):
    """A log-normal given by its median and 99th percentile, optionally clipped."""

    model_config = ConfigDict(extra="forbid")
    median: Positive
    p99: Positive
    min: float = Field(default=0.0, ge=0)
    max: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Dist:
        if self.p99 < self.median:
            raise ValueError(f"p99 ({self.p99}) must be >= median ({self.median})")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def sample(self, rng: random.Random, scale: float = 1.0) -> float:
        sigma = lognormal_sigma(self.median, self.p99)
        x = math.exp(rng.gauss(math.log(self.median * scale), sigma))
        if self.max is not None:
            x = min(x, self.max)
        return max(x, self.min)


class Phase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "main"
    turns: Dist
    output_tokens: Dist
    tool_latency_s: Dist
    tool_output_tokens: Dist


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    first_prompt_tokens: Dist
    shared_prefix_tokens: int = Field(default=0, ge=0)  # system prompt common to all
    group_size: int = Field(default=8, ge=1)
    # A typical rollout batch for this task: enough to keep GPUs busy while KV still fits.
    trajectories_per_gpu: int = Field(default=16, ge=1)
    group_difficulty_sigma: float = Field(default=0.5, ge=0)
    max_context_tokens: int = Field(default=131072, gt=0)
    phases: list[Phase] = Field(min_length=1)


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and the field."""


BUILTIN = ("swe", "search", "math", "shift")


def load_workload(name_or_path: str) -> WorkloadSpec:
    if name_or_path in BUILTIN:
        text = resources.files("prorsa.sim").joinpath(f"workloads/{name_or_path}.yaml").read_text()
        source = f"built-in workload {name_or_path!r}"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise WorkloadError(
                f"workload {name_or_path!r} is neither a built-in ({', '.join(BUILTIN)}) "
                "nor a readable YAML file"
            )
        text = path.read_text()
        source = str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WorkloadError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected a mapping of workload fields at the top level")
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in e.errors()
        )
        raise WorkloadError(f"{source}: {problems}") from None


@dataclass(frozen=True, slots=True)
class Turn:
    new_tokens: int  # tokens appended to the context before this turn (prompt or tool output)
    output_tokens: int
    tool_s: float  # tool latency after this turn (0 for the last turn)


@dataclass(frozen=True, slots=True)
class TrajectoryScript:
    """Everything a trajectory will do, drawn up front so every policy sees the same rollout."""

    id: str
    group: str
    turns: tuple[Turn, ...]

    @property
    def total_output(self) -> int:
        return sum(t.output_tokens for t in self.turns)


def generate(spec: WorkloadSpec, n: int, seed: int) -> list[TrajectoryScript]:
    """Draw `n` trajectories in GRPO groups of `spec.group_size`."""
    rng = random.Random(seed)
    out: list[TrajectoryScript] = []
    group_factor = 1.0
    group = ""
    first_prompt = 0
    for i in range(n):
        if i % spec.group_size == 0:
            group = f"g{i // spec.group_size}"
            group_factor = math.exp(rng.gauss(0.0, spec.group_difficulty_sigma))
            first_prompt = int(spec.first_prompt_tokens.sample(rng))
        turns: list[Turn] = []
        context = spec.shared_prefix_tokens + first_prompt
        new = context
        full = False
        for phase in spec.phases:
            for _ in range(max(1, round(phase.turns.sample(rng)))):
                output = max(1, int(phase.output_tokens.sample(rng, group_factor)))
                tool_s = phase.tool_latency_s.sample(rng)
                tool_out = max(1, int(phase.tool_output_tokens.sample(rng)))
                full = context + output + tool_out > spec.max_context_tokens
                if full and turns:  # the context window is full: the agent stops here
                    break
                turns.append(Turn(new, output, tool_s))
                context += output + tool_out
                new = tool_out
            if full:
                break
        last = turns[-1]
        turns[-1] = Turn(last.new_tokens, last.output_tokens, 0.0)
        out.append(TrajectoryScript(f"t{i}", group, tuple(turns)))
    return out
