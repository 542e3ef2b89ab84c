"""The local `Cluster` adapter: the worker registry plus the routers' in-flight reports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prorsa.control.cluster import ClusterUnavailable, WorkerStatus
from prorsa.events import inflight
from prorsa.events.inflight import Inflight
from prorsa.events.keys import ClusterKeys
from prorsa.local.registry import Registry
from prorsa.policy.allocate import Role
from prorsa.worker.agent import engine_metrics_text, engine_requests


class LocalCluster:
    def __init__(self, redis: Redis, keys: ClusterKeys, report_max_age_s: float = 5.0) -> None:
        self.redis = redis
        self.keys = keys
        self.registry = Registry(redis, keys)
        self.report_max_age_s = report_max_age_s

    async def workers(self) -> list[WorkerStatus]:
        async with _redis():
            records = await self.registry.list()
            counts = await inflight.read(self.redis, self.keys.workers, self.report_max_age_s)
        return [
            WorkerStatus(
                name=r.name,
                role=r.role,
                ready=r.ready,
                draining=r.draining,
                target_role=r.target_role,
                inflight=counts.get(r.name, Inflight()),
                url=r.url,
            )
            for r in records
        ]

    async def mark_draining(self, name: str, target: Role) -> None:
        async with _redis():
            await self.registry.mark_draining(name, target)

    async def set_role(self, name: str, role: Role, keep_draining: bool = False) -> None:
        async with _redis():
            await self.registry.set_role(name, role, keep_draining)

    async def cancel_drain(self, name: str) -> None:
        async with _redis():
            await self.registry.cancel_drain(name)

    async def engine_inflight(self, name: str) -> int | None:
        async with _redis():
            url = next((r.url for r in await self.registry.list() if r.name == name), None)
        return None if url is None else await engine_requests(url)

    async def engine_metrics(self, worker: WorkerStatus) -> str | None:
        return await engine_metrics_text(worker.url, timeout_s=2.0) if worker.url else None


@asynccontextmanager
async def _redis() -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as e:
        raise ClusterUnavailable(f"Redis: {e}") from e
