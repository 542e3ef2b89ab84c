"""The expert-parallel cost model beside every published configuration it is checked against.

    .venv/bin/python benchmarks/calibration.py [--json F]

Prints per-node prefill input tok/s and decode output tok/s, simulated vs published, and the
error. One constant is fitted (the end-to-end FP8 GEMM fraction, to the first row); the other
rows are out-of-sample checks. Rows whose configuration is not fully published are marked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prorsa.sim.calibration import ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print(
        f"{'configuration':55s} {'unit':>12s} {'published':>10s} {'simulated':>10s} {'error':>7s}"
    )
    for r in ROWS:
        mark = "" if not r.open_question else "  *"
        print(f"{r.name:55s} {r.unit:>12s} {r.published:10.0f} {r.simulated:10.0f}"
              f" {r.error_pct:+6.1f}%{mark}")  # fmt: skip
        rows.append({"name": r.name, "source": r.source, "unit": r.unit,
                     "published": r.published, "simulated": r.simulated,
                     "error_pct": r.error_pct, "open_question": r.open_question})  # fmt: skip
    held = [r for r in ROWS if not r.open_question]
    worst = max(abs(r.error_pct) for r in held)
    print(f"\n{len(held)} of {len(ROWS)} rows held to 15%: worst {worst:.1f}%")
    for r in ROWS:
        if r.open_question:
            print(f"* {r.name}: {r.open_question}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
