"""`prorsa plot`, `prorsa workload sample`: draw a run, sample workloads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from prorsa.cli._app import TRY, _fail, _out, app, err


@app.command("plot", rich_help_panel=TRY)
def plot_command(
    run: Annotated[
        Path,
        typer.Argument(help="a run written by `prorsa simulate --json` or `prorsa local --json`"),
    ],
    out: Annotated[Path | None, typer.Option(help="the PNG to write (default: RUN.png)")] = None,
) -> None:
    """Draw a run, simulated or real: roles over time, prefill and decode demand vs capacity,
    trajectory completion CDF per policy."""
    from prorsa.plot import PlotError, load_run, plot_run

    try:
        doc = load_run(run)
    except PlotError as e:
        raise _fail(str(e)) from None
    _out().print(f"wrote {plot_run(doc, out or run.with_suffix('.png'))}")


workload_app = typer.Typer(no_args_is_help=True, help="Workloads: sample new ones.")
app.add_typer(workload_app, name="workload", rich_help_panel=TRY)


@workload_app.command("sample")
def workload_sample(
    seed: Annotated[int, typer.Option(help="the sample's seed (same seed, same workload)")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the YAML here (default: stdout)")] = None,
) -> None:
    """Draw a random workload from wide, documented ranges (1-3 phases, 1-60 turns, tokens and
    tool latencies over orders of magnitude) as YAML for --workload."""
    from prorsa.sim.sampler import sample_workload, workload_yaml

    text = workload_yaml(sample_workload(seed))
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        err.print(f"wrote {out}")
