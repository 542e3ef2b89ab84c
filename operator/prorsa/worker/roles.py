"""Where a worker learns its role: one interface, polled by the agent.

In Kubernetes the role is the pod label `prorsa.io/role`, seen through a downward-API volume
(a file of `key="value"` lines the kubelet rewrites in place when the label changes); locally
it is the `role` field of the worker's registry hash. The other nodes of an engine that spans
several (a LeaderWorkerSet group) follow their first node's agent.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import aiohttp
from redis.exceptions import RedisError

from prorsa.local.registry import Registry
from prorsa.policy.allocate import Role

ROLE_LABEL = "prorsa.io/role"
log = logging.getLogger(__name__)


class RoleSource(Protocol):
    async def current(self) -> Role | None:
        """The role now, or None when it cannot be read (keep the last one)."""
        ...


def parse_labels(text: str) -> dict[str, str]:
    """The downward-API format: one `key="value"` per line, value a JSON-style string."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and len(value) >= 2 and value[0] == value[-1] == '"':
            out[key.strip()] = value[1:-1].encode().decode("unicode_escape")
    return out


class FixedRoleSource:
    def __init__(self, role: Role) -> None:
        self.role = role

    async def current(self) -> Role | None:
        return self.role


class FileRoleSource:
    def __init__(self, path: Path, label: str = ROLE_LABEL) -> None:
        self.path = path
        self.label = label
        self._warned = False

    async def current(self) -> Role | None:
        try:
            raw = parse_labels(self.path.read_text()).get(self.label)
            return Role(raw) if raw else None
        except (OSError, ValueError) as e:
            if not self._warned:
                log.warning("cannot read role label %s from %s: %s", self.label, self.path, e)
                self._warned = True
            return None


class RegistryRoleSource:
    def __init__(self, registry: Registry, name: str) -> None:
        self.registry = registry
        self.name = name

    async def current(self) -> Role | None:
        try:
            return await self.registry.role(self.name)
        except (RedisError, OSError):
            return None


class LeaderRoleSource:
    """The role the agent of the engine's first node holds (its `/role`)."""

    def __init__(self, agent_url: str) -> None:
        self.url = agent_url.rstrip("/") + "/role"
        self._warned = False

    async def current(self) -> Role | None:
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.get(self.url, timeout=aiohttp.ClientTimeout(total=3)) as r,
            ):
                r.raise_for_status()
                body = await r.json()
            self._warned = False
            return Role(body["role"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
            if not self._warned:
                log.warning("cannot read the role from %s: %s", self.url, e)
                self._warned = True
            return None
