"""`RolloutCluster` spec and status (group prorsa.io, version v1alpha1).

Field names are the camelCase a user writes in YAML; defaults come from the places that own
them (allocation knobs from `AllocationSettings`), so the CRD, the operator and the local
runner cannot disagree. Free-form Kubernetes structures (affinity, tolerations, a trainer pod
template) are kept as objects the API server validates against its own schemas.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prorsa.policy.allocate import AllocationSettings, Role
from prorsa.worker.engine import PARALLEL_FLAGS, EngineLayout

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
# be overridden silently, break the KV transfer and the probes, or hide a unit's size from
# the allocator (the parallel sizes are typed fields).
OPERATOR_ENGINE_FLAGS = ("--model", "--host", "--port", "--served-model-name",
                         "--kv-transfer-config", *PARALLEL_FLAGS)  # fmt: skip
SHOWN_FLAGS = "--model, --host, --port, --served-model-name, --kv-transfer-config, the " \
    "parallel sizes (-tp, -pp, -dp, -ep and their long forms)"  # fmt: skip


def _owned_flag(arg: str) -> str | None:
    flag = arg.split("=", 1)[0]
    return flag if flag in OPERATOR_ENGINE_FLAGS else None


EngineArgs = list[Annotated[str, Field(max_length=1024)]]


def _check_engine_args(where: str, args: list[str] | None) -> None:
    owned = [f for f in map(_owned_flag, args or []) if f]
    if owned:
        raise ValueError(f"{where}.engineArgs must not set {', '.join(owned)}: the operator "
                         "sets it (use model.name, model.servedName, workers.port, kvTransfer, "
                         "or the typed parallel sizes)")  # fmt: skip


class Parallelism(_Model):
    """An engine's parallel layout (vLLM's sizes). Unset sizes are derived: tensor parallel
    fills a node's share of the unit, data parallel the rest; their product is the unit."""

    tensorParallelSize: int | None = Field(
        default=None, ge=1, le=64, description="vLLM --tensor-parallel-size."
    )
    pipelineParallelSize: int | None = Field(
        default=None, ge=1, le=64, description="vLLM --pipeline-parallel-size."
    )
    dataParallelSize: int | None = Field(
        default=None, ge=1, le=4096,
        description="vLLM --data-parallel-size: data-parallel attention ranks of one engine.",
    )  # fmt: skip
    expertParallel: bool | None = Field(
        default=None,
        description="vLLM --enable-expert-parallel: MoE experts spread over all ranks of the "
        "engine (EP size = data x tensor parallel).",
    )


class RoleWorkers(Parallelism):
    """What one role changes of the shared `workers` settings (unset: the shared value)."""

    gpusPerWorker: int | None = Field(default=None, ge=1, le=1024,
                                      description="GPUs of this role's engine.")  # fmt: skip
    engineArgs: EngineArgs = Field(
        default_factory=list, max_length=128,
        description="vLLM arguments added after workers.engineArgs for this role only "
        "(for a flag in both, this role's value wins).",
    )  # fmt: skip


