"""The `prorsa` command: the Typer app and what its commands share."""

from __future__ import annotations

import os

import typer
from rich.console import Console

from prorsa.policy.allocate import AllocationSettings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts.",
)
err = Console(stderr=True)
# `prorsa --help` groups the commands by what they are for
TRY = "Try it: simulate, run locally, draw, sample workloads"
RUN = "Run a cluster: the processes its pods run"
REFERENCE = "Reference"
_DEFAULTS = AllocationSettings()


def _out() -> Console:
    """stdout console; piped output gets a width that fits the comparison table."""
    c = Console()
    return c if c.is_terminal else Console(width=140)


@app.callback()
def _root() -> None:
    """Prorsa: prediction-guided prefill/decode allocation for agentic RL rollouts."""


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _with_password(url: str) -> str:
    """Add `REDIS_PASSWORD` (from a Secret, in Kubernetes) to a Redis URL that has none."""
    from urllib.parse import quote, urlsplit, urlunsplit

    password = os.environ.get("REDIS_PASSWORD")
    parts = urlsplit(url)
    if not url or not password or parts.password:
        return url
    netloc = f"{parts.username or ''}:{quote(password, safe='')}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)
