from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from prorsa.sim.workload import BUILTIN, WorkloadError, generate, load_workload


@pytest.mark.parametrize("name", BUILTIN)
def test_builtins_load_and_generate(name: str) -> None:
    spec = load_workload(name)
    scripts = generate(spec, 64, seed=0)
    assert len(scripts) == 64
    assert all(s.turns and s.turns[-1].tool_s == 0.0 for s in scripts)
    assert generate(spec, 64, seed=0) == scripts
    assert generate(spec, 64, seed=1) != scripts


def test_output_lengths_are_long_tailed_and_correlated_within_groups() -> None:
    spec = load_workload("math")
    scripts = generate(spec, 4000, seed=0)
    outs = sorted(t.output_tokens for s in scripts for t in s.turns)
    p50, p99 = outs[len(outs) // 2], outs[int(0.99 * len(outs))]
    assert 5 < p99 / p50 < 40
    # the group effect: variance of group means exceeds what independent samples would give
    groups: dict[str, list[float]] = {}
    for s in scripts:
        groups.setdefault(s.group, []).append(math.log(s.turns[0].output_tokens))
    means = [statistics.fmean(v) for v in groups.values()]
    within = statistics.fmean(statistics.pvariance(v) for v in groups.values())
    assert statistics.pvariance(means) > 1.5 * within / spec.group_size


def test_swe_has_long_episodes_and_tool_latency_range() -> None:
    scripts = generate(load_workload("swe"), 200, seed=0)
    turns = sorted(len(s.turns) for s in scripts)
    assert 20 <= turns[len(turns) // 2] <= 40
    tools = [t.tool_s for s in scripts for t in s.turns[:-1]]
    assert min(tools) >= 0.1 and max(tools) <= 300


def test_a_user_workload_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text(
        "name: mine\nfirst_prompt_tokens: {median: 100, p99: 400}\nphases:\n"
        "  - turns: {median: 3, p99: 5}\n    output_tokens: {median: 50, p99: 500}\n"
        "    tool_latency_s: {median: 1, p99: 3}\n    tool_output_tokens: {median: 20, p99: 90}\n"
    )
    assert load_workload(str(f)).name == "mine"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: x\nphases: []\nfirst_prompt_tokens: {median: 1, p99: 2}\n", "phases"),
        ("name: x\nfirst_prompt_tokens: {median: 10, p99: 2}\nphases: []\n", "first_prompt_tokens"),
        ("name: x\nfirst_prompt_tokens: {median: 1, p99: 2}\nbogus: 1\nphases: []\n", "bogus"),
        ("[1, 2", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
        (
            "name: x\nfirst_prompt_tokens: {median: 1, p99: 2}\nphases:\n"
            "  - turns: {median: -1, p99: 5}\n    output_tokens: {median: 5, p99: 50}\n"
            "    tool_latency_s: {median: 1, p99: 3}\n"
            "    tool_output_tokens: {median: 2, p99: 9}\n",
            "phases.0.turns.median",
        ),
    ],
)
def test_bad_workload_files_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(WorkloadError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_workload(str(f))


def test_missing_workload_is_a_clear_error() -> None:
    with pytest.raises(WorkloadError, match="neither a built-in"):
        load_workload("no-such-workload")
