"""Loops that are cancelled while Python 3.11's `asyncio.wait_for` drops the cancellation (as
redis-py's every command can) still end: kopf stopping the controller's daemon, or a router
shutting down, waits for them."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prorsa.cancellation import sleep
from prorsa.control.cluster import WorkerStatus
from prorsa.control.switch import switch
from prorsa.events.inflight import Inflight
from prorsa.policy.allocate import Role


class AnswerAsCancelled:
    """Each read waits, through the real `asyncio.wait_for`, for an answer that comes in the
    next loop turn; on the read numbered `cancel_at` the reader is cancelled in that same turn,
    and on Python 3.11 `wait_for` then returns the answer: the reader never sees the
    cancellation."""

    def __init__(self, cancel_at: int = 3) -> None:
        self.reads = 0
        self.cancel_at = cancel_at
        self.reader: asyncio.Task[Any] | None = None

    async def read(self) -> None:
        self.reads += 1
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cancel = self.reads == self.cancel_at

        def give() -> None:
            answer.set_result(None)
            if cancel:
                assert self.reader is not None
                self.reader.cancel()

        asyncio.get_running_loop().call_soon(give)
        await asyncio.wait_for(answer, 5)


async def ends_within(task: asyncio.Task[Any], seconds: float) -> bool:
    """True when the task has finished, cancelled, within `seconds`."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()  # once more: a loop that ignored the first never returns otherwise
        await asyncio.wait({task}, timeout=1)
        return False
    return task.cancelled()


async def poll(pause: Callable[[float], Awaitable[None]], source: AnswerAsCancelled) -> None:
    while True:
        await source.read()
        await pause(0.01)


def test_a_polling_loop_ends_when_the_cancellation_was_swallowed() -> None:
    async def main() -> tuple[bool, bool]:
        ours, plain = AnswerAsCancelled(), AnswerAsCancelled()
        ours.reader = t1 = asyncio.create_task(poll(sleep, ours))
        plain.reader = t2 = asyncio.create_task(poll(asyncio.sleep, plain))
        return await ends_within(t1, 1.0), await ends_within(t2, 0.5)

    ended, plain_ended = asyncio.run(main())
    assert ended
    if sys.version_info < (3, 12):  # the premise: a plain loop carries on
        assert not plain_ended


class SwallowingCluster(AnswerAsCancelled):
    """One worker draining towards decode with a prefill in flight: a switch polls it."""

    async def workers(self) -> list[WorkerStatus]:
        await self.read()
        return [WorkerStatus("w0", Role.PREFILL, ready=True, draining=True,
                             target_role=Role.DECODE,
                             inflight=Inflight(prefill=1, as_of=time.time()))]  # fmt: skip

    async def mark_draining(self, name: str, target: Role) -> None:
        return None

    async def set_role(self, name: str, role: Role, keep_draining: bool = False) -> None:
        raise AssertionError("the switch cannot finish: a prefill stays in flight")

    async def cancel_drain(self, name: str) -> None:
        return None

    async def engine_inflight(self, name: str) -> int | None:
        return None

    async def engine_metrics(self, worker: WorkerStatus) -> str | None:
        return None


def test_a_switch_cancelled_as_its_read_returns_ends() -> None:
    """The switch a stopping controller abandons stops polling, instead of polling until its
    drain times out while the controller waits for it."""

    async def main() -> tuple[bool, int]:
        cluster = SwallowingCluster()
        cluster.reader = task = asyncio.create_task(
            switch(cluster, "w0", Role.DECODE, drain_timeout_s=60.0, poll_s=0.01))  # fmt: skip
        return await ends_within(task, 2.0), cluster.reads

    ended, reads = asyncio.run(main())
    assert ended
    assert reads == 3  # not one more read after the cancellation
