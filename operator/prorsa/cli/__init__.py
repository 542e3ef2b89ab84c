"""The `prorsa` command. Each module registers its commands on the one Typer app."""

from __future__ import annotations

import sys

from prorsa.cli._app import _with_password, app

# isort: off
# Registration order is `prorsa --help`'s order: trying it first, then running a cluster.
from prorsa.cli import simulate, local, tools
from prorsa.cli import worker, control
from prorsa.cli import reference

# isort: on

__all__ = [
    "_with_password",
    "app",
    "control",
    "local",
    "main",
    "reference",
    "simulate",
    "tools",
    "worker",
]


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)
