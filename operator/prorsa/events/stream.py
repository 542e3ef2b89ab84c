"""The lifecycle event stream: written by routers without ever slowing a request, read by the
controller through a consumer group.

`EventWriter.emit` only appends to a bounded in-memory buffer; a background task sends the
buffer in pipelined batches. If Redis is away the buffer keeps the newest events (the oldest are
dropped and counted) and the writer retries with backoff, so requests are served throughout and
late events still reach the controller, whose lifecycle table tolerates lateness and duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from prorsa.cancellation import raise_if_cancelled, sleep
from prorsa.events.schema import EventError, decode, encode
from prorsa.policy.events import Event

log = logging.getLogger(__name__)


class EventWriter:
    def __init__(
        self,
        redis: Redis,
        key: str,
        *,
        max_buffer: int = 20_000,
        batch: int = 512,
        maxlen: int = 1_000_000,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.redis = redis
        self.key = key
        self.batch = batch
        self.maxlen = maxlen
        self.max_backoff_s = max_backoff_s
        self._buf: deque[dict[str, str]] = deque()
        self._max_buffer = max_buffer
        self._wake = asyncio.Event()
        self.written = 0
        self.dropped = 0
        self.healthy = True
        self.last_error: str | None = None
        self.last_flush_at = 0.0

    @property
    def pending(self) -> int:
        return len(self._buf)

    def emit(self, ev: Event) -> None:
        """Queue one event; never blocks, never raises."""
        if len(self._buf) >= self._max_buffer:
            self._buf.popleft()
            self.dropped += 1
        self._buf.append(encode(ev))
        self._wake.set()

    async def _send(self, entries: list[dict[str, str]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
        await pipe.execute()

    async def flush(self) -> bool:
        """Send everything buffered; False (events kept for a retry) when Redis failed."""
        while self._buf:
            entries = [self._buf[i] for i in range(min(self.batch, len(self._buf)))]
            try:
                await self._send(entries)
            except (RedisError, OSError) as e:
                if self.healthy:
                    log.warning("event stream unavailable, buffering events: %s", e)
                self.healthy = False
                self.last_error = str(e)
                return False
            for _ in entries:  # emit() may have dropped from the left meanwhile
                if self._buf:
                    self._buf.popleft()
            self.written += len(entries)
            if not self.healthy:
                log.info("event stream back; %d events dropped while away", self.dropped)
            self.healthy = True
            self.last_flush_at = time.time()
        return True

    async def run(self) -> None:
        """Background loop: flush whenever events arrive, back off while Redis is away."""
        backoff = 0.1
        while True:
            raise_if_cancelled()
            await self._wake.wait()
            self._wake.clear()
            if await self.flush():
                backoff = 0.1
                continue
            self._wake.set()
            await sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Last flush on shutdown; whatever cannot be sent is counted as dropped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout_s)
        self.dropped += len(self._buf)
        self._buf.clear()


class EventReader:
    """Reads the stream through a consumer group, so a restarted controller resumes where it
    stopped instead of replaying history; what it consumed is acknowledged.

    Entries that are not valid events are skipped, counted and acknowledged (never fatal):
    one bad producer must not stall the controller.
    """

    def __init__(
        self,
        redis: Redis,
        key: str,
        group: str = "prorsa-controller",
        consumer: str = "controller",
        batch: int = 5000,
    ) -> None:
        self.redis = redis
        self.key = key
        self.group = group
        self.consumer = consumer
        self.batch = batch
        self.read_total = 0
        self.malformed = 0
        self._pending_first = True  # entries delivered to us before a crash, not yet acked
        self._unacked: list[bytes | str] = []

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read(self, block_ms: int = 0) -> list[Event]:
        """The next events (waits up to `block_ms` when there are none)."""
        if self._pending_first:
            entries = await self._xread("0", None)
            if len(entries) < self.batch:
                self._pending_first = False  # caught up with what a previous run left unacked
            if entries:
                return self._decode(entries)
        return self._decode(await self._xread(">", block_ms if block_ms > 0 else None))

    async def _xread(self, start: str, block_ms: int | None) -> list[Any]:
        reply: Any = await self.redis.xreadgroup(
            self.group, self.consumer, {self.key: start}, count=self.batch, block=block_ms
        )
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3 shape
            return list(next(iter(reply.values()))[0])
        return list(reply[0][1])

    def _decode(self, entries: list[Any]) -> list[Event]:
        events: list[Event] = []
        for entry_id, fields in entries:
            self._unacked.append(entry_id)
            try:
                if not fields:  # trimmed from the stream after delivery
                    raise EventError("entry no longer in the stream")
                events.append(decode(fields))
            except EventError as e:
                self.malformed += 1
                if self.malformed <= 10 or self.malformed % 1000 == 0:
                    log.warning("skipping malformed event %s (%d so far): %s",
                                entry_id, self.malformed, e)  # fmt: skip
        self.read_total += len(events)
        return events

    async def ack(self) -> None:
        """Acknowledge everything read so far (call after it has been applied)."""
        if self._unacked:
            ids, self._unacked = self._unacked, []
            await self.redis.xack(self.key, self.group, *ids)

    async def lag(self) -> int | None:
        """Entries in the stream this group has not read yet (Redis 7+), else None."""
        for g in await self.redis.xinfo_groups(self.key):
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == self.group:
                lag = g.get("lag")
                return int(lag) if lag is not None else None
        return None
