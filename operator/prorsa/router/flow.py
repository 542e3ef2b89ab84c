"""The PD request flow: prefill on one worker, KV pulled over NIXL, decode on another.

    prefill worker  ← body + max_tokens=1 + kv_transfer_params{do_remote_decode}
                    → kv_transfer_params (where its KV blocks are)
    decode worker   ← body + those kv_transfer_params   (pulls the KV, then decodes)

A turn that placement keeps whole goes to one worker unchanged. Failures before the client has
seen a byte are retried on a fresh plan (the failed worker excluded, and ejected if it did not
answer at all); a stream that breaks after bytes were sent ends with an explicit error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from prorsa.router.metrics import RouterMetrics
from prorsa.router.placement import Placement, Plan
from prorsa.router.pool import Pool, Worker
from prorsa.router.requests import ApiError, Turn
from prorsa.router.trajectories import Trajectories, TurnRecord

log = logging.getLogger(__name__)

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_RETRYABLE_STATUS = (502, 503, 504)  # the worker (not the request) is at fault
_RETRY_BACKOFF_S = (0.1, 0.5, 1.0, 2.0)  # between attempts of one turn (~3.6 s in all)
_STRIKES_TO_EJECT = 3  # consecutive transient failures that take a worker out of rotation
_PROBE_AFTER_LOSS_S = 2.0  # /health timeout after a lost connection (vLLM answers in ~ms)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class WorkerFailed(Exception):
    def __init__(
        self, worker: Worker, reason: str, eject: bool, connection_lost: bool = False
    ) -> None:
        super().__init__(f"worker {worker.name}: {reason}")
        self.worker = worker
        self.eject = eject
        self.connection_lost = connection_lost  # no HTTP answer at all (reset, timeout, EOF)


class UpstreamRejected(Exception):
    """The worker refused the request itself (4xx): the client gets that answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


def _check(w: Worker, status: int, data: bytes) -> None:
    if status >= 500:
        raise WorkerFailed(w, f"HTTP {status}: {data[:200]!r}", eject=False)
    if status >= 400:
        raise UpstreamRejected(status, data)


