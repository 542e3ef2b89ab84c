"""`prorsa workload sample`: random workloads inside documented ranges, valid, reproducible,
and runnable by the simulator."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from prorsa.cli import app
from prorsa.sim import sampler as S
from prorsa.sim.compare import run_policy
from prorsa.sim.config import SimConfig
from prorsa.sim.presets import preset
from prorsa.sim.workload import WorkloadSpec, load_workload


def test_samples_stay_inside_the_documented_ranges_and_reproduce() -> None:
    seen_phases, seen_groups = set(), set()
    for seed in range(200):
        spec = S.sample_workload(seed)
        assert spec == S.sample_workload(seed)
        seen_phases.add(len(spec.phases))
        seen_groups.add(spec.group_size)
        assert S.PHASES[0] <= len(spec.phases) <= S.PHASES[1]
        assert sum(p.turns.median for p in spec.phases) <= S.TURNS[1] * 1.001
        for p in spec.phases:
            assert S.OUTPUT_TOKENS[0] <= p.output_tokens.median <= S.OUTPUT_TOKENS[1]
            assert S.TOOL_OUTPUT_TOKENS[0] <= p.tool_output_tokens.median <= S.TOOL_OUTPUT_TOKENS[1]
            assert S.TOOL_LATENCY_S[0] <= p.tool_latency_s.median <= S.TOOL_LATENCY_S[1]
        lo, hi = S.FIRST_PROMPT_TOKENS
        assert lo <= spec.first_prompt_tokens.median <= hi
        assert spec.shared_prefix_tokens <= spec.first_prompt_tokens.median
        assert 4 <= spec.trajectories_per_gpu <= 256
    assert seen_phases == {1, 2, 3} and seen_groups == set(S.GROUP_SIZES)
    assert S.sample_workload(1) != S.sample_workload(2)


def test_the_yaml_loads_back_to_the_same_workload(tmp_path: Path) -> None:
    out = tmp_path / "w.yaml"
    result = CliRunner().invoke(app, ["workload", "sample", "--seed", "7", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_workload(str(out)) == S.sample_workload(7)
    printed = CliRunner().invoke(app, ["workload", "sample", "--seed", "7"])
    assert WorkloadSpec.model_validate(__import__("yaml").safe_load(printed.stdout)) == (
        S.sample_workload(7)
    )


def test_sampled_workloads_run_to_completion_in_the_simulator() -> None:
    for seed in range(6):
        spec = S.sample_workload(seed)
        r = run_policy(preset("h200"), spec, SimConfig(gpus=4, trajectories=24, seed=seed),
                       "predictive")  # fmt: skip
        assert r.trajectories == 24 and r.makespan_s > 0
