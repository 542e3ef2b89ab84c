"""The `workers` hash: in-flight prefill/decode requests per worker, as each router sees them.

Every router replica writes its own fields `<worker>|<router>` (value: JSON
`{"prefill": n, "decode": n, "ts": unix}`), so replicas never overwrite each other; a reader
sums the fresh fields of each worker and ignores those of a router that stopped reporting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from redis.asyncio import Redis


@dataclass(frozen=True, slots=True)
class Inflight:
    prefill: int = 0
    decode: int = 0
    as_of: float = 0.0  # oldest report summed here: every router had seen the world by then

    @property
    def total(self) -> int:
        return self.prefill + self.decode


def field(worker: str, router: str) -> str:
    return f"{worker}|{router}"


def value(prefill: int, decode: int, ts: float) -> str:
    return json.dumps({"prefill": prefill, "decode": decode, "ts": round(ts, 3)})


def parse(
    raw: Mapping[bytes | str, bytes | str], now: float, max_age_s: float
) -> dict[str, Inflight]:
    """Sum fresh per-router entries by worker; malformed or stale entries are ignored."""
    out: dict[str, Inflight] = {}
    for k, v in raw.items():
        key = k.decode(errors="replace") if isinstance(k, bytes) else k
        worker, sep, _router = key.rpartition("|")
        try:
            d = json.loads(v)
            p, dc, ts = int(d["prefill"]), int(d["decode"]), float(d["ts"])
        except (ValueError, KeyError, TypeError):
            continue
        if not sep or now - ts > max_age_s:
            continue
        cur = out.get(worker)
        if cur is None:
            out[worker] = Inflight(p, dc, ts)
        else:
            out[worker] = Inflight(cur.prefill + p, cur.decode + dc, min(cur.as_of, ts))
    return out


async def read(redis: Redis, key: str, max_age_s: float = 5.0) -> dict[str, Inflight]:
    return parse(await redis.hgetall(key), time.time(), max_age_s)
