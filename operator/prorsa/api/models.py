"""`RolloutCluster` spec and status (group prorsa.io, version v1alpha1).

Field names are the camelCase a user writes in YAML; defaults come from the places that own
them (allocation knobs from `AllocationSettings`), so the CRD, the operator and the local
runner cannot disagree. Free-form Kubernetes structures (affinity, tolerations, a trainer pod
template) are kept as objects the API server validates against its own schemas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prorsa.policy.allocate import AllocationSettings

GROUP = "prorsa.io"
VERSION = "v1alpha1"
KIND = "RolloutCluster"
PLURAL = "rolloutclusters"
SINGULAR = "rolloutcluster"
SHORT_NAMES = ["rcl"]

DEFAULT_WORKER_IMAGE = "ghcr.io/prorsa/prorsa-worker:0.1.0"
DEFAULT_OPERATOR_IMAGE = "ghcr.io/prorsa/prorsa:0.1.0"

_ALLOC = AllocationSettings()


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FreeForm(BaseModel):
    """A Kubernetes object the API server checks itself (kept as given)."""

    model_config = ConfigDict(extra="allow")


class ModelSource(_Model):
    name: str = Field(min_length=1, description="Model to serve: a Hugging Face name or a path "
                      "inside the worker image or a mounted volume.")  # fmt: skip
    servedName: str | None = Field(
        default=None, description="Name clients send in `model` (default: `name`)."
    )


class Resources(_Model):
    requests: dict[str, str] = Field(default_factory=dict, description="e.g. cpu, memory.")
    limits: dict[str, str] = Field(default_factory=dict, description="e.g. nvidia.com/gpu.")


class Workers(_Model):
    replicas: int = Field(default=2, ge=1, le=4096, description="Worker pods (one engine each).")
    gpusPerWorker: int = Field(default=1, ge=1, le=16, description="GPUs per worker pod.")
    image: str = Field(default=DEFAULT_WORKER_IMAGE, min_length=1,
                       description="vLLM worker image with prorsa installed.")  # fmt: skip
    engineArgs: list[str] = Field(default_factory=list,
                                  description="Extra vLLM engine arguments.")  # fmt: skip
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM HTTP port.")
    resources: Resources = Field(default_factory=Resources)
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeForm] = Field(default_factory=list)
    affinity: FreeForm | None = None


class KVTransfer(_Model):
    connector: Literal["nixl", "nccl"] = Field(
        default="nixl", description="NIXL (KV pulled by the decode worker) or P2P NCCL."
    )
    switchMode: Literal["routing", "restart"] = Field(
        default="routing",
        description="routing: engines run kv_both and a role change is a routing decision; "
        "restart: explicit producer/consumer engines restarted to switch.",
    )


class Allocation(_Model):
    policy: Literal["colocated", "static", "reactive", "predictive"] = Field(
        default="predictive", description="How prefill and decode workers are chosen."
    )
    staticPrefill: int | None = Field(
        default=None, ge=0, description="static: prefill workers (default: a quarter)."
    )
    minPrefill: int = Field(default=_ALLOC.min_prefill, ge=0)
    minDecode: int = Field(default=_ALLOC.min_decode, ge=0)
    horizonSeconds: float = Field(default=_ALLOC.horizon_s, gt=0, le=3600)
    intervalSeconds: float = Field(default=_ALLOC.interval_s, gt=0, le=600)
    cooldownSeconds: float = Field(default=_ALLOC.cooldown_s, ge=0, le=3600)
    hysteresis: float = Field(default=_ALLOC.hysteresis, ge=0, le=1)
    maxSwitchesPerDecision: int = Field(default=_ALLOC.max_switches_per_decision, ge=1)
    drainTimeoutSeconds: float = Field(default=120.0, gt=0, le=3600)

    def settings(self) -> AllocationSettings:
        """The policy's own settings object (what the controller runs)."""
        from dataclasses import replace

        return replace(
            _ALLOC,
            policy=self.policy,
            static_prefill=self.staticPrefill,
            min_prefill=self.minPrefill,
            min_decode=self.minDecode,
            horizon_s=self.horizonSeconds,
            interval_s=self.intervalSeconds,
            cooldown_s=self.cooldownSeconds,
            hysteresis=self.hysteresis,
            max_switches_per_decision=self.maxSwitchesPerDecision,
        )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1)
    key: str = Field(default="password", min_length=1)


