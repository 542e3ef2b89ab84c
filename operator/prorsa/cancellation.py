"""Loops that stop when they are cancelled, even after a library swallowed the cancellation.

Python 3.11's `asyncio.wait_for` returns the inner result when the inner call finishes just as
the waiting task is cancelled, and drops the cancellation (fixed in 3.12). redis-py sends every
command through it, so a controller, switch or router loop cancelled at that moment would carry
on polling; a caller waiting for it to end (kopf stopping a daemon, a router shutting down)
would then hang. The task still counts the request (`Task.cancelling()`), so the loops check
that count wherever they pause.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise the cancellation this task was asked for, if something swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def sleep(seconds: float) -> None:
    """`asyncio.sleep` for polling loops: a cancellation swallowed since the last pause ends
    the loop here instead of never."""
    raise_if_cancelled()
    await asyncio.sleep(seconds)
