"""The Kubernetes `Cluster` adapter: workers are pods, roles are labels, drains are annotations.

Role changes are merge patches guarded by the pod's resourceVersion (a concurrent change makes
the patch fail instead of being overwritten); all switch state lives on the pods, so a new
operator replica finishes or rolls back a switch it finds half-done. In-flight counts come from
the routers' reports in Redis, cross-checked with each engine's own metrics.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prorsa.control.cluster import ClusterUnavailable, WorkerStatus
from prorsa.events import inflight
from prorsa.events.inflight import Inflight
from prorsa.events.keys import ClusterKeys
from prorsa.kube import labels as L
from prorsa.kube.api import ApiError, Conflict, KubeApi
from prorsa.kube.builders import LWS_API
from prorsa.kube.discovery import pod_endpoint, pod_endpoints
from prorsa.policy.allocate import Role
from prorsa.router.discovery import Endpoint
from prorsa.worker.agent import engine_metrics_text, engine_requests


class KubeCluster:
    def __init__(self, api: KubeApi, redis: Redis, keys: ClusterKeys) -> None:
        self.api = api
        self.redis = redis
        self.keys = keys
        self._engine_urls: dict[str, list[str]] = {}  # per worker, as of the last listing

    async def _pods(self) -> list[dict[str, Any]]:
        """The workers' pods and the other nodes of multi-node ones (which may serve engines)."""
        try:
            return await self.api.list("v1", "Pod", self.keys.namespace,
                                       L.engine_selector(self.keys.name))  # fmt: skip
        except (ApiError, OSError) as e:
            raise ClusterUnavailable(f"Kubernetes API: {e}") from e

    async def _engines(self, worker: str) -> list[Endpoint]:
        """The engines a worker runs: itself, or several where its role runs narrower ones."""
        return [e for e in pod_endpoints(await self._pods()) if e.owner == worker]

    async def workers(self) -> list[WorkerStatus]:
        pods = await self._pods()
        self._engine_urls = {}
        for e in pod_endpoints(pods):
            self._engine_urls.setdefault(e.owner, []).append(e.url)
        try:
            counts = await inflight.read(self.redis, self.keys.workers)
        except (RedisError, OSError) as e:
            raise ClusterUnavailable(f"Redis: {e}") from e
        out = []
        for pod in pods:
            ep = pod_endpoint(pod)
            if ep is None or pod["metadata"].get("deletionTimestamp"):
                continue
            out.append(WorkerStatus(ep.name, ep.role, ep.ready, ep.draining, ep.target_role,
                                    counts.get(ep.name, Inflight()), ep.url))  # fmt: skip
        return out

    async def _patch(self, name: str, patch: dict[str, Any], record_group: bool = False) -> None:
        """Merge-patch a worker pod, guarded by the resourceVersion it was read at. With
        `record_group`, a multi-node worker's role (the one the pod has after the patch) is
        first recorded on its LeaderWorkerSet, so a group it recreates is relabelled to it."""
        for attempt in range(3):
            pod = await self.api.get("v1", "Pod", self.keys.namespace, name)
            if pod is None:
                return
            if record_group and attempt == 0:
                await self._record_group_role(pod, patch)
            version = pod["metadata"].get("resourceVersion")
            try:
                await self.api.patch("v1", "Pod", self.keys.namespace, name, patch, version)
                return
            except Conflict:
                continue  # changed meanwhile: read again, patch again
            except (ApiError, OSError) as e:
                raise ClusterUnavailable(f"Kubernetes API: {e}") from e
        raise ClusterUnavailable(f"pod {name} kept changing while being patched")

    async def mark_draining(self, name: str, target: Role) -> None:
        await self._patch(name, {"metadata": {"annotations": {
            L.DRAINING: "true", L.TARGET_ROLE: target.value}}})  # fmt: skip

    async def _record_group_role(self, pod: dict[str, Any], patch: dict[str, Any]) -> None:
        labels = pod["metadata"].get("labels") or {}
        group = labels.get(L.LWS_NAME)
        role = (patch["metadata"].get("labels") or {}).get(L.ROLE) or labels.get(L.ROLE)
        if not group or not role:
            return
        try:
            await self.api.patch(LWS_API, "LeaderWorkerSet", self.keys.namespace, group,
                                 {"metadata": {"labels": {L.ROLE: role}}})  # fmt: skip
        except (ApiError, OSError) as e:
            raise ClusterUnavailable(f"Kubernetes API: {e}") from e

    async def set_role(self, name: str, role: Role, keep_draining: bool = False) -> None:
        if keep_draining:
            await self._patch(name, {"metadata": {"labels": {L.ROLE: role.value}}},
                              record_group=True)  # fmt: skip
            return
        await self._patch(name, {"metadata": {
            "labels": {L.ROLE: role.value},
            "annotations": {L.DRAINING: None, L.TARGET_ROLE: None}}},
            record_group=True)  # fmt: skip

    async def cancel_drain(self, name: str) -> None:
        # a switch rolled back keeps the old role, on the pod and its LeaderWorkerSet
        await self._patch(name, {"metadata": {"annotations": {
            L.DRAINING: None, L.TARGET_ROLE: None}}}, record_group=True)  # fmt: skip

    async def engine_inflight(self, name: str) -> int | None:
        """Requests the worker's engines hold (None: one of them does not answer)."""
        engines = await self._engines(name)
        counts = await asyncio.gather(*(engine_requests(e.url) for e in engines))
        if not engines or any(n is None for n in counts):
            return None
        return sum(n for n in counts if n is not None)

    async def engine_metrics(self, worker: WorkerStatus) -> str | None:
        """The metrics of the worker's engines, one after another: their series are summed,
        as a data-parallel engine's are."""
        urls = self._engine_urls.get(worker.name) or ([worker.url] if worker.url else [])
        texts = await asyncio.gather(*(engine_metrics_text(u, timeout_s=2.0) for u in urls))
        answered = [t for t in texts if t]
        return "\n".join(answered) if answered else None