class Redis(_Model):
    url: str | None = Field(default=None, pattern=r"^rediss?://",
                            description="Bring your own Redis.")  # fmt: skip
    passwordSecretRef: SecretKeyRef | None = Field(
        default=None, description="Secret holding the password for `url`."
    )
    managed: bool = Field(default=False, description="Run a Redis for this cluster, with a "
                          "generated password Secret.")  # fmt: skip

    @model_validator(mode="after")
    def _one_source(self) -> Redis:
        if self.managed == (self.url is not None):
            raise ValueError("redis: set exactly one of `url` and `managed: true`")
        return self


class Router(_Model):
    replicas: int = Field(default=1, ge=1, le=64)
    serviceType: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8080, ge=1, le=65535)


class Trainer(_Model):
    template: FreeForm = Field(
        description="A PodTemplateSpec; the operator adds PRORSA_ENDPOINT, PRORSA_REDIS_URL "
        "and OPENAI_BASE_URL to its containers."
    )


class RolloutClusterSpec(_Model):
    model: ModelSource
    workers: Workers = Field(default_factory=Workers)
    kvTransfer: KVTransfer = Field(default_factory=KVTransfer)
    allocation: Allocation = Field(default_factory=Allocation)
    redis: Redis = Field(default_factory=lambda: Redis(managed=True))
    router: Router = Field(default_factory=Router)
    trainer: Trainer | None = None

    @model_validator(mode="after")
    def _fits(self) -> RolloutClusterSpec:
        a, n = self.allocation, self.workers.replicas
        if a.minPrefill + a.minDecode > n:
            raise ValueError(f"allocation: minPrefill + minDecode ({a.minPrefill} + "
                             f"{a.minDecode}) must be <= workers.replicas ({n})")  # fmt: skip
        if a.staticPrefill is not None and a.staticPrefill >= n:
            raise ValueError(f"allocation.staticPrefill ({a.staticPrefill}) must leave a "
                             f"decode worker (< workers.replicas = {n})")  # fmt: skip
        return self


# Cross-field rules the API server enforces (CEL), mirroring the validators above.
SPEC_VALIDATIONS: list[dict[str, str]] = [
    {
        "rule": "!has(self.allocation) || !has(self.workers) || "
        "self.allocation.minPrefill + self.allocation.minDecode <= self.workers.replicas",
        "message": "allocation.minPrefill + allocation.minDecode must be <= workers.replicas",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.staticPrefill) || "
        "!has(self.workers) || self.allocation.staticPrefill < self.workers.replicas",
        "message": "allocation.staticPrefill must leave a decode worker",
    },
    {
        "rule": "!has(self.redis) || (has(self.redis.url) != "
        "(has(self.redis.managed) && self.redis.managed))",
        "message": "redis: set exactly one of url and managed: true",
    },
]


class Condition(_Model):
    type: Literal["Ready", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    lastTransitionTime: str = ""
    observedGeneration: int = 0


class Decision(_Model):
    target: str = Field(description="e.g. 2P:6D")
    reason: str = ""
    time: str = ""


class Forecast(_Model):
    prefillTokensPerSecond: float = 0.0
    decodeSequences: float = 0.0
    time: str = ""


class RolloutClusterStatus(_Model):
    phase: Literal["Pending", "Running", "Degraded", "Failed"] = "Pending"
    observedGeneration: int = 0
    replicas: int = 0
    selector: str = ""
    ready: int = 0
    prefill: int = 0
    decode: int = 0
    mixed: int = 0
    switching: int = 0
    endpoint: str = ""
    lastForecast: Forecast | None = None
    lastDecision: Decision | None = None
    switchesTotal: int = 0
    conditions: list[Condition] = Field(default_factory=list)


def parse_spec(raw: dict[str, Any]) -> RolloutClusterSpec:
    return RolloutClusterSpec.model_validate(raw)
