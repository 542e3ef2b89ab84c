"""Writing lifecycle events to the Redis stream without ever slowing a request.

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

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prorsa.events.schema import encode
from prorsa.policy.lifecycle import Event

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
            await self._wake.wait()
            self._wake.clear()
            if await self.flush():
                backoff = 0.1
                continue
            self._wake.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Last flush on shutdown; whatever cannot be sent is counted as dropped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout_s)
        self.dropped += len(self._buf)
        self._buf.clear()
