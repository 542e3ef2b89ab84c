"""`prorsa simulate`: compare allocation policies on a simulated cluster."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorsa.cli._app import TRY, _cpus, _out, app, err
from prorsa.policy.allocate import AllocationSettings
from prorsa.sim.compare import ALL_POLICIES, Comparison, compare
from prorsa.sim.config import SimConfig
from prorsa.sim.presets import PRESETS, role_preset
from prorsa.sim.workload import WorkloadError, load_workload


def _parse_policies(value: str) -> list[str]:
    names = list(ALL_POLICIES) if value == "all" else [p.strip() for p in value.split(",") if p]
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown or not names:
        raise typer.BadParameter(
            f"unknown policy {', '.join(unknown) or value!r}; "
            f"choose from {', '.join(ALL_POLICIES)} or 'all'"
        )
    return names


@app.command(rich_help_panel=TRY)
def simulate(
    workload: Annotated[
        str, typer.Option(help="built-in (swe, search, math, shift) or a YAML path")
    ] = "swe",
    mode: Annotated[
        str, typer.Option(help="sync (one batch) or async (bounded concurrency)")
    ] = "sync",
    gpus: Annotated[
        int, typer.Option(min=2, help="GPUs in the cluster (one worker each, or units of G)")
    ] = 32,
    policy: Annotated[str, typer.Option(help="comma-separated policies, or 'all'")] = "all",
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    preset_name: Annotated[
        str,
        typer.Option(
            "--preset", help=f"hardware+model: {', '.join(PRESETS)} (h200 = h200-dense-8b)"
        ),
    ] = "h200",
    switch_mode: Annotated[str, typer.Option(help="routing (drain only) or restart")] = "routing",
    prefill_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per prefill engine")
    ] = 0,
    decode_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per decode engine")
    ] = 0,
    colocated_gpus: Annotated[
        int, typer.Option(min=0, help="expert-parallel presets: GPUs per colocated engine")
    ] = 0,
    initial_prefill: Annotated[
        int | None, typer.Option(help="predictive, reactive: prefill workers at start")
    ] = None,
    prefix_pull: Annotated[
        bool,
        typer.Option(
            help="what-if: prefill workers pull a trajectory's prefix KV from its decode "
            "worker instead of recomputing it (not in the real workers yet)"
        ),
    ] = False,
    horizon: Annotated[
        float, typer.Option(min=1, help="forecast horizon, seconds (allocation.horizonSeconds)")
    ] = AllocationSettings().horizon_s,
    interval: Annotated[
        float, typer.Option(min=0.1, help="seconds between decisions (allocation.intervalSeconds)")
    ] = AllocationSettings().interval_s,
    trajectories: Annotated[int, typer.Option(min=0, help="0: the workload's typical batch")] = 0,
    concurrency: Annotated[int, typer.Option(min=0, help="async: in flight (0: typical)")] = 0,
    static_prefill: Annotated[
        int | None, typer.Option(help="static: prefill workers (default: best of a sweep)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results as JSON")] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write a picture of the run (PNG): roles over time, prefill and decode demand "
            "vs capacity, trajectory completion CDF per policy"
        ),
    ] = None,
    jobs: Annotated[
        int, typer.Option(min=0, help="policies simulated in parallel (0: one per CPU)")
    ] = 0,
) -> None:
    """Simulate one seeded rollout under each policy and compare them."""
    if mode not in ("sync", "async"):
        raise typer.BadParameter("mode must be 'sync' or 'async'", param_hint="--mode")
    policies = _parse_policies(policy)
    try:
        spec = load_workload(workload)
        cost = role_preset(preset_name, switch_mode, prefill_gpus, decode_gpus, colocated_gpus)
        slot = max(cost.slot_gpus(colocated=False), cost.slot_gpus(colocated=True))
        if gpus // slot < 2:
            raise ValueError(
                f"--gpus {gpus} holds fewer than two {slot}-GPU workers of {preset_name}; "
                f"give at least {2 * slot}"
            )
    except (WorkloadError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if horizon < interval:
        err.print("[red]error:[/red] --horizon must be at least --interval")
        raise typer.Exit(2)
    settings = replace(
        AllocationSettings(),
        static_prefill=static_prefill,
        initial_prefill=initial_prefill,
        horizon_s=horizon,
        interval_s=interval,
    )
    switch_s = cost.laid_out(colocated=False).role_capacity(colocated=False).switch_s
    if switch_s > 0 and horizon < 2 * switch_s:
        err.print(
            f"[yellow]note:[/yellow] a role switch costs {switch_s:.0f} s (engine restart) and "
            f"the horizon is {horizon:.0f} s: switches rarely pay off within it; try "
            f"--horizon {3 * switch_s:.0f} --interval {max(interval, 3 * switch_s / 60):.0f}"
        )
    config = SimConfig(
        gpus=gpus,
        mode=mode,  # type: ignore[arg-type]
        trajectories=trajectories,
        concurrency=concurrency,
        seed=seed,
        settings=settings,
        prefix_pull=prefix_pull,
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

        result = compare(cost, spec, config, policies, preset_name, progress, jobs or _cpus())
    _print_table(result)
    if json_out is not None:
        result.write_json(json_out)
        err.print(f"wrote {json_out}")
    if plot is not None:
        from prorsa.plot import plot_run

        plot_run(result.to_json(), plot)
        err.print(f"wrote {plot}")


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0f}%"


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
    t.add_column("TTFT p50/p99 s", justify="right")
    t.add_column("ITL p50/p99 ms", justify="right")
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
            f"{r.ttft_s[0]:.2f}/{r.ttft_s[1]:.1f}",
            f"{1e3 * r.itl_s[0]:.0f}/{1e3 * r.itl_s[1]:.0f}",
        )
    out = _out()
    out.print(t)
    pred = c.results.get("predictive")
    if pred is not None:
        m = pred.forecast_mape
        line = ", ".join(
            f"{k} prefill {_pct(v['prefill'])} decode {_pct(v['decode'])}" for k, v in m.items()
        )
        out.print(f"forecast error (weighted MAPE over the horizon): {line}")
    if len(c.results) > 1:
        out.print(
            "one seed: rollouts are chaotic, and speedups within ~3% of 1.00x are run-to-run "
            "noise (try other --seed values)"
        )