class Workers(Parallelism):
    replicas: int = Field(default=2, ge=1, le=4096, description=(
        "Workers: engine units, one pod each, or one LeaderWorkerSet group each where a unit "
        "spans several nodes."))  # fmt: skip
    gpusPerWorker: int = Field(default=1, ge=1, le=1024, description="GPUs per engine.")
    gpusPerNode: int = Field(
        default=8, ge=1, le=64,
        description="GPUs of one node: an engine of more spans several pods (a LeaderWorkerSet).",
    )  # fmt: skip
    image: str = Field(default=DEFAULT_WORKER_IMAGE, min_length=1,
                       description="vLLM worker image with prorsa installed.")  # fmt: skip
    engineArgs: EngineArgs = Field(
        default_factory=list, max_length=128,
        description=f"Extra vLLM engine arguments (not those the operator sets: {SHOWN_FLAGS}).",
    )  # fmt: skip
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM HTTP port.")
    resources: Resources = Field(
        default_factory=Resources,
        description="Worker container resources; nvidia.com/gpu defaults to the pod's GPUs.",
    )
    prefill: RoleWorkers | None = Field(
        default=None,
        description="Prefill engines' own GPUs, parallelism, arguments (stage-specific).",
    )
    decode: RoleWorkers | None = Field(
        default=None, description="Decode engines' own GPUs, parallelism, arguments."
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict,
                                         description="Node labels the workers need.")  # fmt: skip
    tolerations: list[FreeForm] = Field(default_factory=list,
                                        description="Worker pod tolerations.")  # fmt: skip
    affinity: FreeForm | None = Field(default=None, description="Worker pod affinity.")

    @model_validator(mode="after")
    def _engines_fit(self) -> Workers:
        _check_engine_args("workers", self.engineArgs)
        for role in (Role.PREFILL, Role.DECODE):
            if (own := self.override(role)) is not None:
                _check_engine_args(f"workers.{role.value}", own.engineArgs)
        layouts = {r: self.layout(r) for r in Role}  # raises, naming the role's block
        slot = self.slot_gpus
        for role in (Role.PREFILL, Role.DECODE):
            g = layouts[role].gpus
            if slot % g or (g < slot and g % self.gpusPerNode):
                raise ValueError(
                    f"{self._where(role)}.gpusPerWorker ({g}) must tile a worker of {slot} GPUs "
                    "(the largest role's engine; a worker switches roles in place): divide it, "
                    f"in whole nodes of workers.gpusPerNode ({self.gpusPerNode})"
                )
        return self

    def override(self, role: Role) -> RoleWorkers | None:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode}.get(role)

    def _where(self, role: Role) -> str:
        return f"workers.{role.value}" if self.override(role) is not None else "workers"

    def _pick(self, role: Role, name: str) -> Any:
        """The role's own value, else the shared one; a role with GPUs of its own derives
        its parallel sizes from them instead of taking the shared sizes."""
        own = self.override(role)
        value = getattr(own, name) if own is not None else None
        if value is None and own is not None and own.gpusPerWorker is not None \
                and name in PARALLEL_SIZES:  # fmt: skip
            return None
        return getattr(self, name) if value is None else value

    def role_settings(self, role: Role) -> tuple[Any, ...]:
        """What the user set for `role`'s engine, before sizes are derived (unset sizes as
        0, like the CEL rule that compares them)."""
        own = self.override(role)
        return (int(self._pick(role, "gpusPerWorker")),
                self._pick(role, "tensorParallelSize") or 0,
                self._pick(role, "pipelineParallelSize") or 1,
                self._pick(role, "dataParallelSize") or 0,
                bool(self._pick(role, "expertParallel")),
                list(own.engineArgs) if own is not None else [])  # fmt: skip

    def layout(self, role: Role) -> EngineLayout:
        """The engine a worker runs in `role` (mixed: the shared settings). Unset sizes are
        derived: tensor parallel fills the node's share, data parallel the rest."""
        gpus = int(self._pick(role, "gpusPerWorker"))
        pp = self._pick(role, "pipelineParallelSize") or 1
        tp, dp = self._pick(role, "tensorParallelSize"), self._pick(role, "dataParallelSize")
        if tp is None and dp is None:
            tp = max(1, min(gpus, self.gpusPerNode) // pp)
        elif tp is None:
            tp = max(1, gpus // (dp * pp))
        if dp is None:
            dp = max(1, gpus // (tp * pp))
        if tp * pp * dp != gpus:
            raise ValueError(f"{self._where(role)}: tensorParallelSize x pipelineParallelSize x "
                             f"dataParallelSize ({tp} x {pp} x {dp} = {tp * pp * dp}) must "
                             f"equal gpusPerWorker ({gpus})")  # fmt: skip
        if gpus > self.gpusPerNode and (gpus % self.gpusPerNode or self.gpusPerNode % (tp * pp)):
            raise ValueError(f"{self._where(role)}: an engine of {gpus} GPUs spans nodes of "
                             f"workers.gpusPerNode ({self.gpusPerNode}): it needs whole nodes and "
                             f"tensor x pipeline parallel ({tp * pp}) dividing a node, so that "
                             "its data-parallel ranks split evenly over them")  # fmt: skip
        own = self.override(role)
        args = (*self.engineArgs, *(own.engineArgs if own is not None else ()))
        nodes = gpus // self.gpusPerNode if gpus > self.gpusPerNode else 1
        return EngineLayout(gpus, tp, pp, dp, bool(self._pick(role, "expertParallel")), args,
                            nodes)  # fmt: skip

    @property
    def slot_gpus(self) -> int:
        """GPUs of one worker: the larger role's engine (the smaller runs several in it)."""
        return max(self.layout(Role.PREFILL).gpus, self.layout(Role.DECODE).gpus)

    @property
    def multi_node(self) -> bool:
        """Whether a worker spans nodes (a LeaderWorkerSet group instead of one pod)."""
        return self.slot_gpus > self.gpusPerNode

    @property
    def staged(self) -> bool:
        """Whether prefill and decode engines are configured apart (stage-specific)."""
        return self.role_settings(Role.PREFILL) != self.role_settings(Role.DECODE)


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
        "auto", "h200-dense-8b", "h100-dense-8b", "h200-moe-30b", "h100-moe-30b",
        "h200-deepseek-v3", "h100-deepseek-v3", "h200-qwen3-235b",
    ] = Field(default="auto", description=(
        "The allocator's model of one worker. auto: learned online from the workers' vLLM "
        "metrics (prefill time by tokens and context, decode step by batch and KV, KV cache "
        "size, switch cost), starting from a wide H200 prior; status.capacity shows what was "
        "learned. A preset names the simulator's datasheet model (prorsa simulate --preset) "
        "as the prior, corrected online too unless learnCapacity is false. The expert-"
        "parallel presets describe engine units and need workers.gpusPerWorker to match "
        "(deepseek-v3: 8 on H200, 16 on H100; qwen3-235b: 8)."))  # fmt: skip
    learnCapacity: bool = Field(default=True, description=(
        "Correct the capacity model online from the workers' metrics. false: price every "
        "split with the preset as it is (capacityModel auto needs true)."))  # fmt: skip

    @model_validator(mode="after")
    def _horizon_covers_a_decision(self) -> Allocation:
        if self.capacityModel == "auto" and not self.learnCapacity:
            raise ValueError("allocation.capacityModel auto is learned online: set "
                             "allocation.learnCapacity true or name a preset")  # fmt: skip
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
        for role in Role:
            g = self.workers.layout(role).gpus
            if unit is not None and g % unit:
                raise ValueError(f"allocation.capacityModel {a.capacityModel} describes engine "
                                 f"units of {unit} GPUs: {self.workers._where(role)}.gpusPerWorker "
                                 f"({g}) must be a multiple of {unit}")  # fmt: skip
        if self.kvTransfer.switchMode == "routing" and self.workers.staged:
            raise ValueError("kvTransfer.switchMode routing switches a worker's role without "
                             "restarting its engine, but workers.prefill and workers.decode "
                             "configure their engines apart: use switchMode restart")  # fmt: skip
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

PARALLEL_SIZES = ("tensorParallelSize", "pipelineParallelSize", "dataParallelSize")


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


class CapacityEvidence(_Model):
    prefillSamples: float = Field(default=0.0, description="Decayed prefill windows learned.")
    decodeSamples: float = Field(default=0.0, description="Decayed decode windows learned.")
    prefillRelativeSd: float = Field(default=0.0, description="Uncertainty of the prefill "
                                     "rate (1 sd, relative).")  # fmt: skip
    decodeRelativeSd: float = Field(default=0.0, description="Uncertainty of a decode step "
                                    "(1 sd, relative).")  # fmt: skip
    kvWorkers: int = Field(default=0, description="Workers that reported their KV cache size.")
    switches: int = Field(default=0, description="Switches whose cost was measured.")
    prefillTokensSeen: float = Field(
        default=0.0, description="Typical new tokens of the prefills learned from."
    )
    decodeBatchSeen: float = Field(default=0.0, description="Typical batch of the decode "
                                   "steps learned from.")  # fmt: skip
    localPrefillSlowdown: float = Field(default=1.0, description="How much slower a decode "
                                        "worker's own prefills (appends) run inside its steps "
                                        "than the prefill rate says.")  # fmt: skip


class Capacity(_Model):
    source: Literal["learned", "preset"] = Field(
        default="preset", description="learned: corrected online from the workers' metrics."
    )
    prefillTokensPerSecond: float = Field(default=0.0, description="One prefill worker.")
    prefillSecondsPerRequest: float = Field(default=0.0, description="A prefill's fixed part.")
    decodeBaseStepSeconds: float = Field(default=0.0, description="A decode step's fixed part.")
    decodeSecondsPerSequence: float = Field(default=0.0, description="Per sequence in a step.")
    decodeSecondsPerKvToken: float = Field(default=0.0, description="Per KV token read a step.")
    kvCapacityTokens: float = Field(default=0.0, description="KV one decode worker holds.")
    localPrefillTokensPerSecond: float = Field(
        default=0.0, description="Prefill a decode worker computes inside its steps (appends)."
    )
    switchSeconds: float = Field(default=0.0, description="A switch beyond its drain.")
    evidence: CapacityEvidence | None = Field(default=None, description="What it rests on.")
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
    prefillUnitGPUs: int = Field(default=0, description="GPUs of one prefill engine.")
    decodeUnitGPUs: int = Field(default=0, description="GPUs of one decode engine.")
    switching: int = Field(default=0, description="Workers draining for a switch.")
    endpoint: str = Field(default="", description="The OpenAI-compatible base URL.")
    lastForecast: Forecast | None = Field(default=None, description="What the policy saw.")
    lastDecision: Decision | None = Field(default=None, description="What it decided and why.")
    capacity: Capacity | None = Field(default=None, description="What the allocator prices "
                                      "splits with: one worker's capacity.")  # fmt: skip
    switchesTotal: int = Field(default=0, description="Completed switches since the operator "
                               "started serving this cluster.")  # fmt: skip
    conditions: list[Condition] = Field(default_factory=list,
                                        description="Ready, Progressing, Degraded.")  # fmt: skip


def parse_spec(raw: dict[str, Any]) -> RolloutClusterSpec:
    return RolloutClusterSpec.model_validate(raw)
