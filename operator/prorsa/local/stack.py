"""Start the data plane on this machine: vLLM workers (through `prorsa worker`) and the router.

Used by the local runner and the end-to-end tests. Each worker gets its own port, its own NIXL
side-channel port and its own CPU core (two unbound CPU engines on one host slow down ~25x).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prorsa.events.keys import ClusterKeys
from prorsa.local.processes import Child, free_port
from prorsa.policy.allocate import Role

SERVED_MODEL = "tiny"


@dataclass
class StackConfig:
    model: Path
    workdir: Path
    redis_url: str
    roles: list[Role] = field(default_factory=lambda: [Role.PREFILL, Role.DECODE])
    keys: ClusterKeys = field(default_factory=lambda: ClusterKeys("default", "local"))
    switch_mode: str = "routing"
    prefix_caching: bool = True
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    engine_args: tuple[str, ...] = ()
    role_args: dict[Role, tuple[str, ...]] = field(default_factory=dict)  # per role, after
    cpu_cores: tuple[str, ...] = ()  # per worker (default: one core each, round robin)


@dataclass
class WorkerHandle:
    name: str
    port: int
    child: Child

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _prorsa() -> list[str]:
    return [sys.executable, "-m", "prorsa.cli"]


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.cfg = config
        self.workers: list[WorkerHandle] = []
        self.router: Child | None = None
        self.router_port = 0

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _cluster_ref(self) -> str:
        return f"{self.cfg.keys.namespace}/{self.cfg.keys.name}"

    def start_worker(self, i: int, role: Role) -> WorkerHandle:
        c = self.cfg
        name, port = f"worker-{i}", free_port()
        cores = c.cpu_cores[i] if i < len(c.cpu_cores) else str(i % (os.cpu_count() or 1))
        argv = [
            *_prorsa(), "worker",
            "--model", str(c.model), "--name", name, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_MODEL,
            "--role", role.value, "--redis-url", c.redis_url, "--cluster", self._cluster_ref(),
            "--switch-mode", c.switch_mode, "--kv-buffer-device", "cpu",
            "--side-channel-port", str(free_port()),
            "--cpu-cores", cores,
            "--kv-cache-gib", str(c.kv_cache_gib),
            "--log-file", str(c.workdir / f"{name}.engine.log"),
            "--drain-timeout", "30",
            "--role-args", json.dumps({r.value: list(a) for r, a in c.role_args.items()}),
            "--", "--max-model-len", str(c.max_model_len),
        ]  # fmt: skip
        if not c.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        argv += list(c.engine_args)
        child = Child(name, argv, c.workdir / f"{name}.agent.log").start()
        handle = WorkerHandle(name, port, child)
        self.workers.append(handle)
        return handle

    def start_router(self) -> Child:
        """Start the router; a restart keeps its port (clients keep their endpoint)."""
        c = self.cfg
        self.router_port = self.router_port or free_port()
        argv = [
            *_prorsa(), "router", "--host", "127.0.0.1", "--port", str(self.router_port),
            "--cluster", self._cluster_ref(), "--redis-url", c.redis_url,
            "--discovery", "registry", "--tokenizer", str(c.model),
            "--switch-mode", c.switch_mode,
        ]  # fmt: skip
        self.router = Child("router", argv, c.workdir / "router.log").start()
        return self.router

    def start(self) -> LocalStack:
        for i, role in enumerate(self.cfg.roles):
            self.start_worker(i, role)
        self.start_router()
        return self

    def ready_workers(self) -> int:
        status, body = _get_json(self.router_url + "/readyz")
        n = body.get("ready_workers", 0) if status in (200, 503) else 0
        return n if isinstance(n, int) else 0

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until the router sees every worker ready (first starts compile: minutes on CPU)."""
        assert self.router is not None
        want = len(self.workers)

        def all_ready() -> bool:
            for w in self.workers:
                if not w.child.alive:
                    raise RuntimeError(f"{w.name} exited during startup:\n{w.child.tail()}")
            return self.ready_workers() >= want

        self.router.wait_until(all_ready, timeout_s, f"{want} ready workers")

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(10)
        for w in self.workers:
            w.child.stop(40)

    def __enter__(self) -> LocalStack:
        """Start the workers and the router and wait until all are ready; stop on exit."""
        try:
            self.start().wait_ready(900)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
