"""The `prorsa` command."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.policy.allocate import AllocationSettings
from prorsa.sim.compare import ALL_POLICIES, Comparison, compare
from prorsa.sim.costmodel import PRESETS, preset
from prorsa.sim.engine import SimConfig
from prorsa.sim.workload import WorkloadError, load_workload

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts.",
)
err = Console(stderr=True)


def _out() -> Console:
    """stdout console; piped output gets a width that fits the comparison table."""
    c = Console()
    return c if c.is_terminal else Console(width=140)


@app.callback()
def _root() -> None:
    """Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts."""


def _parse_policies(value: str) -> list[str]:
    names = list(ALL_POLICIES) if value == "all" else [p.strip() for p in value.split(",") if p]
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown or not names:
        raise typer.BadParameter(
            f"unknown policy {', '.join(unknown) or value!r}; "
            f"choose from {', '.join(ALL_POLICIES)} or 'all'"
        )
    return names


@app.command()
def simulate(
    workload: Annotated[
        str, typer.Option(help="built-in (swe, search, math, shift) or a YAML path")
    ] = "swe",
    mode: Annotated[
        str, typer.Option(help="sync (one batch) or async (bounded concurrency)")
    ] = "sync",
    gpus: Annotated[int, typer.Option(min=2, help="GPUs in the cluster, one worker each")] = 32,
    policy: Annotated[str, typer.Option(help="comma-separated policies, or 'all'")] = "all",
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    preset_name: Annotated[
        str,
        typer.Option(
            "--preset", help=f"hardware+model: {', '.join(PRESETS)} (h200 = h200-dense-8b)"
        ),
    ] = "h200",
    switch_mode: Annotated[str, typer.Option(help="routing (drain only) or restart")] = "routing",
    dp_attention: Annotated[bool, typer.Option(help="MoE DP-attention sync penalty")] = False,
    trajectories: Annotated[int, typer.Option(min=0, help="0: the workload's typical batch")] = 0,
    concurrency: Annotated[int, typer.Option(min=0, help="async: in flight (0: typical)")] = 0,
    static_prefill: Annotated[
        int | None, typer.Option(help="static: prefill workers (default: best of a sweep)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results as JSON")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="write forecast vs allocation plot (PNG)")
    ] = None,
) -> None:
    """Simulate one seeded rollout under each policy and compare them."""
    if mode not in ("sync", "async"):
        raise typer.BadParameter("mode must be 'sync' or 'async'", param_hint="--mode")
    policies = _parse_policies(policy)
    try:
        spec = load_workload(workload)
        cost = preset(preset_name, switch_mode, dp_attention)
    except (WorkloadError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    settings = replace(AllocationSettings(), static_prefill=static_prefill)
    config = SimConfig(
        gpus=gpus,
        mode=mode,  # type: ignore[arg-type]
        trajectories=trajectories,
        concurrency=concurrency,
        seed=seed,
        settings=settings,
    )
    with Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        tasks: dict[str, int] = {}

        def progress(name: str, frac: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=1.0)
            bar.update(tasks[name], completed=frac)  # type: ignore[arg-type]

        result = compare(cost, spec, config, policies, preset_name, progress)
    _print_table(result)
    if json_out is not None:
        result.write_json(json_out)
        err.print(f"wrote {json_out}")
    if plot is not None:
        from prorsa.sim.plot import plot_comparison

        plot_comparison(result, plot)
        err.print(f"wrote {plot}")


def _print_table(c: Comparison) -> None:
    first = next(iter(c.results.values()))
    title = (
        f"{c.workload} · {c.mode} · {c.gpus} GPUs · {c.preset} · seed {c.seed} · "
        f"{first.trajectories} trajectories"
    )
    t = Table(title=title)
    t.add_column("policy")
    t.add_column("makespan s" if c.mode == "sync" else "traj/min", justify="right")
    t.add_column("speedup", justify="right")
    t.add_column("p50 s", justify="right")
    t.add_column("p99 s", justify="right")
    t.add_column("P util", justify="right")
    t.add_column("D util", justify="right")
    t.add_column("switches", justify="right")
    for name, r in c.results.items():
        main = f"{r.makespan_s:.0f}" if c.mode == "sync" else f"{r.throughput_traj_per_min:.1f}"
        speed = f"{c.speedup(name):.2f}x" if "colocated" in c.results else "-"
        t.add_row(
            r.label,
            main,
            speed,
            f"{r.p50_completion_s:.0f}",
            f"{r.p99_completion_s:.0f}",
            f"{r.prefill_util:.0%}",
            f"{r.decode_util:.0%}",
            str(r.switches),
        )
    out = _out()
    out.print(t)
    pred = c.results.get("predictive")
    if pred is not None:
        m = pred.forecast_mape
        line = ", ".join(
            f"{k} prefill {v['prefill']:.0f}% decode {v['decode']:.0f}%" for k, v in m.items()
        )
        out.print(f"forecast error (weighted MAPE over the horizon): {line}")


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
