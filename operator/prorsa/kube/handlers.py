"""kopf handlers of the RolloutCluster: small, idempotent, state kept on the objects.

`reconcile` runs on create, resume and spec updates: it validates the spec (an invalid one gets
a Degraded condition and a Warning event, never an exception that would retry forever),
creates what is missing (create-if-missing, so a rerun changes nothing), scales the worker
pods, and writes the status the user sees in `kubectl get rcl`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import math
import os
import secrets
import socket
from collections import Counter
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import kopf
from pydantic import ValidationError
from redis.asyncio import Redis

from prorsa.api.models import (
    DEFAULT_OPERATOR_IMAGE,
    GROUP,
    PLURAL,
    VERSION,
    RolloutClusterSpec,
    parse_spec,
)
from prorsa.control.controller import Controller, ControllerConfig
from prorsa.control.metrics import ClusterMetrics
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventReader
from prorsa.kube import builders as b
from prorsa.kube import labels as L
from prorsa.kube.api import ApiError, KubeApi
from prorsa.kube.cluster import KubeCluster
from prorsa.policy.allocate import Decision, Role, make_policy
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.forecast import Forecast
from prorsa.sim.presets import prior_name

log = logging.getLogger(__name__)
_api: KubeApi | None = None
SECRET_RETRY_S = 20.0  # how often a missing password Secret is looked for again
METRICS = ClusterMetrics()  # every daemon's controller metrics, served by `prorsa operator`
_NOMINAL = RoleCapacity(20_000.0, 0.02, 1e-4, 1e-8, 1e6)  # only initial role counts use it


def worker_capacity(spec: RolloutClusterSpec) -> RoleCapacity:
    """The allocator's model of one worker before it learns anything: the simulator's
    datasheet cost model for the spec's `allocation.capacityModel` (auto: `AUTO_PRIOR`) and
    switch mode, each role's engine at its own size. The controller corrects it online from
    the workers' metrics unless `allocation.learnCapacity` is false."""
    from prorsa.sim.presets import STAGES, preset, role_preset

    mode, w = spec.kvTransfer.switchMode, spec.workers
    name, _ = prior_name(spec.allocation.capacityModel)
    colocated = spec.allocation.policy == "colocated"
    if name not in STAGES:
        return preset(name, switch_mode=mode).role_capacity()
    gpus = {r: w.layout(r).gpus for r in Role}
    costs = role_preset(name, mode, gpus[Role.PREFILL], gpus[Role.DECODE], gpus[Role.MIXED])
    return costs.laid_out(colocated).role_capacity(colocated)


def capacity_status(c: RoleCapacity, evidence: dict[str, float] | None) -> dict[str, Any]:
    """`status.capacity`: what the allocator prices with, and what a learned figure rests on."""
    out: dict[str, Any] = {
        "source": "learned" if evidence is not None else "preset",
        "prefillTokensPerSecond": round(c.prefill_tokens_per_s, 1),
        "prefillSecondsPerRequest": round(c.prefill_request_s, 6),
        "decodeBaseStepSeconds": round(c.decode_base_step_s, 6),
        "decodeSecondsPerSequence": round(c.decode_s_per_seq, 8),
        "decodeSecondsPerKvToken": float(f"{c.decode_s_per_kv_token:.4g}"),
        "kvCapacityTokens": round(c.kv_capacity_tokens),
        "localPrefillTokensPerSecond": round(c.local_prefill_rate, 1),
        "switchSeconds": round(c.switch_s, 1),
        "time": _now(),
    }
    if evidence is not None:

        def finite(x: float) -> float:
            return round(x, 4) if math.isfinite(x) else 1e9

        out["evidence"] = {
            "prefillSamples": round(evidence["prefill_samples"], 1),
            "decodeSamples": round(evidence["decode_samples"], 1),
            "prefillRelativeSd": finite(evidence["prefill_rel_sd"]),
            "decodeRelativeSd": finite(evidence["decode_rel_sd"]),
            "kvWorkers": int(evidence["kv_workers"]),
            "switches": int(evidence["switches"]),
            "prefillTokensSeen": round(evidence["prefill_tokens_seen"], 1),
            "decodeBatchSeen": round(evidence["decode_batch_seen"], 2),
            "localPrefillSlowdown": round(evidence["local_prefill_slowdown"], 3),
        }
    return out


