"""Which workers exist: one interface, one implementation per place Prorsa runs.

A `Discovery` yields complete snapshots of the worker endpoints whenever they change; the pool
reconciles against each snapshot. `RegistryDiscovery` reads the local registry in Redis;
`StaticDiscovery` serves a fixed list (benchmarks, a hand-run cluster); the Kubernetes
implementation watches pods by label selector (`prorsa.kube.discovery`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from prorsa.cancellation import sleep
from prorsa.local.registry import Registry
from prorsa.policy.allocate import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    url: str  # base URL of the worker's OpenAI server, no trailing slash
    role: Role
    ready: bool = True
    draining: bool = False
    target_role: Role | None = None
    # The worker this engine is one of, where a worker runs several (each is an endpoint, the
    # worker's role and drains are theirs); None: the endpoint is the worker.
    worker: str | None = None

    @property
    def owner(self) -> str:
        """The worker whose in-flight count this endpoint's requests are part of."""
        return self.worker or self.name


class Discovery(Protocol):
    def watch(self) -> AsyncIterator[list[Endpoint]]: ...


def parse_static(spec: str) -> Endpoint:
    """`name=url@role`, e.g. `w0=http://127.0.0.1:8100@prefill`."""
    name, eq, rest = spec.partition("=")
    url, at, role = rest.rpartition("@")
    if not (name and eq and at and url.startswith("http")):
        raise ValueError(f"worker must be given as name=http://host:port@role, got {spec!r}")
    try:
        return Endpoint(name, url.rstrip("/"), Role(role))
    except ValueError:
        raise ValueError(
            f"unknown role {role!r} in {spec!r}; use prefill, decode or mixed"
        ) from None


class StaticDiscovery:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        yield list(self.endpoints)
        await asyncio.Event().wait()  # never changes


class RegistryDiscovery:
    """Polls the local registry (a few small hashes) and yields when anything changed."""

    def __init__(self, registry: Registry, interval_s: float = 0.25) -> None:
        self.registry = registry
        self.interval_s = interval_s

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        last: list[Endpoint] | None = None
        failing = False
        while True:
            try:
                records = await self.registry.list()
                if failing:
                    log.info("worker registry reachable again")
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("worker registry unreachable, keeping the last snapshot: %s", e)
                failing = True
                await sleep(self.interval_s * 4)
                continue
            snap = [
                Endpoint(r.name, r.url, r.role, r.ready, r.draining, r.target_role) for r in records
            ]
            if snap != last:
                last = snap
                yield snap
            await sleep(self.interval_s)
