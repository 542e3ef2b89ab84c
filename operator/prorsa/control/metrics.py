"""The controller's Prometheus metrics: every decision is visible (forecast, target, actual)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from prorsa.policy.capacity import RoleCapacity

_SWITCH_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.forecast_prefill = Gauge(
            "prorsa_forecast_prefill_tokens_per_second",
            "Forecast prefill work over the next step", registry=r,
        )  # fmt: skip
        self.forecast_decode = Gauge(
            "prorsa_forecast_decode_sequences", "Forecast sequences decoding at the next step",
            registry=r,
        )  # fmt: skip
        self.target = Gauge("prorsa_target_workers", "Workers the policy wants per role", ["role"],
                            registry=r)  # fmt: skip
        self.actual = Gauge("prorsa_workers", "Workers per role (draining: by target)", ["role"],
                            registry=r)  # fmt: skip
        self.switching = Gauge("prorsa_switches_in_progress", "Workers being switched",
                               registry=r)  # fmt: skip
        self.decisions = Counter("prorsa_decisions", "Allocation decisions made", registry=r)
        self.switches = Counter(
            "prorsa_switches", "Role switches by outcome", ["from_role", "to_role", "outcome"],
            registry=r,
        )  # fmt: skip
        self.switch_seconds = Histogram(
            "prorsa_switch_seconds", "Drain-to-relabel duration of completed switches",
            buckets=_SWITCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.drain_timeouts = Counter(
            "prorsa_drain_timeouts", "Switches rolled back because the drain timed out",
            registry=r,
        )  # fmt: skip
        self.events = Counter("prorsa_events_consumed", "Lifecycle events applied", registry=r)
        self.malformed = Counter(
            "prorsa_events_malformed", "Stream entries skipped as malformed", registry=r
        )
        self.lag = Gauge("prorsa_events_lag", "Stream entries not yet read by the controller",
                         registry=r)  # fmt: skip
        self.trajectories = Gauge("prorsa_trajectories_in_flight", "Trajectories tracked",
                                  registry=r)  # fmt: skip
        self.up = Gauge("prorsa_controller_redis_up", "1 when Redis answers, 0 while it does not",
                        registry=r)  # fmt: skip
        # What the allocator prices splits with, as learned from the workers (policy/learn.py)
        self.capacity = Gauge(
            "prorsa_capacity", "Learned capacity of one worker per role, by figure",
            ["figure"], registry=r,
        )  # fmt: skip
        self.capacity_evidence = Gauge(
            "prorsa_capacity_evidence",
            "What the learned capacity rests on: decayed samples, relative uncertainty (1 sd), "
            "workers reporting KV, switches seen", ["quantity"], registry=r,
        )  # fmt: skip

    def observe_capacity(self, c: RoleCapacity, evidence: dict[str, float]) -> None:
        for figure, value in capacity_figures(c).items():
            self.capacity.labels(figure).set(value)
        for quantity, value in evidence.items():
            self.capacity_evidence.labels(quantity).set(value)


def capacity_figures(c: RoleCapacity) -> dict[str, float]:
    """The figures of a capacity the operator shows (status, metrics), in base units."""
    return {
        "prefill_tokens_per_second": c.prefill_tokens_per_s,
        "prefill_seconds_per_request": c.prefill_request_s,
        "decode_base_step_seconds": c.decode_base_step_s,
        "decode_seconds_per_sequence": c.decode_s_per_seq,
        "decode_seconds_per_kv_token": c.decode_s_per_kv_token,
        "kv_capacity_tokens": c.kv_capacity_tokens,
        "local_prefill_tokens_per_second": c.local_prefill_rate,
        "switch_seconds": c.switch_s,
    }


class ClusterMetrics(Collector):
    """The controllers of many RolloutClusters (one per kopf daemon in the operator) served as
    one exposition: each sample gains `namespace` and `cluster` labels."""

    def __init__(self) -> None:
        self._registries: dict[tuple[str, str], CollectorRegistry] = {}

    def add(self, namespace: str, cluster: str, registry: CollectorRegistry) -> None:
        self._registries[(namespace, cluster)] = registry

    def remove(self, namespace: str, cluster: str) -> None:
        self._registries.pop((namespace, cluster), None)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for (namespace, cluster), registry in sorted(self._registries.items()):
            for family in registry.collect():
                out = merged.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))  # fmt: skip
                for s in family.samples:
                    labels = {**s.labels, "namespace": namespace, "cluster": cluster}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