def router_image() -> str:
    """The routers run the operator's own image (the chart sets PRORSA_IMAGE to it)."""
    return os.environ.get("PRORSA_IMAGE") or DEFAULT_OPERATOR_IMAGE


def configure(api: KubeApi) -> None:
    """The API client the handlers use (in a pod: `KubeApi.in_cluster()`)."""
    global _api
    _api = api


def api() -> KubeApi:
    if _api is None:
        configure(KubeApi.in_cluster())
    assert _api is not None
    return _api


@kopf.on.startup()
def _settings(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Serve only what exists at start (the chart installs the CRD first): no cluster-wide
    scanning of namespaces and CRDs, so a namespaced install needs no ClusterRole."""
    settings.scanning.disabled = True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str, generation: int
              ) -> dict[str, Any]:  # fmt: skip
    return {"type": type_, "status": "True" if status else "False", "reason": reason,
            "message": message, "lastTransitionTime": _now(),
            "observedGeneration": generation}  # fmt: skip


async def _refuse(patch: kopf.Patch, body: kopf.Body, generation: int, reason: str,
                  message: str) -> None:  # fmt: skip
    """A spec that cannot be honoured: say so on the object, and stop (no retry loop). A
    running cluster keeps what it runs (an invalid edit changes nothing): Degraded, not
    Failed."""
    running = bool((body.get("status") or {}).get("replicas"))  # it has workers already
    if running and reason == "InvalidSpec":
        message = f"{message} (edit refused; the cluster keeps running its last valid spec)"
    patch.status["phase"] = "Failed" if reason == "InvalidSpec" and not running else "Degraded"
    patch.status["observedGeneration"] = generation
    patch.status["conditions"] = [
        condition("Ready", False, reason, message, generation),
        condition("Degraded", True, reason, message, generation),
    ]
    # Our own poster, not kopf.warn: each Event gets its own name (kopf's rely on the API
    # server's generateName, which emulators may lack).
    await post_event(body, reason, message, "Warning")


async def post_event(body: Mapping[str, Any], reason: str, message: str,
                     type_: str = "Normal") -> None:  # fmt: skip
    """A Kubernetes Event on the RolloutCluster (from the daemon, outside kopf's handler
    context, where `kopf.info` has no poster)."""
    meta = body.get("metadata") or {}
    now = _now()
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{secrets.token_hex(8)}",
                     "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutCluster",
                           "name": meta.get("name"), "namespace": meta.get("namespace"),
                           "uid": meta.get("uid")},
        "reason": reason, "message": message[:1024], "type": type_,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "source": {"component": "prorsa-operator"},
    }  # fmt: skip
    with contextlib.suppress(ApiError, OSError):
        await api().create(event)


def wanted_roles(spec: RolloutClusterSpec, existing: list[Role], n: int) -> list[Role]:
    """Roles for new workers: fill the policy's initial split where it is short."""
    want = Counter(make_policy(spec.allocation.settings(), _NOMINAL).initial_roles(n))
    have = Counter(existing)
    out: list[Role] = []
    for _ in range(n - len(existing)):
        role = max((Role.PREFILL, Role.DECODE, Role.MIXED), key=lambda r: want[r] - have[r])
        have[role] += 1
        out.append(role)
    return out


def _index(unit: dict[str, Any]) -> int:
    """A worker's index: its label, or (pods of earlier versions) its name's suffix."""
    meta = unit.get("metadata") or {}
    label = (meta.get("labels") or {}).get(L.WORKER_INDEX)
    try:
        return int(label if label is not None else meta["name"].rsplit("-", 1)[1])
    except (KeyError, ValueError, IndexError):
        return -1


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())  # fmt: skip


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(name: str, namespace: str | None, uid: str, body: kopf.Body,
                    meta: kopf.Meta, patch: kopf.Patch, **_: Any) -> None:  # fmt: skip
    assert namespace is not None  # the resource is namespaced
    generation = int(meta.get("generation") or 0)
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'spec'}: {err['msg']}"
                             for err in e.errors())  # fmt: skip
        await _refuse(patch, body, generation, "InvalidSpec", problems)
        return
    k = api()
    ref = spec.redis.passwordSecretRef
    if ref is not None and await k.get("v1", "Secret", namespace, ref.name) is None:
        message = f"redis.passwordSecretRef: no Secret {ref.name!r} in {namespace}"
        await _refuse(patch, body, generation, "SecretNotFound", message)
        # the user may create it any moment: look again (kopf retries the handler)
        raise kopf.TemporaryError(message, delay=SECRET_RETRY_S)
    owner = b.owner_reference(name, uid)
    if spec.redis.managed:
        await k.create(b.redis_secret(name, namespace, owner, secrets.token_urlsafe(24)))
        for obj in b.managed_redis(name, namespace, owner):
            await k.create(obj)

    units, pods = await _units(name, namespace, spec)
    live = _live(units)
    n = spec.workers.replicas
    new_workers = _missing_workers(name, namespace, owner, spec, units)
    new_roles = [u["metadata"]["labels"][L.ROLE] for u in new_workers]
    objs = b.children(name, namespace, uid, spec, [], router_image())  # all but the workers
    objs += new_workers
    created = 0
    for obj in objs:
        created += await k.create(obj)
    api_version, kind = _unit_kind(spec)
    for unit in _scale_down_victims(live, n, pods):
        await k.delete(api_version, kind, namespace, unit["metadata"]["name"])
        kopf.info(body, reason="ScaledDown", message=f"removed worker {unit['metadata']['name']}")
    if new_roles:
        kopf.info(body, reason="ScaledUp",
                  message=f"added {len(new_roles)} worker(s): " +
                  ", ".join(new_roles))  # fmt: skip
    status = _status(name, namespace, spec, generation, live[:n], pods, new_roles, created)
    patch.status.update(status)


