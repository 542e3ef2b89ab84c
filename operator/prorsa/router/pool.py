"""The router's view of its workers: endpoint (from discovery) plus live load and health.

Load is what this router has in flight on each worker; health is a passive circuit breaker:
a worker that fails a connection is ejected and a prober re-admits it once `/health` answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prorsa.policy.allocate import Role
from prorsa.router.discovery import Endpoint


@dataclass(slots=True)
class Worker:
    ep: Endpoint
    prefill_inflight: int = 0  # remote prefills running here
    decode_inflight: int = 0  # decodes, and turns served whole (local prefill + decode)
    queued_prefill_tokens: int = 0  # uncached tokens of the prefills in flight here
    ejected: bool = False  # out of rotation until a probe of /health succeeds
    next_probe_at: float = 0.0
    failures: int = 0  # consecutive failed probes (their backoff)
    strikes: int = 0  # consecutive failed requests (transient: timeouts, resets)

    @property
    def name(self) -> str:
        return self.ep.name

    @property
    def inflight(self) -> int:
        return self.prefill_inflight + self.decode_inflight

    @property
    def healthy(self) -> bool:
        return self.ep.ready and not self.ejected

    def _serves(self, roles: tuple[Role, ...], routing_switch: bool) -> bool:
        """Serving a role: it has it and is not leaving it, or (routing switch mode, where a
        role is only a routing decision) it is draining towards it."""
        if self.ep.draining:
            return routing_switch and self.ep.target_role in roles
        return self.ep.role in roles

    def serves_prefill(self, routing_switch: bool) -> bool:
        return self._serves((Role.PREFILL,), routing_switch)

    def serves_decode(self, routing_switch: bool) -> bool:
        return self._serves((Role.DECODE, Role.MIXED), routing_switch)


class Pool:
    def __init__(self, eject_s: float = 2.0, max_eject_s: float = 30.0) -> None:
        self.workers: dict[str, Worker] = {}
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self.version = 0  # bumped on every membership or role change

    def update(self, endpoints: list[Endpoint]) -> None:
        """Reconcile with a discovery snapshot, keeping the load of workers that stay."""
        seen = set()
        for ep in endpoints:
            seen.add(ep.name)
            w = self.workers.get(ep.name)
            if w is None:
                self.workers[ep.name] = Worker(ep)
            elif w.ep != ep:
                if w.ep.url != ep.url:  # a new process: forget the old one's failures
                    self.readmit(w)
                w.ep = ep
        for name in list(self.workers):
            if name not in seen:
                del self.workers[name]
        self.version += 1

    def eject(self, w: Worker, now: float | None = None) -> None:
        """Out of rotation; probed after a delay that doubles with each failed probe."""
        now = time.monotonic() if now is None else now
        w.ejected = True
        w.failures += 1
        w.next_probe_at = now + min(self.eject_s * 2 ** (w.failures - 1), self.max_eject_s)

    def readmit(self, w: Worker) -> None:
        w.ejected, w.failures, w.strikes, w.next_probe_at = False, 0, 0, 0.0

    def due_for_probe(self, now: float) -> list[Worker]:
        return [w for w in self.workers.values() if w.ejected and w.next_probe_at <= now]

    @property
    def ready_count(self) -> int:
        return sum(w.healthy for w in self.workers.values())
