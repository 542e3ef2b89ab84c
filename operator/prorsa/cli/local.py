"""`prorsa local`: a whole rollout cluster on this machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from prorsa.cli._app import TRY, _fail, _logging, _out, app, err
from prorsa.sim.presets import PRESETS
from prorsa.sim.workload import WorkloadError, load_workload


@app.command(rich_help_panel=TRY)
def local(
    workers: Annotated[int, typer.Option(min=1, help="vLLM workers on this machine")] = 2,
    policy: Annotated[str, typer.Option(help="colocated, static, reactive or predictive")] = (
        "predictive"
    ),
    compare: Annotated[
        str, typer.Option(help="run the same workload under each of these policies")
    ] = "",
    workload: Annotated[str, typer.Option(help="built-in (swe, search, math, shift) or YAML")] = (
        "swe"
    ),
    trajectories: Annotated[int, typer.Option(min=1, help="trajectories in the rollout")] = 24,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    mode: Annotated[str, typer.Option(help="sync (one batch) or async (half in flight)")] = "sync",
    redis_url: Annotated[str, typer.Option(help="use this Redis instead of a private one")] = "",
    workdir: Annotated[Path, typer.Option(help="model, logs, Redis data")] = Path(".prorsa/local"),
    model: Annotated[
        Path | None,
        typer.Option(
            help="a Hugging Face-format model directory vLLM can load on the CPU "
            "(default: a generated tiny model)"
        ),
    ] = None,
    live: Annotated[bool, typer.Option(help="live terminal view")] = True,
    capacity: Annotated[
        str,
        typer.Option(
            help="what the controller prices splits with at first: calibrated (measured on "
            "a worker before the run), auto or a simulate preset"
        ),
    ] = "calibrated",
    learn_capacity: Annotated[
        bool, typer.Option(help="correct it online from the workers' vLLM metrics")
    ] = True,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json", help="write the run as JSON: per-turn timings, switches, forecast vs actual"
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="write a picture of the run (PNG), drawn as `prorsa simulate --plot`"),
    ] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Run the whole system on this machine: real vLLM workers on the CPU, router, Redis and
    controller, driven by a seeded agentic workload; prints a summary."""
    import asyncio

    from prorsa.local.runner import LocalOptions, run_local

    _logging(log_level)
    policies = [p.strip() for p in (compare or policy).split(",") if p.strip()]
    known = ("colocated", "static", "reactive", "predictive")
    bad = [p for p in policies if p not in known]
    if bad or not policies:
        raise _fail(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    if mode not in ("sync", "async"):
        raise _fail("--mode must be sync or async")

    if capacity not in ("calibrated", "auto", *PRESETS):
        raise _fail(f"--capacity {capacity}: choose calibrated, auto or one of "
                    f"{', '.join(PRESETS)}")  # fmt: skip
    if capacity == "auto" and not learn_capacity:
        raise _fail("--capacity auto is learned online: drop --no-learn-capacity")
    try:
        load_workload(workload)
    except WorkloadError as e:
        raise _fail(str(e)) from None
    if model is not None:
        from prorsa.local.model import ModelError, check_model_dir
        from prorsa.local.stack import StackConfig

        try:
            check_model_dir(model, workers, StackConfig(model, workdir, "").kv_cache_gib)
        except ModelError as e:
            raise _fail(str(e)) from None
    if workers > (os.cpu_count() or 1):
        err.print(f"[yellow]note:[/yellow] {workers} workers on {os.cpu_count()} cores share cores")
    opts = LocalOptions(
        workers=workers, policies=policies, workload=workload, trajectories=trajectories,
        seed=seed, mode=mode, redis_url=redis_url or None, workdir=workdir, model=model,
        live=live, json_out=json_out, plot=plot, capacity_model=capacity,
        learn_capacity=learn_capacity,
    )  # fmt: skip
    try:
        code = asyncio.run(run_local(opts, _out()))
    except KeyboardInterrupt:
        err.print("interrupted: every process started was stopped")
        code = 130
    raise typer.Exit(code)
