"""The router's HTTP surface (aiohttp) and its background tasks.

aiohttp serves and calls on one event loop with one dependency: a streaming server, a pooled
streaming client, low per-request overhead (no ASGI layer), and vLLM's own PD proxies use its
client. Background tasks: discovery → pool, the event writer, the in-flight reporter, the
prober that re-admits ejected workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from prorsa.cancellation import sleep
from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventWriter
from prorsa.policy.placement import PlacementSettings
from prorsa.router.discovery import Discovery
from prorsa.router.flow import Flow, probe
from prorsa.router.metrics import RouterMetrics
from prorsa.router.placement import Placement
from prorsa.router.pool import Pool
from prorsa.router.requests import ApiError, Kind, parse_turn
from prorsa.router.tokens import TokenCounter
from prorsa.router.trajectories import Trajectories

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    keys: ClusterKeys
    redis_url: str | None = None  # None: serve without events (counted as dropped: none made)
    routing_switch: bool = True  # switch mode `routing` (kv_both) vs `restart`
    max_body_bytes: int = 32 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    inflight_interval_s: float = 0.5
    probe_interval_s: float = 0.5
    eject_s: float = 2.0  # first probe of an ejected worker; doubles per failed probe
    router_id: str = field(default_factory=socket.gethostname)
    placement: PlacementSettings = field(default_factory=PlacementSettings)


_HINTS = ("tool_start", "tool_end", "end")


class Router:
    def __init__(
        self, config: RouterConfig, discovery: Discovery, counter: TokenCounter | None = None
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.pool = Pool(eject_s=config.eject_s)
        self.trajectories = Trajectories(None, counter or TokenCounter())
        self.placement = Placement(self.pool, config.placement, self.trajectories.hosted)
        self.redis: Redis | None = None
        self.writer: EventWriter | None = None
        self.metrics = RouterMetrics(self.pool, lambda: self.writer)
        self.flow: Flow | None = None
        self._discovered = asyncio.Event()

    # ---- lifecycle --------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/prorsa/v1/trajectories/{traj}/{action}", self._hint)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.cleanup_ctx.append(self._context)
        app.middlewares.append(self._errors)
        return app

    async def _context(self, app: web.Application) -> AsyncIterator[None]:
        c = self.config
        session = aiohttp.ClientSession(
            # keep-alive shorter than the workers' (uvicorn: 5 s), so the router never reuses
            # a connection the worker is closing
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=3.0),
            timeout=aiohttp.ClientTimeout(
                total=c.upstream_timeout_s, sock_connect=c.connect_timeout_s
            ),
        )
        tasks = [asyncio.create_task(self._discover(), name="discovery")]
        if c.redis_url:
            self.redis = Redis.from_url(c.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
            self.writer = EventWriter(self.redis, c.keys.events)
            self.trajectories.writer = self.writer
            tasks += [
                asyncio.create_task(self.writer.run(), name="events"),
                asyncio.create_task(self._report_inflight(), name="inflight"),
            ]
        self.flow = Flow(
            self.pool,
            self.placement,
            self.trajectories,
            self.metrics,
            session,
            routing_switch=c.routing_switch,
        )
        tasks.append(asyncio.create_task(self._probe_ejected(session), name="prober"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.writer is not None:
                await self.writer.aclose()
            if self.redis is not None:
                with contextlib.suppress(RedisError, OSError):
                    owners = {w.ep.owner for w in self.pool.workers.values()}
                    fields = [inflight.field(o, c.router_id) for o in owners]
                    if fields:
                        await self.redis.hdel(c.keys.workers, *fields)
                await self.redis.aclose()
            await session.close()

    async def _discover(self) -> None:
        async for snapshot in self.discovery.watch():
            before = {n: w.serves_decode(True) for n, w in self.pool.workers.items()}
            self.pool.update(snapshot)
            for name, decoded in before.items():
                w = self.pool.workers.get(name)
                if decoded and (w is None or not w.serves_decode(True)):
                    self.trajectories.forget_worker(name)
            log.info(
                "workers: %s",
                ", ".join(
                    f"{e.name}={e.role.value}{'(draining)' if e.draining else ''}"
                    f"{'' if e.ready else '(not ready)'}"
                    for e in snapshot
                )
                or "none",
            )
            self._discovered.set()

    async def _report_inflight(self) -> None:
        """Write this router's in-flight counts per worker to the `workers` hash (a worker
        running several engines reports their sum)."""
        assert self.redis is not None
        c = self.config
        failing = False
        known: set[str] = set()
        while True:
            await sleep(c.inflight_interval_s)
            now = time.time()
            counts: dict[str, tuple[int, int]] = {}
            for w in self.pool.workers.values():
                p, d = counts.get(w.ep.owner, (0, 0))
                counts[w.ep.owner] = (p + w.prefill_inflight, d + w.decode_inflight)
            mapping = {
                inflight.field(owner, c.router_id): inflight.value(p, d, now)
                for owner, (p, d) in counts.items()
            }
            gone = [inflight.field(n, c.router_id) for n in known - set(counts)]
            try:
                pipe = self.redis.pipeline(transaction=False)
                if mapping:
                    pipe.hset(c.keys.workers, mapping=mapping)  # type: ignore[arg-type]
                if gone:
                    pipe.hdel(c.keys.workers, *gone)
                await pipe.execute()
                known = set(counts)
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("cannot report in-flight counts to Redis: %s", e)
                failing = True

    async def _probe_ejected(self, session: aiohttp.ClientSession) -> None:
        while True:
            await sleep(self.config.probe_interval_s)
            for w in self.pool.due_for_probe(time.monotonic()):
                if await probe(session, w):
                    log.info("worker %s answers again: back in rotation", w.name)
                    self.pool.readmit(w)
                else:
                    self.pool.eject(w)

    # ---- handlers ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error a client can cause gets the OpenAI error shape and a counter."""
        try:
            return await handler(request)
        except ApiError as e:
            if e.status < 500:
                self.metrics.bad_requests.labels(status=str(e.status)).inc()
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # aiohttp's own 404 / 405 / 413
            if e.status < 400:
                raise
            self.metrics.bad_requests.labels(status=str(e.status)).inc()
            return web.json_response(ApiError(e.status, e.reason).body(), status=e.status)

    async def _turn(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"request body larger than {self.config.max_body_bytes} bytes"
            ) from None
        turn = parse_turn(kind, raw, request.headers)
        assert self.flow is not None
        return await self.flow.serve(request, turn)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, Kind.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, Kind.CHAT)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """Proxied from any healthy worker (they all serve the same model)."""
        assert self.flow is not None
        for w in self.pool.workers.values():
            if w.healthy:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.flow.session.get(w.ep.url + "/v1/models") as r:
                        return web.Response(
                            status=r.status, body=await r.read(), content_type="application/json"
                        )
        raise ApiError(503, "no ready worker", type_="unavailable")

    async def _hint(self, request: web.Request) -> web.StreamResponse:
        traj, action = request.match_info["traj"], request.match_info["action"]
        if action not in _HINTS:
            raise ApiError(
                404, f"unknown trajectory action {action!r}; use one of {', '.join(_HINTS)}"
            )
        if len(traj) > 256:
            raise ApiError(400, "trajectory id longer than 256 characters")
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ApiError(400, "hint body must be JSON (or empty)") from None
        if not isinstance(body, dict):
            raise ApiError(400, "hint body must be a JSON object")
        if action == "tool_start":
            expected = body.get("expected_seconds")
            if expected is not None and (
                not isinstance(expected, int | float) or isinstance(expected, bool) or expected < 0
            ):
                raise ApiError(400, "'expected_seconds' must be a number >= 0", "expected_seconds")
            self.trajectories.tool_start(traj, None if expected is None else float(expected))
        elif action == "tool_end":
            self.trajectories.tool_end(traj)
        else:
            reason = body.get("reason", "end")
            if not isinstance(reason, str) or not reason or len(reason) > 64:
                raise ApiError(400, "'reason' must be a short string", "reason")
            self.trajectories.end(traj, reason)
        return web.json_response({"trajectory": traj, "event": action}, status=202)

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.StreamResponse:
        ready = self.pool.ready_count
        body = {"ready_workers": ready, "workers": len(self.pool.workers)}
        if self.writer is not None:
            body["events_healthy"] = self.writer.healthy
        return web.json_response(body, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
