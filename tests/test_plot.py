"""A run's picture and its JSON: what `prorsa simulate --json` records per policy is what
`prorsa plot` draws, and a file that is not such a run gets an error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prorsa.cli import app
from prorsa.plot import PlotError, load_run, plot_run
from prorsa.sim.compare import compare
from prorsa.sim.config import SimConfig
from prorsa.sim.presets import preset
from prorsa.sim.workload import load_workload

PNG = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


@pytest.fixture(scope="module")
def simulated() -> dict[str, object]:
    cost = preset("h200")
    c = compare(
        cost,
        load_workload("shift"),
        SimConfig(gpus=4, trajectories=40, seed=1),
        ("colocated", "static", "predictive"),
    )
    return json.loads(json.dumps(c.to_json()))  # exactly what --json writes


def test_each_policy_records_its_timeline_and_every_completion(
    simulated: dict[str, object],
) -> None:
    prefill_tps = preset("h200").role_capacity().prefill_tokens_per_s
    kv = preset("h200").kv_capacity_tokens
    results = simulated["results"]
    assert isinstance(results, dict)
    for name, row in results.items():
        done = row["completions_s"]
        assert len(done) == row["trajectories"] == 40 and done == sorted(done)
        assert max(done) == pytest.approx(row["makespan_s"], abs=0.01)
        tl = row["timeline"]
        assert tl and [p["t"] for p in tl] == sorted(p["t"] for p in tl)
        for p in tl:
            assert p["prefill"] + p["decode"] + p["mixed"] == 4
            # capacity follows the roles: each prefill worker's rate, each other worker's KV
            assert p["prefill_capacity_tps"] == pytest.approx(p["prefill"] * prefill_tps, 1e-3)
            assert p["decode_kv_capacity"] == pytest.approx((4 - p["prefill"]) * kv, 1e-3)
            assert 0 <= p["actual_decode_kv"] <= p["decode_kv_capacity"] * 1.01 + 1e-9
        if name == "colocated":
            assert all(p["mixed"] == 4 for p in tl)
    pred = results["predictive"]["timeline"]
    assert any(p["forecast_prefill_tps"] > 0 for p in pred)  # the forecast is recorded too
    assert any(p["actual_decode_kv"] > 0 for p in pred)


def test_plot_draws_a_simulated_run(simulated: dict[str, object], tmp_path: Path) -> None:
    path = plot_run(simulated, tmp_path / "deep" / "run.png")
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000  # four panels with lines and text


def test_prorsa_plot_redraws_a_json_file_and_refuses_what_is_not_a_run(
    simulated: dict[str, object], tmp_path: Path
) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(simulated))
    res = runner.invoke(app, ["plot", str(run)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG

    cases = {
        "missing.json": (None, "no such file"),
        "garbage.json": ("{not json", "not a JSON file"),
        "list.json": ("[1, 2]", "expected an object with 'results'"),
        "empty.json": ('{"results": {}}', "'results' is empty"),
        "old.json": ('{"results": {"predictive": {"makespan_s": 3}}}', "has no 'timeline'"),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / name
        if text is not None:
            f.write_text(text)
        with pytest.raises(PlotError, match=message):
            load_run(f)
        res = runner.invoke(app, ["plot", str(f), "--out", str(tmp_path / "x.png")])
        assert res.exit_code == 2 and message in " ".join(res.output.split())
    assert not (tmp_path / "x.png").exists()
