"""Router discovery in Kubernetes: list and watch the cluster's worker pods.

A worker pod is an endpoint when it has an IP and a role label; it is ready when its Ready
condition is true and it is not being deleted. A multi-node worker whose role runs several
engines adds one endpoint per engine, served by the engine's first node (`pod_endpoints`).
Role, draining and target role come from the label and annotations the controller writes, so
a relabel reaches the router within one watch event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from prorsa.events.keys import ClusterKeys
from prorsa.kube import labels as L
from prorsa.policy.allocate import Role
from prorsa.router.discovery import Endpoint

log = logging.getLogger(__name__)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def pod_endpoint(pod: dict[str, Any]) -> Endpoint | None:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    ip = status.get("podIP")
    if labels.get(L.COMPONENT) != L.WORKER or not labels.get(L.CLUSTER):
        return None
    try:
        role = Role(labels.get(L.ROLE, ""))
    except ValueError:
        return None
    if not ip:
        return None
    ready = not meta.get("deletionTimestamp") and _ready(status)
    try:
        target = Role(ann[L.TARGET_ROLE]) if ann.get(L.TARGET_ROLE) else None
    except ValueError:
        target = None
    port = ann.get(L.PORT, "8000")
    return Endpoint(
        name=meta.get("name", ip),
        url=f"http://{ip}:{port}",
        role=role,
        ready=bool(ready),
        draining=ann.get(L.DRAINING) == "true",
        target_role=target,
    )


def pod_endpoints(pods: Iterable[dict[str, Any]]) -> list[Endpoint]:
    """Every engine of a cluster's worker pods, by name. A worker is one endpoint, unless it
    spans nodes and its role runs engines narrower than it (`prorsa.io/engine-nodes`): then
    each engine's first node serves one, with the worker's role and drain state."""
    pods = list(pods)
    nodes: dict[tuple[str, str], dict[str, Any]] = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        if labels.get(L.COMPONENT) == L.WORKER_NODE:
            nodes[(labels.get(L.WORKER_INDEX, ""), labels.get(L.LWS_NODE, ""))] = p
    out = []
    for pod in pods:
        ep = pod_endpoint(pod)
        if ep is None:
            continue
        out.append(ep)
        per = _engine_nodes(pod, ep.role)
        if per is None:
            continue
        index = ((pod.get("metadata") or {}).get("labels") or {}).get(L.WORKER_INDEX, "")
        heads = sorted(int(n) for (i, n) in nodes if i == index and n.isdigit())
        for head in (n for n in heads if n > 0 and n % per == 0):
            engine = _node_endpoint(nodes[(index, str(head))], ep)
            if engine is not None:
                out.append(engine)
    return sorted(out, key=lambda e: e.name)


def _engine_nodes(pod: dict[str, Any], role: Role) -> int | None:
    """Nodes each of the role's engines spans, where narrower than the worker (else None)."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(L.ENGINE_NODES)
    if not raw:
        return None
    try:
        per = json.loads(raw).get(role.value)
    except (ValueError, AttributeError):
        return None
    return per if isinstance(per, int) and per >= 1 else None


def _node_endpoint(pod: dict[str, Any], leader: Endpoint) -> Endpoint | None:
    """The engine a worker's other node serves: its own address, the worker's role."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return None
    ready = not meta.get("deletionTimestamp") and _ready(status)
    port = (meta.get("annotations") or {}).get(L.PORT, "8000")
    return Endpoint(
        name=meta.get("name", ip),
        url=f"http://{ip}:{port}",
        role=leader.role,
        ready=leader.ready and bool(ready),
        draining=leader.draining,
        target_role=leader.target_role,
        worker=leader.name,
    )


def _ready(status: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


class PodDiscovery:
    def __init__(
        self,
        server: str,
        keys: ClusterKeys,
        token: str | None = None,
        ssl_context: ssl.SSLContext | bool = True,
    ) -> None:
        self.server = server.rstrip("/")
        self.keys = keys
        self.token = token
        self.ssl = ssl_context

    @classmethod
    def in_cluster(cls, keys: ClusterKeys) -> PodDiscovery:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset)")
        ctx = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        return cls(f"https://{host}:{port}", keys, token, ctx)

    def _url(self) -> str:
        return f"{self.server}/api/v1/namespaces/{self.keys.namespace}/pods"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        selector = L.engine_selector(self.keys.name)
        pods: dict[str, dict[str, Any]] = {}
        last: list[Endpoint] | None = None
        async with aiohttp.ClientSession(headers=self._headers()) as s:
            while True:
                try:
                    async with s.get(
                        self._url(), params={"labelSelector": selector}, ssl=self.ssl
                    ) as r:
                        r.raise_for_status()
                        listing = await r.json()
                    pods = {p["metadata"]["name"]: p for p in listing.get("items") or ()}
                    version = (listing.get("metadata") or {}).get("resourceVersion", "")
                    snap = self._snapshot(pods)
                    if snap != last:
                        last = snap
                        yield snap
                    params = {
                        "labelSelector": selector,
                        "watch": "1",
                        "resourceVersion": version,
                        "allowWatchBookmarks": "true",
                    }
                    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
                    async with s.get(
                        self._url(), params=params, ssl=self.ssl, timeout=timeout
                    ) as r:
                        r.raise_for_status()
                        async for line in r.content:
                            if not line.strip():
                                continue
                            ev = json.loads(line)
                            kind, pod = ev.get("type"), ev.get("object") or {}
                            if kind == "ERROR":
                                break  # e.g. 410 Gone: list again
                            name = (pod.get("metadata") or {}).get("name")
                            if kind == "DELETED" and name:
                                pods.pop(name, None)
                            elif kind in ("ADDED", "MODIFIED") and name:
                                pods[name] = pod
                            else:
                                continue
                            snap = self._snapshot(pods)
                            if snap != last:
                                last = snap
                                yield snap
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
                    log.warning("pod watch failed (%s); keeping the last snapshot, retrying", e)
                    await asyncio.sleep(2.0)

    def _snapshot(self, pods: dict[str, dict[str, Any]]) -> list[Endpoint]:
        """Endpoints of this cluster's worker pods (the selector is re-checked here)."""
        mine = (
            p for p in pods.values()
            if ((p.get("metadata") or {}).get("labels") or {}).get(L.CLUSTER) == self.keys.name
        )  # fmt: skip
        return pod_endpoints(mine)
