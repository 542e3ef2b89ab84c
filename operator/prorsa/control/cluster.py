"""The `Cluster` port: everything the controller needs from where the workers run.

Adapters implement it for Kubernetes (labels and annotations on pods) and for one machine (the
local registry). All switch state lives on the workers themselves, so any controller instance
can see a half-done switch and finish or roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prorsa.events.inflight import Inflight
from prorsa.policy.allocate import Role


class ClusterUnavailable(Exception):
    """The cluster's state could not be read or written right now; try again later."""


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    name: str
    role: Role
    ready: bool
    draining: bool = False
    target_role: Role | None = None
    inflight: Inflight = field(default_factory=Inflight)  # as the routers report it
    url: str = ""  # the engine's HTTP endpoint ("" when unknown)

    def old_role_inflight(self) -> int:
        """In-flight work of the role this worker is leaving."""
        if self.role is Role.PREFILL:
            return self.inflight.prefill
        if self.role is Role.DECODE:
            return self.inflight.decode
        return self.inflight.total


class Cluster(Protocol):
    async def workers(self) -> list[WorkerStatus]: ...

    async def mark_draining(self, name: str, target: Role) -> None: ...

    async def set_role(self, name: str, role: Role, keep_draining: bool = False) -> None:
        """Relabel to `role` and clear the drain marks, in one step (`keep_draining`: relabel
        only, the worker still taking no work)."""
        ...

    async def cancel_drain(self, name: str) -> None:
        """Clear the drain marks, keeping the old role (a rollback)."""
        ...

    async def engine_inflight(self, name: str) -> int | None:
        """Requests running or queued in the worker's engine, from its own metrics (None when
        it cannot be asked): the cross-check of the routers' reports."""
        ...

    async def engine_metrics(self, worker: WorkerStatus) -> str | None:
        """The worker's engine metrics (Prometheus text), None when it does not answer:
        what the capacity estimator learns from."""
        ...
