"""The local worker registry: one Redis hash per worker, the stand-in for a pod's labels and
annotations when there is no Kubernetes.

Each worker's hash holds `url`, `role`, `ready` and `heartbeat` (written by the worker agent)
and `draining`, `target_role` (written by the controller during a switch). Every update is a
per-field HSET, so the agent and the controller never overwrite each other's fields, and all
switch state lives here: a restarted controller finds a half-done switch and finishes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from prorsa.events.keys import ClusterKeys
from prorsa.policy.allocate import Role


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    name: str
    url: str
    role: Role
    ready: bool = False
    draining: bool = False
    target_role: Role | None = None
    heartbeat: float = 0.0
    pid: int = 0


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _role(raw: str | None) -> Role | None:
    try:
        return Role(raw) if raw else None
    except ValueError:
        return None


class Registry:
    def __init__(self, redis: Redis, keys: ClusterKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def register(self, name: str, url: str, role: Role) -> None:
        """Add a worker (or re-add it after a restart) keeping any role a controller set."""
        key = self.keys.worker(name)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, "role", role.value)
        pipe.hset(key, mapping={"url": url, "ready": "0", "heartbeat": repr(time.time())})
        pipe.sadd(self.keys.registry, name)
        await pipe.execute()

    async def set_ready(self, name: str, ready: bool) -> None:
        await self.redis.hset(
            self.keys.worker(name),
            mapping={"ready": "1" if ready else "0", "heartbeat": repr(time.time())},
        )

    async def heartbeat(self, name: str, url: str, role: Role, ready: bool) -> bool:
        """Refresh the heartbeat; re-register a worker whose entry vanished (Redis restarted
        without its data). True when it had to re-register."""
        key = self.keys.worker(name)
        if await self.redis.hexists(key, "url"):
            await self.redis.hset(key, "heartbeat", repr(time.time()))
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"url": url, "role": role.value, "ready": "1" if ready else "0",
                                "heartbeat": repr(time.time())})  # fmt: skip
        pipe.sadd(self.keys.registry, name)
        await pipe.execute()
        return True

    async def set_engine_pid(self, name: str, pid: int) -> None:
        """The engine's process (group) id, for operators and fault tests on this host."""
        await self.redis.hset(self.keys.worker(name), "pid", str(pid))

    async def mark_draining(self, name: str, target: Role) -> None:
        await self.redis.hset(
            self.keys.worker(name), mapping={"draining": "1", "target_role": target.value}
        )

    async def set_role(self, name: str, role: Role, keep_draining: bool = False) -> None:
        """Relabel and undrain in one step (the end of a switch); or relabel only."""
        if keep_draining:
            await self.redis.hset(self.keys.worker(name), "role", role.value)
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.worker(name), mapping={"role": role.value, "draining": "0"})
        pipe.hdel(self.keys.worker(name), "target_role")
        await pipe.execute()

    async def cancel_drain(self, name: str) -> None:
        """Roll a switch back: keep the old role, accept work again."""
        await self.set_role(name, await self.role(name) or Role.MIXED)

    async def role(self, name: str) -> Role | None:
        raw = await self.redis.hget(self.keys.worker(name), "role")
        return _role(_text(raw) if raw else None)

    async def remove(self, name: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(self.keys.registry, name)
        pipe.delete(self.keys.worker(name))
        await pipe.execute()

    async def list(self) -> list[WorkerRecord]:
        names = sorted(_text(n) for n in await self.redis.smembers(self.keys.registry))
        pipe = self.redis.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(self.keys.worker(n))
        out = []
        for n, raw in zip(names, await pipe.execute(), strict=True):
            h = {_text(k): _text(v) for k, v in raw.items()}
            role = _role(h.get("role"))
            if role is None or not h.get("url"):
                continue  # half-registered or corrupted: invisible until the agent rewrites it
            out.append(
                WorkerRecord(
                    name=n,
                    url=h["url"],
                    role=role,
                    ready=h.get("ready") == "1",
                    draining=h.get("draining") == "1",
                    target_role=_role(h.get("target_role")),
                    heartbeat=float(h.get("heartbeat", "0") or 0),
                    pid=int(h.get("pid", "0") or 0),
                )
            )
        return out
