from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prorsa.cli import app

runner = CliRunner()
SMALL = ["--gpus", "4", "--trajectories", "24", "--concurrency", "8"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_simulate_writes_the_documented_json(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            "search",
            "--mode",
            mode,
            "--policy",
            "all",
            *SMALL,
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["workload"] == "search" and data["mode"] == mode and data["gpus"] == 4
    assert set(data["results"]) == {"colocated", "static", "reactive", "predictive", "oracle"}
    for row in data["results"].values():
        assert row["throughput_traj_per_min"] > 0
        assert isinstance(row["p99_completion_s"], float)
        assert isinstance(row["switches"], int)
        assert ("makespan_s" in row) == (mode == "sync")
    assert "forecast_mape_pct" in data["results"]["predictive"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "predictive" in res.output and "speedup" in res.output
    assert "run-to-run noise" in res.output  # one seed's ratios come with their caveat


def test_bad_workload_file_exits_2_with_the_field(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nfirst_prompt_tokens: {median: 1}\nphases: []\n")
    res = runner.invoke(app, ["simulate", "--workload", str(f), *SMALL])
    assert res.exit_code == 2
    assert "first_prompt_tokens.p99" in res.output


def test_unknown_policy_and_mode_are_rejected() -> None:
    res = runner.invoke(app, ["simulate", "--policy", "magic", *SMALL])
    assert res.exit_code == 2 and "magic" in res.output
    res = runner.invoke(app, ["simulate", "--mode", "sometimes", *SMALL])
    assert res.exit_code == 2


def test_redis_password_from_the_environment_joins_the_url(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from prorsa.cli import _with_password

    monkeypatch.setenv("REDIS_PASSWORD", "s3cr/t")
    assert _with_password("redis://r:6379/0") == "redis://:s3cr%2Ft@r:6379/0"
    assert _with_password("redis://:own@r:6379/0") == "redis://:own@r:6379/0"
    monkeypatch.delenv("REDIS_PASSWORD")
    assert _with_password("redis://r:6379/0") == "redis://r:6379/0"


def test_simulate_an_expert_parallel_preset_with_stage_specific_engines(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    args = ["simulate", "--preset", "h200-deepseek-v3", "--workload", "math", "--gpus", "64",
            "--trajectories", "16", "--policy", "colocated,static", "--static-prefill", "1",
            "--prefill-gpus", "8", "--decode-gpus", "32", "--json", str(out)]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "ITL" in res.output and "TTFT" in res.output
    assert "a role switch costs 300 s" in " ".join(res.output.split())  # horizon too short
    rows = json.loads(out.read_text())["results"]
    assert rows["static"]["itl_p50_s"] > 0 and rows["colocated"]["ttft_p99_s"] > 0
    res = runner.invoke(app, ["simulate", "--preset", "h200-deepseek-v3", "--gpus", "32"])
    assert res.exit_code == 2 and "fewer than two 32-GPU workers" in " ".join(res.output.split())
    res = runner.invoke(app, ["simulate", "--preset", "h200-deepseek-v3", "--gpus", "64",
                              "--decode-gpus", "12"])  # fmt: skip
    assert res.exit_code == 2 and "divide" in res.output
