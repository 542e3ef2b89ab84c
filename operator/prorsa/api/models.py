"""`RolloutCluster` spec and status (group prorsa.io, version v1alpha1).

Field names are the camelCase a user writes in YAML; defaults come from the places that own
them (allocation knobs from `AllocationSettings`), so the CRD, the operator and the local
runner cannot disagree. Free-form Kubernetes structures (affinity, tolerations, a trainer pod
template) are kept as objects the API server validates against its own schemas.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


# Engine flags the operator (through `prorsa worker`) sets itself; a user value would either
# be overridden silently or break the KV transfer and the probes.
OPERATOR_ENGINE_FLAGS = ("--model", "--host", "--port", "--served-model-name",
                         "--kv-transfer-config")  # fmt: skip


def _owned_flag(arg: str) -> str | None:
    flag = arg.split("=", 1)[0]
    return flag if flag in OPERATOR_ENGINE_FLAGS else None


class Workers(_Model):
    replicas: int = Field(default=2, ge=1, le=4096, description="Worker pods (one engine each).")
    gpusPerWorker: int = Field(default=1, ge=1, le=16, description="GPUs per worker pod.")
    image: str = Field(default=DEFAULT_WORKER_IMAGE, min_length=1,
                       description="vLLM worker image with prorsa installed.")  # fmt: skip
    engineArgs: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=128,
        description="Extra vLLM engine arguments (not those the operator sets: "
        + ", ".join(OPERATOR_ENGINE_FLAGS) + ").",
    )  # fmt: skip
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM HTTP port.")
    resources: Resources = Field(
        default_factory=Resources,
        description="Worker container resources; nvidia.com/gpu defaults to gpusPerWorker.",
    )

    @field_validator("engineArgs")
    @classmethod
    def _not_owned(cls, args: list[str]) -> list[str]:
        owned = [f for f in map(_owned_flag, args) if f]
        if owned:
            raise ValueError(f"workers.engineArgs must not set {', '.join(owned)}: the operator "
                             "sets it (use model.name, model.servedName, workers.port, "
                             "kvTransfer)")  # fmt: skip
        return args

    nodeSelector: dict[str, str] = Field(default_factory=dict,
                                         description="Node labels the workers need.")  # fmt: skip
    tolerations: list[FreeForm] = Field(default_factory=list,
                                        description="Worker pod tolerations.")  # fmt: skip
    affinity: FreeForm | None = Field(default=None, description="Worker pod affinity.")


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
    minPrefill: int = Field(
        default=_ALLOC.min_prefill,
        ge=0,
        description=(
            "Prefill workers always kept (0: decode workers may prefill locally when no pool "
            "is worth it)."
        ),
    )
    initialPrefill: int | None = Field(
        default=None, ge=0,
        description="predictive, reactive: prefill workers at start (default: minPrefill); a "
        "start near the expected split saves engine restarts where roles run different "
        "engine configurations.",
    )  # fmt: skip
    minDecode: int = Field(default=_ALLOC.min_decode, ge=1,
                           description="Decode workers always kept (at least one: a cluster "
                           "without decode workers serves nothing).")  # fmt: skip
    horizonSeconds: float = Field(
        default=_ALLOC.horizon_s,
        gt=0,
        le=3600,
        description=(
            "How far ahead the forecast looks; longer than a switch takes (drain + restart)."
        ),
    )
    intervalSeconds: float = Field(default=_ALLOC.interval_s, gt=0, le=600,
                                   description="Seconds between two decisions.")  # fmt: skip
    cooldownSeconds: float = Field(
        default=_ALLOC.cooldown_s,
        ge=0,
        le=3600,
        description="Seconds after a switch before a worker may switch again (anti-flapping).",
    )
    hysteresis: float = Field(
        default=_ALLOC.hysteresis,
        ge=0,
        le=1,
        description=(
            "predictive: the predicted gain a larger prefill pool needs over the current split"
            " (0.1: 10%); shrinking the pool needs none."
        ),
    )
    maxSwitchesPerDecision: int = Field(default=_ALLOC.max_switches_per_decision, ge=1,
                                        description="Cap on workers switched at once.")  # fmt: skip
    drainTimeoutSeconds: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="A drain not finished by then is rolled back (the worker keeps its role).",
    )
    capacityModel: Literal[
        "h200-dense-8b", "h100-dense-8b", "h200-moe-30b", "h100-moe-30b",
        "h200-deepseek-v3", "h100-deepseek-v3", "h200-qwen3-235b",
    ] = Field(default="h200-dense-8b", description=(
        "The allocator's model of one worker: GPU and model class of the simulator's "
        "datasheet cost model (prorsa simulate --preset). Pick the closest; the expert-"
        "parallel ones describe engine units and need workers.gpusPerWorker to match "
        "(deepseek-v3: 8 on H200, 16 on H100; qwen3-235b: 8)."))  # fmt: skip

    @model_validator(mode="after")
    def _horizon_covers_a_decision(self) -> Allocation:
        if self.horizonSeconds < self.intervalSeconds:
            raise ValueError(f"allocation.horizonSeconds ({self.horizonSeconds:g}) must be >= "
                             f"allocation.intervalSeconds ({self.intervalSeconds:g}): the "
                             "forecast must reach the next decision")  # fmt: skip
        return self

    def settings(self) -> AllocationSettings:
        """The policy's own settings object (what the controller runs)."""
        from dataclasses import replace

        return replace(
            _ALLOC,
            policy=self.policy,
            static_prefill=self.staticPrefill,
            min_prefill=self.minPrefill,
            initial_prefill=self.initialPrefill,
            min_decode=self.minDecode,
            horizon_s=self.horizonSeconds,
            interval_s=self.intervalSeconds,
            cooldown_s=self.cooldownSeconds,
            hysteresis=self.hysteresis,
            max_switches_per_decision=self.maxSwitchesPerDecision,
        )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, description="Secret in the RolloutCluster's namespace.")
    key: str = Field(default="password", min_length=1, description="Key holding the password.")


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
    replicas: int = Field(default=1, ge=1, le=64, description="Router pods behind the Service.")
    serviceType: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the endpoint Service."
    )
    port: int = Field(default=8080, ge=1, le=65535, description="Endpoint port.")


