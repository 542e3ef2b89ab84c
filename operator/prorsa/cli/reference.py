"""`prorsa crd`, `prorsa reference`: what the API models generate."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from prorsa.cli._app import REFERENCE, app, err


@app.command(rich_help_panel=REFERENCE)
def crd(
    out: Annotated[
        Path | None, typer.Option(help="write the CRD here (a file or a directory)")
    ] = None,
) -> None:
    """Print (or write) the RolloutCluster CRD generated from the API models."""
    from prorsa.api.crd import render
    from prorsa.api.models import GROUP, PLURAL

    text = render()
    if out is None:
        sys.stdout.write(text)
        return
    path = out / f"{PLURAL}.{GROUP}.yaml" if out.is_dir() else out
    path.write_text(text)
    err.print(f"wrote {path}")


@app.command(rich_help_panel=REFERENCE)
def reference(
    out: Annotated[Path | None, typer.Option(help="file to write (default: stdout)")] = None,
) -> None:
    """Print the RolloutCluster configuration reference (docs/configuration.md)."""
    from prorsa.api.reference import reference as render

    text = render()
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text)
    err.print(f"wrote {out}")
