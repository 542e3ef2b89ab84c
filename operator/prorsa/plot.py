"""The picture of a rollout run, simulated (`prorsa simulate`) or real (`prorsa local`).

Both write the same JSON (`{"source", "title", "results": {policy: {"label", "timeline",
"completions_s", ...}}}`), and this module draws any such file the same way, so a real run and
a simulated one compare picture to picture:

  roles over time        prefill workers of each policy (the rest decode)
  prefill demand         tokens/s submitted, the forecast for the step, the pool's capacity
  decode demand          KV of the sequences decoding, its forecast, the decode side's room
  completion CDF         share of trajectories finished by each time, one line per policy

It reads plain dicts (the JSON), never the simulator's objects: `prorsa plot RUN.json`
redraws a file written on another machine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# One colour per policy, the same in every panel and every picture.
COLOURS = {
    "colocated": "#7f7f7f",
    "static": "#1f77b4",
    "reactive": "#ff7f0e",
    "predictive": "#2ca02c",
    "oracle": "#9467bd",
}
_SHOWN_FIRST = ("predictive", "oracle", "reactive", "static")


class PlotError(ValueError):
    """The file is not a run written by `prorsa simulate --json` or `prorsa local --json`."""


def load_run(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlotError(f"{path}: not a JSON file ({e})") from None
    check_run(doc, str(path))
    return doc  # type: ignore[no-any-return]


def check_run(doc: object, where: str = "run") -> None:
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        raise PlotError(f"{where}: expected an object with 'results' (policy -> run)")
    if not doc["results"]:
        raise PlotError(f"{where}: 'results' is empty")
    for name, r in doc["results"].items():
        if not isinstance(r, dict) or not isinstance(r.get("timeline"), list):
            raise PlotError(
                f"{where}: results.{name} has no 'timeline' (written by an older prorsa? "
                "run it again with --json)"
            )
        if not isinstance(r.get("completions_s", []), list):
            raise PlotError(f"{where}: results.{name}.completions_s must be a list")


def title_of(doc: Mapping[str, Any]) -> str:
    if doc.get("title"):
        return str(doc["title"])
    parts = [str(doc.get(k)) for k in ("workload", "mode") if doc.get(k)]
    if doc.get("gpus"):
        parts.append(f"{doc['gpus']} GPUs")
    if doc.get("preset"):
        parts.append(str(doc["preset"]))
    return " · ".join(parts)


def _colour(name: str) -> str | None:
    return COLOURS.get(name.split()[0])


def _shown(results: Mapping[str, Any]) -> str:
    """The run whose demand and capacity are drawn: the first policy that moves workers."""
    for name in _SHOWN_FIRST:
        if name in results and results[name]["timeline"]:
            return name
    return next(iter(results))


def _col(points: list[Mapping[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    return [float(p.get(key, 0.0)) * scale for p in points]


def plot_run(doc: Mapping[str, Any], path: Path) -> Path:
    """Draw `doc` (a run's JSON) as a PNG at `path`; returns the path."""
    check_run(doc)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: Mapping[str, Any] = doc["results"]
    shown = _shown(results)
    tl = results[shown]["timeline"]
    t = _col(tl, "t")
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(f"{title_of(doc)} ({doc.get('source', 'simulated')})", fontsize=12)

    ax = axes[0][0]
    total = 0
    moving = [n for n in results if n != "colocated"]  # colocated: every worker mixed
    for name, r in results.items():
        pts = r["timeline"]
        if not pts:
            continue
        total = max(total, max(int(p["prefill"] + p["decode"] + p["mixed"]) for p in pts))
        if name not in moving:
            continue
        # policies that agree draw on top of each other: thinner lines over thicker ones
        lw = 1.5 + 3.0 * (len(moving) - 1 - moving.index(name)) / max(1, len(moving) - 1)
        ax.step(_col(pts, "t"), _col(pts, "prefill"), where="post", lw=lw,
                label=r.get("label") or name, color=_colour(name))  # fmt: skip
    ax.set_title("roles over time")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"prefill workers (of {total}; the rest decode)")
    ax.set_ylim(-0.2, max(1, total) + 0.2)
    _legend(ax)

    ax = axes[0][1]
    actual = _col(tl, "actual_prefill_tps")
    rates = sorted(actual)
    # the opening burst of first prompts would flatten everything else: scale to the 98th pct
    top = max(rates[int(0.98 * (len(rates) - 1))], 1e-6) if rates else 1.0
    k, unit = _unit([top])
    ax.plot(t, [a / k for a in actual], lw=1, label="submitted", color="black")
    ax.plot(t, _col(tl, "forecast_prefill_tps", 1 / k), lw=1, label="forecast (next step)",
            color=_colour(shown) or "tab:green", ls="--")  # fmt: skip
    ax.step(t, _col(tl, "prefill_capacity_tps", 1 / k), where="post", lw=1.5,
            label="prefill pool capacity", color="tab:red")  # fmt: skip
    # the pool's capacity stays in view unless it dwarfs the demand (then the demand matters)
    cap = max(_col(tl, "prefill_capacity_tps"), default=0.0)
    ax.set_ylim(0, max(1.4 * top, min(1.1 * cap, 4.0 * top)) / k)
    ax.set_title(f"prefill demand vs capacity ({results[shown].get('label') or shown})")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"prefill {unit}tokens/s")
    _legend(ax)

    ax = axes[1][0]
    used, room = _col(tl, "actual_decode_kv"), _col(tl, "decode_kv_capacity")
    expected = _col(tl, "forecast_decode_kv")
    k, unit = _unit(used + expected + room)
    ax.plot(t, [u / k for u in used], lw=1, label="KV of sequences decoding", color="black")
    ax.plot(t, [e / k for e in expected], lw=1, label="forecast (next step)",
            color=_colour(shown) or "tab:green", ls="--")  # fmt: skip
    ax.step(t, [r / k for r in room], where="post", lw=1.5, label="decode KV capacity",
            color="tab:red")  # fmt: skip
    peak = max(used + expected, default=0.0)
    if peak > 0 and max(room, default=0.0) > 20 * peak:  # a tiny rollout in a big cache
        ax.set_yscale("log")
        ax.set_title(
            f"decode demand vs capacity, log scale ({results[shown].get('label') or shown})"
        )
    else:
        ax.set_ylim(bottom=0)
        ax.set_title(f"decode demand vs capacity ({results[shown].get('label') or shown})")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{unit}KV tokens")
    _legend(ax)

    ax = axes[1][1]
    for name, r in results.items():
        done = sorted(float(x) for x in r.get("completions_s", []))
        if not done:
            continue
        n = len(done)
        ax.step([0.0, *done], [0.0, *((i + 1) / n for i in range(n))], where="post", lw=1.5,
                label=r.get("label") or name, color=_colour(name))  # fmt: skip
    ax.set_title("trajectory completion (CDF)")
    ax.set_xlabel("trajectory completion time (s)")
    ax.set_ylabel("share of trajectories done")
    ax.set_ylim(0, 1.02)
    _legend(ax)

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _unit(values: list[float]) -> tuple[float, str]:
    """A scale and prefix that keep the axis' numbers short."""
    top = max((abs(v) for v in values), default=0.0)
    if top >= 5e6:
        return 1e6, "M "
    if top >= 5e3:
        return 1e3, "k "
    return 1.0, ""


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