def _connection_failed(w: Worker, e: BaseException) -> WorkerFailed:
    """Nothing listening means the worker is gone: eject at once. Timeouts, resets and closed
    keep-alive connections happen to live but busy workers too: the caller asks /health
    before it ejects (`Flow._settle`)."""
    refused = isinstance(e, aiohttp.ClientConnectorError) and isinstance(
        e.os_error, ConnectionRefusedError
    )
    return WorkerFailed(w, f"{type(e).__name__}: {e}", eject=refused, connection_lost=True)


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Complete server-sent events (`data: ...` lines up to a blank line)."""
    buf: list[bytes] = []
    async for line in content:
        if line.strip():
            buf.append(line)
        elif buf:
            yield b"".join(buf) + b"\n"
            buf = []
    if buf:
        yield b"".join(buf) + b"\n"


def _error_event(message: str) -> bytes:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def _path(plan: Plan) -> str:
    """The metrics' name for how a turn ran: `split` (prefill pool, then decode), `handoff`
    (the worker a trajectory left prefills it for the new one) or `local` (one worker)."""
    if plan.prefill is None:
        return "local"
    return "handoff" if plan.handoff else "split"


def _asks_for_tool(resp: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") == "tool_calls" for c in resp.get("choices") or ())


class Flow:
    def __init__(
        self,
        pool: Pool,
        placement: Placement,
        trajectories: Trajectories,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        *,
        routing_switch: bool = True,
        max_attempts: int = 5,
    ) -> None:
        self.pool = pool
        self.placement = placement
        self.trajectories = trajectories
        self.metrics = metrics
        self.session = session
        self.routing_switch = routing_switch
        self.max_attempts = max_attempts

    # ---- one turn, with retries -----------------------------------------------------------

    async def serve(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        rec = self.trajectories.begin(turn, self.routing_switch)
        avoid: set[str] = set()  # failed this turn: other workers first, these if none is left
        reason = "no ready worker"
        submitted = False
        t0 = time.monotonic()
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(_RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S)) - 1])
            plan = self.placement.plan(rec.facts, frozenset(avoid)) or self.placement.plan(
                rec.facts
            )
            if plan is None:
                continue
            if not submitted:  # once per turn, whatever the retries
                self.trajectories.submitted(rec, plan)
                submitted = True
            path = _path(plan)
            try:
                if turn.stream:
                    resp = await self._stream(request, turn, rec, plan, t0)
                else:
                    resp = await self._unary(turn, rec, plan, t0)
                self.metrics.finished(turn.kind, path, 200, time.monotonic() - t0)
                for w in (plan.decode, plan.prefill):
                    if w is not None:
                        w.strikes = 0
                return resp
            except WorkerFailed as e:
                reason = str(e)
                log.warning("turn of %s failed on %s (attempt %d)", rec.traj, reason, attempt + 1)
                self.metrics.retries.labels(reason="eject" if e.eject else "error").inc()
                e.worker.strikes += 1
                if await self._should_eject(e):
                    self._eject(e.worker)
                avoid.add(e.worker.name)
                self.trajectories.failed(rec)
            except UpstreamRejected as e:
                self.metrics.finished(turn.kind, path, e.status, time.monotonic() - t0)
                return web.Response(status=e.status, body=e.body, content_type="application/json")
        self.trajectories.failed(rec)
        self.metrics.finished(turn.kind, "none", 503, time.monotonic() - t0)
        raise ApiError(503, f"no worker could serve the request: {reason}", type_="unavailable")

    async def _should_eject(self, e: WorkerFailed) -> bool:
        """Refused connections and repeated failures eject. A connection that broke without an
        answer (an engine killed mid-request resets its sockets) ejects when /health does not
        answer either; a live but busy engine answers it and only takes a strike."""
        if e.eject or e.worker.strikes >= _STRIKES_TO_EJECT:
            return True
        return e.connection_lost and not await probe(self.session, e.worker, _PROBE_AFTER_LOSS_S)

    def _eject(self, w: Worker) -> None:
        if not w.ejected:
            log.warning("ejecting worker %s (%s) until it answers /health", w.name, w.ep.url)
            self.metrics.ejections.labels(worker=w.name).inc()
        self.pool.eject(w)
        self.trajectories.forget_worker(w.name)

    # ---- the two phases -------------------------------------------------------------------

    async def _post(
        self, w: Worker, turn: Turn, body: dict[str, Any]
    ) -> tuple[bytes, dict[str, Any]]:
        """(raw answer, parsed answer); raw is what the client gets, byte for byte."""
        try:
            async with self.session.post(w.ep.url + turn.kind.path, json=body) as r:
                data = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _connection_failed(w, e) from e
        _check(w, status, data)
        try:
            out = json.loads(data)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise WorkerFailed(w, "answered with invalid JSON", eject=False)
        return data, out

    async def _prefill(
        self, turn: Turn, rec: TurnRecord, p: Worker, handoff: bool = False
    ) -> dict[str, Any]:
        """Run the prefill; return the KV transfer parameters for the decode worker. In a
        handoff `p` holds the context and computes only the turn's new tokens.

        The caller keeps `p.prefill_inflight` raised until the decode has pulled the KV: the
        blocks live on `p` until then, so a drain of `p` must wait for the pull too.
        """
        body = dict(turn.body)
        body.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        body.pop("min_tokens", None)
        t0 = time.monotonic()
        p.queued_prefill_tokens += rec.prompt_tokens
        try:
            _, resp = await self._post(p, turn, body)
        finally:
            p.queued_prefill_tokens -= rec.prompt_tokens
        kv = resp.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise WorkerFailed(
                p, "prefill returned no kv_transfer_params (no KV connector?)", False
            )
        tokens = int((resp.get("usage") or {}).get("prompt_tokens") or rec.prompt_tokens)
        if handoff:
            tokens = self._local_prefill_tokens(rec, tokens)
        else:
            self.placement.learn_prefill_rate(tokens, time.monotonic() - t0)
        self.trajectories.prefill_done(rec, p.name, tokens)
        return kv

    def _local_prefill_tokens(self, rec: TurnRecord, prompt_tokens: int) -> int:
        """Tokens a worker holding the trajectory's context computes of this prompt."""
        return max(prompt_tokens - (rec.prompt_tokens - rec.facts.new_tokens), 1)

    async def _unary(self, turn: Turn, rec: TurnRecord, plan: Plan, t0: float) -> web.Response:
        d, p = plan.decode, plan.prefill
        body = turn.body
        if p is not None:
            p.prefill_inflight += 1
        d.decode_inflight += 1
        try:
            if p is not None:
                kv = await self._prefill(turn, rec, p, plan.handoff)
                body = {**body, "kv_transfer_params": kv}
            raw, resp = await self._post(d, turn, body)
        finally:
            d.decode_inflight -= 1
            if p is not None:
                p.prefill_inflight -= 1
        usage = resp.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        output_tokens = int(usage.get("completion_tokens") or 0)
        if p is None:  # served whole: prefill completion is only known with the answer
            held = plan.holds_prefix
            computed = self._local_prefill_tokens(rec, prompt_tokens) if held else prompt_tokens
            self.trajectories.prefill_done(rec, d.name, computed)
        self.trajectories.decode_done(
            rec, d.name, prompt_tokens, output_tokens, tool_call=_asks_for_tool(resp)
        )
        self.metrics.tokens(prompt_tokens, output_tokens)
        self.metrics.ttft.labels(path=_path(plan)).observe(time.monotonic() - t0)
        return web.Response(body=raw, content_type="application/json")

    async def _stream(
        self, request: web.Request, turn: Turn, rec: TurnRecord, plan: Plan, t0: float
    ) -> web.StreamResponse:
        d, p = plan.decode, plan.prefill
        body = dict(turn.body)
        opts = dict(body.get("stream_options") or {})
        client_wants_usage = bool(opts.get("include_usage"))
        body["stream_options"] = {**opts, "include_usage": True}
        out: web.StreamResponse | None = None
        usage: dict[str, Any] = {}
        tool_call = False
        p_held = p is not None
        if p is not None:
            p.prefill_inflight += 1
        d.decode_inflight += 1
        try:
            if p is not None:
                body["kv_transfer_params"] = await self._prefill(turn, rec, p, plan.handoff)
            try:
                async with self.session.post(d.ep.url + turn.kind.path, json=body) as r:
                    if r.status >= 400:
                        _check(d, r.status, await r.read())
                    async for event in _sse_events(r.content):
                        if out is None:
                            if p is not None and p_held:
                                p.prefill_inflight -= 1  # first token: the KV has been pulled
                                p_held = False
                            else:
                                self.trajectories.prefill_done(rec, d.name, rec.prompt_tokens)
                            self.metrics.ttft.labels(path=_path(plan)).observe(
                                time.monotonic() - t0
                            )
                            out = web.StreamResponse(headers=_SSE_HEADERS)
                            await out.prepare(request)
                        chunk = _parse_chunk(event)
                        if chunk is not None:
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                                if not chunk.get("choices") and not client_wants_usage:
                                    continue
                            tool_call = tool_call or _asks_for_tool(chunk)
                        try:
                            await out.write(event)
                        except ConnectionError:  # the client left: not the worker's fault
                            self.metrics.client_gone.inc()
                            self.trajectories.failed(rec)
                            return out
            except (aiohttp.ClientError, TimeoutError) as e:
                if out is None:
                    raise _connection_failed(d, e) from e
                self._eject(d)
                self.trajectories.failed(rec)
                self.metrics.stream_errors.inc()
                with contextlib.suppress(ConnectionError):
                    await out.write(_error_event(f"decode worker {d.name} failed mid-stream: {e}"))
                    await out.write_eof()
                return out
        finally:
            d.decode_inflight -= 1
            if p is not None and p_held:
                p.prefill_inflight -= 1
        if out is None:
            raise WorkerFailed(d, "stream ended before any data", eject=False)
        prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        output_tokens = int(usage.get("completion_tokens") or 0)
        self.trajectories.decode_done(rec, d.name, prompt_tokens, output_tokens, tool_call)
        self.metrics.tokens(prompt_tokens, output_tokens)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out


def _parse_chunk(event: bytes) -> dict[str, Any] | None:
    if not event.startswith(b"data:"):
        return None
    payload = event[5:].strip()
    if payload == b"[DONE]":
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


async def probe(session: aiohttp.ClientSession, w: Worker, timeout_s: float = 2.0) -> bool:
    """Whether an ejected worker's engine answers again."""
    try:
        async with session.get(
            w.ep.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
