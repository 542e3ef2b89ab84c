"""Plot forecast demand against the P/D allocation over time."""

from __future__ import annotations

from pathlib import Path

from prorsa.sim.compare import Comparison


def plot_comparison(c: Comparison, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = c.results.get("predictive") or next(iter(c.results.values()))
    tl = shown.timeline
    t = [p.t for p in tl]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax = axes[0]
    ax.plot(t, [p.actual_prefill_tps / 1e3 for p in tl], label="submitted", lw=1)
    ax.plot(t, [p.forecast_prefill_tps / 1e3 for p in tl], label="forecast (next step)", lw=1)
    ax.set_ylabel("prefill k tok/s")
    rates = sorted(p.actual_prefill_tps / 1e3 for p in tl)
    if rates:  # the opening burst of first prompts would flatten everything else
        ax.set_ylim(0, 1.3 * rates[int(0.98 * (len(rates) - 1))] + 1e-9)
    ax.legend(loc="upper right")
    ax.set_title(f"{c.workload} · {c.mode} · {c.gpus} GPUs · {shown.label}")
    ax = axes[1]
    ax.plot(t, [p.actual_decode for p in tl], label="decoding", lw=1)
    ax.plot(t, [p.forecast_decode for p in tl], label="forecast (next step)", lw=1)
    ax.set_ylabel("decode sequences")
    ax.legend(loc="upper right")
    ax = axes[2]
    for name, r in c.results.items():
        if name == "colocated":
            continue
        ax.step(
            [p.t for p in r.timeline],
            [p.prefill for p in r.timeline],
            where="post",
            label=f"{r.label}",
            lw=1,
        )
    ax.set_ylabel("prefill workers")
    ax.set_xlabel("time (s)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