async def _units(name: str, namespace: str, spec: RolloutClusterSpec
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """(What the cluster's workers are made of, their pods): the pods themselves, or
    LeaderWorkerSets where workers span nodes (then the pods are their first nodes')."""
    pods = await api().list("v1", "Pod", namespace, L.worker_selector(name))
    if not spec.workers.multi_node:
        return pods, pods
    groups = await api().list(*_unit_kind(spec), namespace, L.group_selector(name))
    return groups, pods


def _unit_kind(spec: RolloutClusterSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the objects `_units` lists."""
    return (b.LWS_API, "LeaderWorkerSet") if spec.workers.multi_node else ("v1", "Pod")


def _live(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers (pods or LeaderWorkerSets) not being deleted, oldest index first."""
    return sorted((u for u in units if not u["metadata"].get("deletionTimestamp")), key=_index)


def _missing_workers(name: str, namespace: str, owner: dict[str, Any], spec: RolloutClusterSpec,
                     units: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """Workers to create so the live ones reach `spec.workers.replicas`, in the roles the
    policy wants; indexes of workers still terminating are not reused (their names are
    taken)."""
    live, n = _live(units), spec.workers.replicas
    roles = [Role(u["metadata"]["labels"].get(L.ROLE, "mixed")) for u in live[:n]]
    used = {_index(u) for u in units}
    free = (i for i in range(10**6) if i not in used)
    return [b.worker_unit(name, namespace, owner, spec, next(free), r)
            for r in wanted_roles(spec, roles, n)]  # fmt: skip


@kopf.on.event("", "v1", "pods", labels={L.COMPONENT: L.WORKER})
async def worker_pod_changed(body: kopf.Body, namespace: str | None, type: str | None,
                             **_: Any) -> None:  # fmt: skip
    """A worker became ready, was relabelled or went away: keep its cluster's status true, and
    replace a worker that is gone (a node lost, an eviction, a `kubectl delete pod`)."""
    cluster = (body.get("metadata", {}).get("labels") or {}).get(L.CLUSTER)
    if not cluster or namespace is None:
        return
    k = api()
    owner = await k.get(f"{GROUP}/{VERSION}", "RolloutCluster", namespace, cluster)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = parse_spec(dict(owner.get("spec") or {}))
    except ValidationError:
        return  # reconcile has said why
    units, pods = await _units(cluster, namespace, spec)
    if type == "DELETED":
        # A LeaderWorkerSet recreates its own pods: only a worker itself gone is replaced.
        ref = b.owner_reference(cluster, owner["metadata"].get("uid", ""))
        replaced = [u for u in _missing_workers(cluster, namespace, ref, spec, units)
                    if await k.create(u)]  # fmt: skip
        if replaced:
            units = [*units, *replaced]
            if not spec.workers.multi_node:
                pods = units
            names = ", ".join(u["metadata"]["name"] for u in replaced)
            gone = body["metadata"]["name"]
            await post_event(owner, "Replaced", f"worker {gone} is gone; created {names}")
    elif spec.workers.multi_node:
        await _restore_group_role(body, units)
    generation = int(owner.get("metadata", {}).get("generation") or 0)
    status = _status(cluster, namespace, spec, generation, _live(units), pods)
    await k.patch_status(f"{GROUP}/{VERSION}", "RolloutCluster", namespace, cluster, status)


async def _restore_group_role(pod: Mapping[str, Any], groups: list[dict[str, Any]]) -> None:
    """A LeaderWorkerSet that recreated its group gave the new leader its template's role:
    relabel it to the role recorded on the LeaderWorkerSet (a switch records it there before
    relabelling the pod, and a draining pod is the switch protocol's to finish)."""
    meta = pod.get("metadata") or {}
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    group = next((g for g in groups if g["metadata"]["name"] == labels.get(L.LWS_NAME)), None)
    if group is None or ann.get(L.DRAINING) == "true" or meta.get("deletionTimestamp"):
        return
    recorded = (group["metadata"].get("labels") or {}).get(L.ROLE)
    if recorded and recorded != labels.get(L.ROLE):
        with contextlib.suppress(ApiError, OSError):
            await api().patch("v1", "Pod", meta.get("namespace"), meta["name"],
                              {"metadata": {"labels": {L.ROLE: recorded}}},
                              meta.get("resourceVersion"))  # fmt: skip


def _unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's reason when it cannot place the pod (too few GPUs or nodes, taints)."""
    for c in (pod.get("status") or {}).get("conditions") or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message") or c.get("reason") or "unschedulable")
    return None


def _status(name: str, namespace: str, spec: RolloutClusterSpec, generation: int,
            workers: list[dict[str, Any]], pods: list[dict[str, Any]],
            new_roles: list[str] | None = None, created: int = 0) -> dict[str, Any]:  # fmt: skip
    """The status `kubectl get rcl` shows, from the workers (and those just created) and
    their pods (a multi-node worker's: its first node's)."""
    n = spec.workers.replicas
    mine = {_index(w) for w in workers}
    pods = [p for p in _live(pods) if _index(p) in mine]
    roles = [w["metadata"]["labels"].get(L.ROLE, "") for w in workers] + (new_roles or [])
    ready = sum(_ready(p) for p in pods)
    pending = [(p["metadata"]["name"], why) for p in pods
               if (why := _unschedulable(p)) is not None]  # fmt: skip
    degraded = condition("Degraded", False, "Healthy", "", generation)
    if pending:
        degraded = condition("Degraded", True, "Unschedulable",
                             f"{len(pending)} worker(s) cannot be scheduled, e.g. "
                             f"{pending[0][0]}: {pending[0][1]}", generation)  # fmt: skip
    by_role = Counter(roles)
    return {
        "phase": "Running" if ready else "Pending",
        "observedGeneration": generation,
        "replicas": len(roles),
        "selector": L.worker_selector(name),
        "ready": ready,
        "prefill": by_role.get("prefill", 0),
        "decode": by_role.get("decode", 0),
        "mixed": by_role.get("mixed", 0),
        "prefillUnitGPUs": spec.workers.layout(Role.PREFILL).gpus,
        "decodeUnitGPUs": spec.workers.layout(Role.DECODE).gpus,
        "endpoint": b.endpoint(name, namespace, spec),
        "conditions": [
            condition("Ready", ready > 0, "WorkersReady" if ready else "WaitingForWorkers",
                      f"{ready}/{n} workers ready", generation),
            condition("Progressing", bool(created) or ready < n or len(roles) != n,
                      "Reconciling" if len(roles) != n or ready < n else "Reconciled",
                      f"{len(roles)}/{n} workers, {ready} ready", generation),
            degraded,
        ],
    }  # fmt: skip


def _scale_down_victims(live: list[dict[str, Any]], n: int, pods: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:  # fmt: skip
    """Excess workers, not-ready ones first, then the highest indexes; never a draining one
    (a switch is using it) — those wait for the next reconcile. A worker's readiness and
    drain mark are its pod's (a multi-node worker's: its first node's)."""
    excess = len(live) - n
    if excess <= 0:
        return []
    pod_of = {_index(p): p for p in _live(pods)}

    def pod(u: dict[str, Any]) -> dict[str, Any]:
        return pod_of.get(_index(u), {"metadata": {}})

    def draining(u: dict[str, Any]) -> bool:
        return (pod(u)["metadata"].get("annotations") or {}).get(L.DRAINING) == "true"

    candidates = [u for u in live if not draining(u)]
    candidates.sort(key=lambda u: (_ready(pod(u)), -_index(u)))
    return candidates[:excess]


async def _redis_url(name: str, namespace: str, spec: RolloutClusterSpec) -> str:
    """The cluster's Redis URL with its password (read from the Secret) when it has one."""
    url = b.redis_url(name, spec)
    ref = spec.redis.passwordSecretRef
    secret_name, key = (f"{name}-redis", "password") if spec.redis.managed else (
        (ref.name, ref.key) if ref else (None, None))  # fmt: skip
    if secret_name is None or key is None:
        return url
    secret = await api().get("v1", "Secret", namespace, secret_name)
    raw = ((secret or {}).get("data") or {}).get(key)
    if raw is None:
        raw_text = ((secret or {}).get("stringData") or {}).get(key)
    else:
        raw_text = base64.b64decode(raw).decode()
    if not raw_text:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://:{quote(raw_text, safe='')}@{rest}"


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=15.0)
async def control_loop(name: str, namespace: str | None, body: kopf.Body,
                       stopped: kopf.DaemonStopped, **_: Any) -> None:  # fmt: skip
    """The controller of one RolloutCluster (the very loop `prorsa controller` runs)."""
    assert namespace is not None
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except ValidationError:
        return  # reconcile has put the reason on the object
    keys = ClusterKeys(namespace, name)
    redis = Redis.from_url(await _redis_url(name, namespace, spec), socket_timeout=5,
                           socket_connect_timeout=5)  # fmt: skip

    async def report(d: Decision, fc: Forecast | None) -> None:
        with contextlib.suppress(ValidationError):  # the body is live: follow spec edits
            ctl.update_settings(parse_spec(dict(body.get("spec") or {})).allocation.settings())
        status: dict[str, Any] = {
            "lastDecision": {"target": str(d.target), "reason": d.reason, "time": _now()},
            "switchesTotal": ctl.switches_done,
            "capacity": capacity_status(
                ctl.capacity, ctl.learner.evidence() if ctl.learner else None
            ),
        }
        if fc is not None:
            status["lastForecast"] = {
                "prefillTokensPerSecond": round(fc.prefill_tokens_per_s[0], 1),
                "decodeSequences": round(fc.decode_seqs[0], 2),
                "time": _now(),
            }
        with contextlib.suppress(ApiError, OSError):
            await api().patch_status(
                f"{GROUP}/{VERSION}", "RolloutCluster", namespace, name, status
            )
        if d.switches:
            moves = ", ".join(f"{s.worker} {s.from_role.value}->{s.to_role.value}"
                              for s in d.switches)  # fmt: skip
            await post_event(body, "Switching", f"target {d.target} ({d.reason}): {moves}")

    ctl = Controller(
        KubeCluster(api(), redis, keys),
        EventReader(redis, keys.events, consumer=socket.gethostname()),
        ControllerConfig(
            spec.allocation.settings(),
            worker_capacity(spec),
            drain_timeout_s=spec.allocation.drainTimeoutSeconds,
            switch_mode=spec.kvTransfer.switchMode,
            finish_switches_on_stop=False,  # a restarted operator finishes them (recover)
            learn_capacity=spec.allocation.learnCapacity,
            capacity_prior_rel_sd=prior_name(spec.allocation.capacityModel)[1],
        ),
        on_decision=report,
    )
    stop = asyncio.Event()

    async def until_stopped() -> None:
        await stopped.wait()
        stop.set()

    waiter = asyncio.create_task(until_stopped())
    METRICS.add(namespace, name, ctl.metrics.registry)
    try:
        await ctl.run(stop)
    finally:
        METRICS.remove(namespace, name)
        waiter.cancel()
        await redis.aclose()


__all__ = ["ApiError", "configure", "control_loop", "reconcile"]
