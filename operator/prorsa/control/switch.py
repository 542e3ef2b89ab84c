"""The switch protocol: drain → wait until the old role's in-flight work is done → relabel →
undrain. A drain that does not finish in time is rolled back, so a stuck request never leaves
a worker half-switched.

In-flight counts come from the routers' reports; a report only proves the worker is empty if it
was written after the router saw the drain mark (`settle_s` covers the routers' discovery lag),
otherwise a request placed just before the mark could be missed.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum

from prorsa.cancellation import sleep
from prorsa.control.cluster import Cluster, ClusterUnavailable, WorkerStatus
from prorsa.policy.allocate import Role

log = logging.getLogger(__name__)


class SwitchOutcome(StrEnum):
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"  # already in the target role, or gone


async def _status(cluster: Cluster, name: str, retry_s: float) -> WorkerStatus | None:
    """The worker's status; waits out a cluster that is briefly unreachable."""
    while True:
        try:
            return next((w for w in await cluster.workers() if w.name == name), None)
        except ClusterUnavailable as e:
            log.warning("switch %s: cannot read the cluster (%s); retrying", name, e)
            await sleep(retry_s)


async def _engine_agrees(cluster: Cluster, w: WorkerStatus) -> bool:
    """The engine runs no more than the routers account for: no router forgot to report, and
    no client reaches the worker around the routers."""
    try:
        busy = await cluster.engine_inflight(w.name)
    except ClusterUnavailable:
        return False
    return busy is None or busy <= w.inflight.total


async def switch(
    cluster: Cluster,
    name: str,
    target: Role,
    *,
    drain_timeout_s: float = 120.0,
    settle_s: float = 1.0,
    poll_s: float = 0.2,
    engine_check: bool = False,
    restart_notice_s: float = 90.0,
) -> SwitchOutcome:
    """`engine_check` (switch mode `restart`, where a draining worker gets no new work at all
    and its engine is about to restart): wait until nothing at all is in flight on the worker,
    not only work of its old role — a decode worker that prefilled a turn for another (load
    shedding) holds that KV until the other has pulled it, and a restart would lose it — and
    until the engine's own metrics agree. In `routing` mode the engine keeps running, and it
    may already run work of its new role that no report has counted yet.

    In `restart` mode the worker is relabelled under the drain mark, which is cleared once it
    stops being ready (its agent took the engine down to restart it), or after
    `restart_notice_s`: until then its old engine still answers, and a router that saw it
    ready in its new role would send it work the restart loses (a prefill whose KV the
    decode worker then failed to pull, seen in e2e)."""
    w = await _status(cluster, name, poll_s)
    if w is None or (w.role is target and not w.draining):
        return SwitchOutcome.SKIPPED
    if not (w.draining and w.target_role is target):
        await cluster.mark_draining(name, target)
    marked = time.time()
    deadline = time.monotonic() + drain_timeout_s
    while not (
        w.inflight.as_of >= marked + settle_s
        and (w.inflight.total if engine_check else w.old_role_inflight()) == 0
        and (not engine_check or await _engine_agrees(cluster, w))
    ):
        if time.monotonic() > deadline:
            log.warning(
                "switch %s %s->%s: %d in flight after %.0fs; rolling back",
                name, w.role.value, target.value, w.old_role_inflight(), drain_timeout_s,
            )  # fmt: skip
            await cluster.cancel_drain(name)
            return SwitchOutcome.ROLLED_BACK
        await sleep(poll_s)
        w = await _status(cluster, name, poll_s)
        if w is None:
            return SwitchOutcome.SKIPPED
    old = w.role
    if engine_check:
        await cluster.set_role(name, target, keep_draining=True)
        noticed = time.monotonic() + restart_notice_s
        while w is not None and w.ready and time.monotonic() < noticed:
            await sleep(poll_s)
            w = await _status(cluster, name, poll_s)
        if w is None:
            return SwitchOutcome.SKIPPED
    await cluster.set_role(name, target)
    log.info("switch %s %s->%s done", name, old.value, target.value)
    return SwitchOutcome.DONE