class Trainer(_Model):
    template: FreeForm = Field(
        description="A PodTemplateSpec; the operator creates `<name>-trainer` from it and adds "
        "OPENAI_BASE_URL and PRORSA_ENDPOINT (the endpoint), PRORSA_TRAJECTORY_HEADER, "
        "PRORSA_REDIS_URL and REDIS_PASSWORD to its containers (their own values win)."
    )


class RolloutClusterSpec(_Model):
    model: ModelSource = Field(description="What the workers serve.")
    workers: Workers = Field(default_factory=Workers, description="The GPU worker pods.")
    kvTransfer: KVTransfer = Field(default_factory=KVTransfer,
                                   description="How KV moves from prefill to decode.")  # fmt: skip
    allocation: Allocation = Field(default_factory=Allocation,
                                   description="How workers are split between roles.")  # fmt: skip
    redis: Redis = Field(default_factory=lambda: Redis(managed=True),
                         description="Where lifecycle events go (default: managed).")  # fmt: skip
    router: Router = Field(default_factory=Router, description="The endpoint.")
    trainer: Trainer | None = Field(default=None, description="Optional trainer pod, wired to "
                                    "the endpoint and Redis.")  # fmt: skip

    @model_validator(mode="after")
    def _fits(self) -> RolloutClusterSpec:
        a, n = self.allocation, self.workers.replicas
        if a.minPrefill + a.minDecode > n:
            raise ValueError(f"allocation: minPrefill + minDecode ({a.minPrefill} + "
                             f"{a.minDecode}) must be <= workers.replicas ({n})")  # fmt: skip
        if a.staticPrefill is not None and a.staticPrefill >= n:
            raise ValueError(f"allocation.staticPrefill ({a.staticPrefill}) must leave a "
                             f"decode worker (< workers.replicas = {n})")  # fmt: skip
        unit = UNIT_GPUS.get(a.capacityModel)
        if unit is not None and self.workers.gpusPerWorker != unit:
            raise ValueError(f"allocation.capacityModel {a.capacityModel} describes engine "
                             f"units of {unit} GPUs: set workers.gpusPerWorker to {unit} "
                             f"(not {self.workers.gpusPerWorker})")  # fmt: skip
        if a.initialPrefill is not None and a.initialPrefill > n - a.minDecode:
            raise ValueError(f"allocation.initialPrefill ({a.initialPrefill}) must leave "
                             f"allocation.minDecode ({a.minDecode}) decode workers of "
                             f"workers.replicas ({n})")  # fmt: skip
        if (
            a.policy == "static"
            and a.staticPrefill is not None
            and not (a.minPrefill <= a.staticPrefill <= n - a.minDecode)
        ):
            raise ValueError(f"allocation.staticPrefill ({a.staticPrefill}) must lie within "
                             f"allocation.minPrefill ({a.minPrefill}) and workers.replicas - "
                             f"allocation.minDecode ({n - a.minDecode})")  # fmt: skip
        return self


