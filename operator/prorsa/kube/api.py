"""A thin asynchronous Kubernetes API client: just the calls the operator makes.

Kept small on purpose (create-if-missing, get, list by selector, merge-patch with an optional
resourceVersion guard, delete, status patch) so every call is visible, testable against kmock,
and listed in one place for the RBAC the Helm chart grants.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp

USER_AGENT = "prorsa-operator"
# One API call never waits longer: a stuck connection becomes an error the callers retry
# (the control loop holds the allocation meanwhile) instead of a handler hung for aiohttp's
# five-minute default.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=20, sock_connect=5)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")

PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "Secret": "secrets",
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "RolloutCluster": "rolloutclusters",
    "LeaderWorkerSet": "leaderworkersets",  # multi-node workers
    "Event": "events",  # posted by kopf (kopf.info / kopf.warn); read back by tests
    "ClusterKopfPeering": "clusterkopfpeerings",  # kopf peering (tests set up peers)
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Conflict(ApiError):
    """409: the object changed since it was read (or already exists)."""


def path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path; `namespace=None` for a cluster-scoped kind."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespace is not None else ""
    p = f"{base}{scope}/{PLURALS[kind]}"
    return f"{p}/{name}" if name else p


def matches(obj: dict[str, Any], selector: str) -> bool:
    """An equality-based label selector (`a=b,c=d`), as the API server applies it."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class KubeApi:
    def __init__(self, server: str, token: str | None = None,
                 ssl_context: ssl.SSLContext | bool = True,
                 user_agent: str = USER_AGENT) -> None:  # fmt: skip
        self.server = server.rstrip("/")
        self.user_agent = user_agent
        self.token = token
        self.ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise RuntimeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset)")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        ctx = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(f"https://{host}:{port}", (SERVICE_ACCOUNT / "token").read_text().strip(), ctx)

    async def _request(self, method: str, url: str, body: Any = None,
                       content_type: str = "application/json") -> Any:  # fmt: skip
        if self._session is None or self._session.closed:
            headers = {"User-Agent": self.user_agent}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            self._session = aiohttp.ClientSession(headers=headers, timeout=REQUEST_TIMEOUT)
        async with self._session.request(
            method, self.server + url, json=body, ssl=self.ssl,
            headers={"Content-Type": content_type} if body is not None else None,
        ) as r:  # fmt: skip
            data = await r.json(content_type=None) if r.content_length != 0 else {}
            if r.status == 409:
                raise Conflict(409, str((data or {}).get("message", "conflict")))
            if r.status >= 400:
                raise ApiError(r.status, str((data or {}).get("message", data)))
            return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (idempotent)."""
        meta = obj["metadata"]
        try:
            await self._request("POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")),
                                obj)  # fmt: skip
            return True
        except Conflict:
            return False

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str
                  ) -> dict[str, Any] | None:  # fmt: skip
        try:
            out: dict[str, Any] = await self._request("GET", path(api_version, kind, namespace,
                                                                   name))  # fmt: skip
            return out
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str, selector: str
                   ) -> list[dict[str, Any]]:  # fmt: skip
        url = path(api_version, kind, namespace) + f"?labelSelector={selector}"
        data = await self._request("GET", url)
        items: list[dict[str, Any]] = data.get("items") or []
        return [o for o in items if matches(o, selector)]  # also against lax servers

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                    patch: dict[str, Any], resource_version: str | None = None
                    ) -> dict[str, Any]:  # fmt: skip
        """Merge-patch; with `resource_version`, fail with Conflict if the object changed."""
        if resource_version is not None:
            patch = {**patch, "metadata": {**patch.get("metadata", {}),
                                           "resourceVersion": resource_version}}  # fmt: skip
        out: dict[str, Any] = await self._request(
            "PATCH", path(api_version, kind, namespace, name), patch,
            "application/merge-patch+json",
        )  # fmt: skip
        return out

    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> None:  # fmt: skip
        await self._request(
            "PATCH", path(api_version, kind, namespace, name) + "/status", {"status": status},
            "application/merge-patch+json",
        )  # fmt: skip

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            await self._request("DELETE", path(api_version, kind, namespace, name))
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
