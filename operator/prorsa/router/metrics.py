"""The router's Prometheus metrics, in its own registry (one scrape shows only Prorsa's).

Counters and histograms are updated on the request path; gauges that mirror state (in-flight
per worker, pool sizes, the event writer's counts) are read from that state at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prorsa.events.stream import EventWriter
from prorsa.router.pool import Pool

disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created series double a scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _StateCollector(Collector):
    def __init__(self, pool: Pool, writer: Callable[[], EventWriter | None]) -> None:
        self.pool = pool
        self.writer = writer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        inflight = GaugeMetricFamily(
            "prorsa_router_inflight", "Requests in flight per worker and phase",
            labels=["worker", "role", "phase"],
        )  # fmt: skip
        workers = GaugeMetricFamily(
            "prorsa_router_workers", "Workers known to the router by role and state",
            labels=["role", "state"],
        )  # fmt: skip
        counts: dict[tuple[str, str], int] = {}
        for w in self.pool.workers.values():
            role = w.ep.role.value
            inflight.add_metric([w.name, role, "prefill"], w.prefill_inflight)
            inflight.add_metric([w.name, role, "decode"], w.decode_inflight)
            state = (
                "ejected" if w.ejected else "draining" if w.ep.draining
                else "ready" if w.ep.ready else "starting"
            )  # fmt: skip
            counts[(role, state)] = counts.get((role, state), 0) + 1
        for (role, state), n in sorted(counts.items()):
            workers.add_metric([role, state], n)
        yield inflight
        yield workers
        wr = self.writer()
        if wr is not None:
            written = CounterMetricFamily(
                "prorsa_router_events_written", "Lifecycle events written to Redis"
            )
            written.add_metric([], wr.written)
            dropped = CounterMetricFamily(
                "prorsa_router_events_dropped", "Lifecycle events lost (Redis away too long)"
            )
            dropped.add_metric([], wr.dropped)
            pending = GaugeMetricFamily(
                "prorsa_router_events_pending", "Lifecycle events buffered, not yet written"
            )
            pending.add_metric([], wr.pending)
            yield written
            yield dropped
            yield pending


class RouterMetrics:
    def __init__(self, pool: Pool, writer: Callable[[], EventWriter | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prorsa_router_requests", "Requests by API, path (split/local) and status",
            ["kind", "path", "code"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "prorsa_router_request_seconds", "End-to-end request latency",
            ["path"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "prorsa_router_ttft_seconds", "Time to first token (non-streamed: to the answer)",
            ["path"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "prorsa_router_prompt_tokens", "Prompt tokens served", registry=r
        )
        self.completion_tokens = Counter(
            "prorsa_router_completion_tokens", "Completion tokens served", registry=r
        )
        self.retries = Counter(
            "prorsa_router_retries", "Turn attempts retried on another worker", ["reason"],
            registry=r,
        )  # fmt: skip
        self.ejections = Counter(
            "prorsa_router_ejections", "Workers taken out of rotation", ["worker"], registry=r
        )
        self.stream_errors = Counter(
            "prorsa_router_stream_errors", "Streams ended by an error event after data was sent",
            registry=r,
        )  # fmt: skip
        self.client_gone = Counter(
            "prorsa_router_client_disconnects", "Streams the client closed before the end",
            registry=r,
        )  # fmt: skip
        self.bad_requests = Counter(
            "prorsa_router_bad_requests", "Requests rejected as invalid", ["status"], registry=r
        )
        r.register(_StateCollector(pool, writer))

    def finished(self, kind: str, path: str, code: int, seconds: float) -> None:
        self.requests.labels(kind=kind, path=path, code=str(code)).inc()
        if code < 400:
            self.latency.labels(path=path).observe(seconds)

    def tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