# GPUs per engine unit of the expert-parallel capacity models (the simulator's presets).
UNIT_GPUS = {"h200-deepseek-v3": 8, "h100-deepseek-v3": 16, "h200-qwen3-235b": 8}

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
        "rule": "!has(self.allocation) || !has(self.allocation.horizonSeconds) || "
        "!has(self.allocation.intervalSeconds) || "
        "self.allocation.horizonSeconds >= self.allocation.intervalSeconds",
        "message": "allocation.horizonSeconds must be >= allocation.intervalSeconds",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.staticPrefill) || "
        "!has(self.allocation.policy) || self.allocation.policy != 'static' || "
        "!has(self.workers) || (self.allocation.staticPrefill >= self.allocation.minPrefill && "
        "self.allocation.staticPrefill <= self.workers.replicas - self.allocation.minDecode)",
        "message": "allocation.staticPrefill must lie within allocation.minPrefill and "
        "workers.replicas - allocation.minDecode",
    },
    {
        "rule": "!has(self.workers) || !has(self.workers.engineArgs) || "
        "self.workers.engineArgs.all(a, !"
        + repr(list(OPERATOR_ENGINE_FLAGS)).replace(" ", "")
        + ".exists(f, a == f || a.startsWith(f + '=')))",
        "message": "workers.engineArgs must not set what the operator sets: "
        + ", ".join(OPERATOR_ENGINE_FLAGS),
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.initialPrefill) || "
        "!has(self.workers) || "
        "self.allocation.initialPrefill <= self.workers.replicas - self.allocation.minDecode",
        "message": "allocation.initialPrefill must leave allocation.minDecode decode workers",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.capacityModel) || "
        "!has(self.workers) || !has(self.workers.gpusPerWorker) || "
        + " && ".join(
            f"(self.allocation.capacityModel != '{k}' || self.workers.gpusPerWorker == {v})"
            for k, v in UNIT_GPUS.items()
        ),
        "message": "allocation.capacityModel of engine units needs workers.gpusPerWorker to "
        "match: " + ", ".join(f"{k} = {v}" for k, v in UNIT_GPUS.items()),
    },
    {
        "rule": "!has(self.redis) || (has(self.redis.url) != "
        "(has(self.redis.managed) && self.redis.managed))",
        "message": "redis: set exactly one of url and managed: true",
    },
]


class Condition(_Model):
    type: Literal["Ready", "Progressing", "Degraded"] = Field(description="Standard conditions.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="e.g. WorkersReady, InvalidSpec, SecretNotFound.")  # fmt: skip
    message: str = ""
    lastTransitionTime: str = ""
    observedGeneration: int = 0


class Decision(_Model):
    target: str = Field(description="e.g. 2P:6D")
    reason: str = Field(default="", description="Why: the forecast and the predicted gain.")
    time: str = ""


class Forecast(_Model):
    prefillTokensPerSecond: float = Field(default=0.0, description="Next step's prefill work.")
    decodeSequences: float = Field(default=0.0, description="Next step's decoding sequences.")
    time: str = ""


class RolloutClusterStatus(_Model):
    phase: Literal["Pending", "Running", "Degraded", "Failed"] = Field(
        default="Pending", description="Failed: invalid spec; Degraded: cannot be honoured."
    )
    observedGeneration: int = Field(default=0, description="The spec generation reconciled.")
    replicas: int = Field(default=0, description="Worker pods (the scale subresource).")
    selector: str = Field(default="", description="Worker pod selector (the scale subresource).")
    ready: int = Field(default=0, description="Workers ready.")
    prefill: int = Field(default=0, description="Workers labelled prefill.")
    decode: int = Field(default=0, description="Workers labelled decode.")
    mixed: int = Field(default=0, description="Workers labelled mixed (colocated).")
    switching: int = Field(default=0, description="Workers draining for a switch.")
    endpoint: str = Field(default="", description="The OpenAI-compatible base URL.")
    lastForecast: Forecast | None = Field(default=None, description="What the policy saw.")
    lastDecision: Decision | None = Field(default=None, description="What it decided and why.")
    switchesTotal: int = Field(default=0, description="Completed switches since the operator "
                               "started serving this cluster.")  # fmt: skip
    conditions: list[Condition] = Field(default_factory=list,
                                        description="Ready, Progressing, Degraded.")  # fmt: skip


def parse_spec(raw: dict[str, Any]) -> RolloutClusterSpec:
    return RolloutClusterSpec.model_validate(raw)
