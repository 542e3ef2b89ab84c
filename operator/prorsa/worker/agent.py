"""The worker agent: start vLLM in its role, report readiness, restart it when it dies or when
its new role runs other engine arguments (its NIXL role in `restart` switch mode, or the
role's own parallelism and batch limits), and drain it gracefully on SIGTERM.

Readiness is only ever "the engine answers /health": it is published in the local registry
and on the agent's own probe port (`/readyz`, for the kubelet), so no request is routed to an
engine that is starting, restarting or draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp
from aiohttp import web
from redis.exceptions import RedisError

from prorsa.local.registry import Registry
from prorsa.policy.allocate import Role
from prorsa.worker.engine import (
    EngineSpec,
    command,
    headless,
    kv_role,
    parse_cores,
    restart_needed,
)
from prorsa.worker.roles import RoleSource

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    name: str
    spec: EngineSpec
    initial_role: Role
    advertise_url: str  # how the router reaches the engine
    probe_port: int | None = None  # the agent's own /healthz and /readyz (Kubernetes probes)
    log_path: Path | None = None  # engine output (default: inherited)
    startup_timeout_s: float = 900.0
    drain_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0
    role_poll_s: float = 1.0
    unhealthy_after_s: float = 60.0  # a live process whose /health fails this long is restarted
    max_backoff_s: float = 30.0


def pin_process_group(pgid: int, cores: set[int]) -> int:
    """Bind every thread of every process in the engine's group to `cores`; returns how many.

    vLLM binds its compute threads itself, but on CPU its NIXL worker then moves the calling
    thread to the last core of each NUMA node, so every engine on a host would compute on
    the same core. Re-binding the whole group after start-up keeps engines on their own cores.
    """
    pinned = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after "(comm)": state, ppid, pgrp, ...
                continue
            for task in (stat.parent / "task").iterdir():
                os.sched_setaffinity(int(task.name), cores)
                pinned += 1
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to change
    return pinned


async def engine_metrics_text(
    url: str, session: aiohttp.ClientSession | None = None, timeout_s: float = 5.0
) -> str | None:
    """The engine's Prometheus metrics as text; None when it does not answer."""
    try:
        if session is None:
            async with aiohttp.ClientSession() as s:
                return await engine_metrics_text(url, s, timeout_s)
        async with session.get(
            url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def engine_requests(url: str, session: aiohttp.ClientSession | None = None) -> int | None:
    """Requests running or waiting in the engine (its Prometheus metrics); None when it does
    not answer."""
    text = await engine_metrics_text(url, session)
    if text is None:
        return None
    busy = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            with contextlib.suppress(ValueError, IndexError):
                busy += float(line.rsplit(" ", 1)[1])
    return round(busy)


async def engine_idle(session: aiohttp.ClientSession, url: str) -> bool:
    """True when the engine has nothing running or waiting (or does not answer at all)."""
    return not await engine_requests(url, session)


class Agent:
    def __init__(
        self, config: AgentConfig, roles: RoleSource, registry: Registry | None = None
    ) -> None:
        self.cfg = config
        self.roles = roles
        self.registry = registry
        self.role = config.initial_role
        self.ready = False
        self.restarts = 0
        self.stopping = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def headless(self) -> bool:
        """Ranks without an API of their own in the current role (their engine's first node
        serves and drains it); a node that heads an engine in one role may not in another."""
        return headless(self.cfg.spec, self.role)

    # ---- readiness --------------------------------------------------------------------------

    async def _publish_ready(self, ready: bool) -> None:
        self.ready = ready
        if self.registry is not None:
            try:
                await self.registry.set_ready(self.cfg.name, ready)
            except (RedisError, OSError) as e:
                log.warning("cannot publish readiness to the registry: %s", e)

    async def _register(self) -> None:
        """Retry until the registry answers: a worker nobody can find is useless."""
        assert self.registry is not None
        delay = 0.5
        while not self.stopping.is_set():
            try:
                await self.registry.register(self.cfg.name, self.cfg.advertise_url, self.role)
                self.role = await self.registry.role(self.cfg.name) or self.role
                return
            except (RedisError, OSError) as e:
                log.warning("registry unavailable (%s); retrying in %.1fs", e, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                delay = min(delay * 2, 10.0)

    # ---- the engine process -----------------------------------------------------------------

    async def _start(self) -> asyncio.subprocess.Process:
        argv, extra_env = command(self.cfg.spec, self.role)
        log.info("starting vLLM as %s (%s): %s", self.role.value, kv_role(self.cfg.spec, self.role),
                 " ".join(argv[1:]))  # fmt: skip
        out: IO[bytes] | int | None = None
        if self.cfg.log_path is not None:
            self._log = self._log or self.cfg.log_path.open("ab")
            out = self._log
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, **extra_env},
            stdout=out,
            stderr=asyncio.subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # its own process group: the engine core dies with it
        )
        if self.registry is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.registry.set_engine_pid(self.cfg.name, proc.pid)
        return proc

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.cfg.stop_timeout_s)
        except TimeoutError:
            log.warning("vLLM did not stop in %.0fs; killing it", self.cfg.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        with contextlib.suppress(ProcessLookupError):  # stragglers of its group
            os.killpg(proc.pid, signal.SIGKILL)

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        if self.headless:  # no API of its own: its ranks live while the process does
            return self._proc is not None and self._proc.returncode is None
        try:
            async with session.get(
                self.cfg.advertise_url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _supervise(
        self, proc: asyncio.subprocess.Process, session: aiohttp.ClientSession
    ) -> str:
        """Watch one engine run; return why it ended: "stop", "crash" or "role"."""
        started = time.monotonic()
        last_ok = started
        next_role_poll = 0.0
        next_heartbeat = started + 5.0
        exited = asyncio.create_task(proc.wait())
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while True:
                await asyncio.wait({exited, stop}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                if stop.done():
                    return "stop"
                if exited.done():
                    log.error("vLLM exited with code %s", proc.returncode)
                    return "crash"
                now = time.monotonic()
                if await self._healthy(session):
                    last_ok = now
                    if not self.ready:
                        log.info("vLLM ready as %s after %.1fs", self.role.value, now - started)
                        self._pin(proc.pid)
                        await self._publish_ready(True)
                elif self.ready and now - last_ok > self.cfg.unhealthy_after_s:
                    log.error("vLLM stopped answering /health for %.0fs", now - last_ok)
                    return "crash"
                elif not self.ready and now - started > self.cfg.startup_timeout_s:
                    log.error("vLLM not ready after %.0fs", self.cfg.startup_timeout_s)
                    return "crash"
                if now >= next_role_poll:
                    next_role_poll = now + self.cfg.role_poll_s
                    if await self._role_changed():
                        return "role"
                if now >= next_heartbeat:
                    next_heartbeat = now + 5.0
                    await self._heartbeat()
        finally:
            stop.cancel()
            if not exited.done():
                exited.cancel()

    async def _heartbeat(self) -> None:
        if self.registry is None:
            return
        try:
            if await self.registry.heartbeat(self.cfg.name, self.cfg.advertise_url, self.role,
                                             self.ready):  # fmt: skip
                log.warning("registry entry was gone (Redis restarted?): registered again")
        except (RedisError, OSError):
            pass  # Redis away: the router keeps its last snapshot; try again next beat

    def _pin(self, pgid: int) -> None:
        if self.cfg.spec.cpu_cores is None or not hasattr(os, "sched_setaffinity"):
            return
        cores = parse_cores(self.cfg.spec.cpu_cores)
        n = pin_process_group(pgid, cores)
        log.info("bound %d engine threads to cores %s", n, self.cfg.spec.cpu_cores)

    async def _role_changed(self) -> bool:
        """Adopt a new role; True when the engine must restart to take it."""
        new = await self.roles.current()
        if new is None or new is self.role:
            return False
        restart = restart_needed(self.cfg.spec, self.role, new)
        log.info("role %s -> %s%s", self.role.value, new.value,
                 " (restarting vLLM)" if restart else "")  # fmt: skip
        self.role = new
        return restart

    async def _drain(self, session: aiohttp.ClientSession) -> None:
        """Stop taking work, then wait for the engine's running and queued requests."""
        await self._publish_ready(False)
        if self.headless:
            return  # the first node drains the engine's requests
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while time.monotonic() < deadline:
            if await engine_idle(session, self.cfg.advertise_url):
                log.info("drained")
                return
            await asyncio.sleep(0.5)
        log.warning("drain timed out after %.0fs; stopping anyway", self.cfg.drain_timeout_s)

    # ---- main loop --------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        probe = await self._serve_probes()
        try:
            if self.registry is not None:
                await self._register()
            self.role = await self.roles.current() or self.role
            async with aiohttp.ClientSession() as session:
                await self._loop(session)
        finally:
            await self._publish_ready(False)
            if probe is not None:
                await probe.cleanup()
            if self._log is not None:
                self._log.close()
        return 0

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            proc = self._proc = await self._start()
            ran_from = time.monotonic()
            why = await self._supervise(proc, session)
            if why == "stop":
                if proc.returncode is None:
                    await self._drain(session)
                await self._terminate(proc)
                return
            if why == "role" and proc.returncode is None:
                await self._drain(session)  # KV a decode still pulls, requests still queued
            await self._publish_ready(False)
            await self._terminate(proc)
            if why == "role":
                continue
            self.restarts += 1
            if time.monotonic() - ran_from > 300:
                backoff = 1.0
            log.warning("restarting vLLM in %.0fs (restart %d)", backoff, self.restarts)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), backoff)
            backoff = min(backoff * 2, self.cfg.max_backoff_s)

    async def _serve_probes(self) -> web.AppRunner | None:
        if not self.cfg.probe_port:
            return None

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "restarts": self.restarts})

        async def readyz(_: web.Request) -> web.Response:
            body = {"ready": self.ready, "role": self.role.value}
            return web.json_response(body, status=200 if self.ready else 503)

        async def role(_: web.Request) -> web.Response:
            """What the other nodes of a multi-node engine follow."""
            return web.json_response({"role": self.role.value, "ready": self.ready})

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/role", role)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", self.cfg.probe_port).start()
        return runner
