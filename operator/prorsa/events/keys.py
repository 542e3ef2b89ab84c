"""Redis key names of one rollout cluster (DESIGN.md: prefix `prorsa:<namespace>:<name>:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    namespace: str
    name: str

    @classmethod
    def parse(cls, ref: str) -> ClusterKeys:
        """`namespace/name` (or just `name`, in namespace `default`)."""
        ns, _, name = ref.rpartition("/")
        if not name or "/" in ns or ":" in ref:
            raise ValueError(f"cluster reference must be 'namespace/name', got {ref!r}")
        return cls(ns or "default", name)

    @property
    def prefix(self) -> str:
        return f"prorsa:{self.namespace}:{self.name}:"

    @property
    def events(self) -> str:
        """Stream of lifecycle events (router → controller)."""
        return self.prefix + "events"

    @property
    def workers(self) -> str:
        """Hash of in-flight counts per worker and router replica (router → controller)."""
        return self.prefix + "workers"

    @property
    def registry(self) -> str:
        """Set of worker names registered locally (local mode only)."""
        return self.prefix + "registry"

    def worker(self, name: str) -> str:
        """Hash of one locally registered worker: url, role, drain state, readiness."""
        return f"{self.prefix}worker:{name}"
