"""Kubernetes objects of one RolloutCluster, as pure functions of its spec (no I/O).

Workers are Pods owned directly by the RolloutCluster, not a StatefulSet or Deployment:
their role label changes while they run (a workload controller whose selector or template held
the role would orphan or replace them), and scaling down must remove the idle workers first,
where a StatefulSet always removes the highest ordinal. The role label is in no workload
selector; only the per-role headless Services select on it, which is their purpose.
Every object carries an owner reference to the RolloutCluster, so deleting it deletes them.
"""

from __future__ import annotations

import json
from typing import Any

from prorsa.api.models import DEFAULT_OPERATOR_IMAGE, GROUP, KIND, VERSION, RolloutClusterSpec
from prorsa.kube import labels as L
from prorsa.kube.rbac import ROUTER_RULES
from prorsa.policy.allocate import Role
from prorsa.router.requests import TRAJECTORY_HEADER

PROBE_PORT = 8081
SIDE_CHANNEL_PORT = 5600
LABELS_DIR = "/etc/prorsa"
REDIS_IMAGE = "redis:7.4.2-alpine"
LWS_API = "leaderworkerset.x-k8s.io/v1"  # Kubernetes SIG Apps' multi-node workload


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def _meta(name: str, namespace: str, owner: dict[str, Any], component: str, cluster: str,
          **labels: str) -> dict[str, Any]:  # fmt: skip
    return {
        "name": name,
        "namespace": namespace,
        "labels": {L.CLUSTER: cluster, L.COMPONENT: component, **labels},
        "ownerReferences": [owner],
    }


def redis_url(cluster: str, spec: RolloutClusterSpec) -> str:
    return spec.redis.url or f"redis://{cluster}-redis:6379/0"


def redis_password_env(cluster: str, spec: RolloutClusterSpec) -> list[dict[str, Any]]:
    ref = spec.redis.passwordSecretRef
    if spec.redis.managed:
        ref_name, key = f"{cluster}-redis", "password"
    elif ref is not None:
        ref_name, key = ref.name, ref.key
    else:
        return []
    return [{"name": "REDIS_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": ref_name, "key": key}}}]  # fmt: skip


def _worker_container(spec: RolloutClusterSpec, name: str, role: Role,
                      group: list[str]) -> dict[str, Any]:  # fmt: skip
    """The `prorsa worker` container: its role, every role's vLLM arguments (a relabel
    switches it in place, and the agent restarts the engine where the new role's arguments
    differ), and the pod's GPUs."""
    w = spec.workers
    limits = {**w.resources.limits}
    limits.setdefault("nvidia.com/gpu", str(min(w.slot_gpus, w.gpusPerNode)))
    role_args = {r.value: w.layout(r).vllm_args() for r in Role}
    args = [  # the worker image's entrypoint is `prorsa worker`
        "--model", spec.model.name, "--name", name, "--port", str(w.port),
        "--role", role.value, "--role-file", f"{LABELS_DIR}/labels",
        "--connector", spec.kvTransfer.connector, "--switch-mode", spec.kvTransfer.switchMode,
        "--side-channel-host", "$(POD_IP)", "--side-channel-port", str(SIDE_CHANNEL_PORT),
        "--probe-port", str(PROBE_PORT),
        "--drain-timeout", f"{spec.allocation.drainTimeoutSeconds:g}",
        "--role-args", json.dumps(role_args, separators=(",", ":")), *group,
    ]  # fmt: skip
    if spec.model.servedName:
        args += ["--served-model-name", spec.model.servedName]
    return {
        "name": "worker",
        "image": w.image,
        "args": args,
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "http", "containerPort": w.port},
            {"name": "nixl", "containerPort": SIDE_CHANNEL_PORT},
            {"name": "probe", "containerPort": PROBE_PORT},
        ],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "probe"},
                           "periodSeconds": 2, "failureThreshold": 1},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "probe"},
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": dict(w.resources.requests), "limits": limits},
        "volumeMounts": [{"name": "podinfo", "mountPath": LABELS_DIR, "readOnly": True}],
    }  # fmt: skip


def _worker_pod_spec(spec: RolloutClusterSpec, container: dict[str, Any]) -> dict[str, Any]:
    w = spec.workers
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "podinfo", "downwardAPI": {
            "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}],
        "terminationGracePeriodSeconds": int(spec.allocation.drainTimeoutSeconds) + 30,
        "nodeSelector": dict(w.nodeSelector),
        "tolerations": [t.model_dump() for t in w.tolerations],
    }  # fmt: skip
    if w.affinity is not None:
        pod_spec["affinity"] = w.affinity.model_dump()
    return pod_spec


def _worker_labels(cluster: str, index: int, role: Role) -> dict[str, str]:
    return {L.CLUSTER: cluster, L.COMPONENT: L.WORKER, L.ROLE: role.value,
            L.WORKER_INDEX: str(index)}  # fmt: skip


def worker_pod(cluster: str, namespace: str, owner: dict[str, Any], spec: RolloutClusterSpec,
               index: int, role: Role) -> dict[str, Any]:  # fmt: skip
    """A worker whose engines fit one node: one pod, owned by the RolloutCluster."""
    name = f"{cluster}-worker-{index}"
    meta = _meta(name, namespace, owner, L.WORKER, cluster)
    meta["labels"] = _worker_labels(cluster, index, role)
    meta["annotations"] = {L.PORT: str(spec.workers.port)}
    pod_spec = _worker_pod_spec(spec, _worker_container(spec, name, role, []))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def worker_group(cluster: str, namespace: str, owner: dict[str, Any], spec: RolloutClusterSpec,
                 index: int, role: Role) -> dict[str, Any]:  # fmt: skip
    """A worker whose engines span nodes: a LeaderWorkerSet of one group, one pod per node.

    The leader pod (`<name>-0`) is the worker the controller and the role label know; the
    other nodes follow its role, running data-parallel ranks headless, or, in a role whose
    engines are narrower than the worker (`prorsa.io/engine-nodes`), each engine's first node
    serving that engine, an endpoint of the router's. The
    role is also recorded on the LeaderWorkerSet (`prorsa.io/role`, never in its template, so a
    switch rolls nothing out): a group the LeaderWorkerSet recreates starts with its template's
    role, and the operator relabels its leader to the recorded one.
    """
    w = spec.workers
    name = f"{cluster}-worker-{index}"
    nodes = w.slot_gpus // w.gpusPerNode
    group = ["--group-leader", "$(LWS_LEADER_ADDRESS)"]
    leader = _worker_container(spec, "$(POD_NAME)", role, group)
    follower = _worker_container(spec, "$(POD_NAME)", role, [*group, "--node-rank",
                                                              "$(LWS_WORKER_INDEX)"])  # fmt: skip
    follower["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "probe"},
                                  "periodSeconds": 5}  # fmt: skip
    meta = _meta(name, namespace, owner, L.WORKER_GROUP, cluster, **{L.ROLE: role.value})
    meta["labels"][L.WORKER_INDEX] = str(index)
    annotations = {L.PORT: str(w.port)}
    narrower = {r.value: w.layout(r).nodes for r in Role if w.layout(r).nodes < nodes}
    if narrower:  # where a role's engines are narrower than the worker, each is an endpoint
        annotations[L.ENGINE_NODES] = json.dumps(narrower, sort_keys=True)
    template = {
        "size": nodes,
        "restartPolicy": "RecreateGroupOnPodRestart",  # a lost node loses the engine
        "leaderTemplate": {
            "metadata": {"labels": _worker_labels(cluster, index, role),
                         "annotations": dict(annotations)},
            "spec": _worker_pod_spec(spec, leader),
        },
        "workerTemplate": {
            "metadata": {"labels": {L.CLUSTER: cluster, L.COMPONENT: L.WORKER_NODE,
                                    L.WORKER_INDEX: str(index)},
                         "annotations": dict(annotations)},
            "spec": _worker_pod_spec(spec, follower),
        },
    }  # fmt: skip
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta,
            "spec": {"replicas": 1, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": template}}  # fmt: skip


def worker_unit(cluster: str, namespace: str, owner: dict[str, Any], spec: RolloutClusterSpec,
                index: int, role: Role) -> dict[str, Any]:  # fmt: skip
    """The object one worker is made of: a pod, or a LeaderWorkerSet where it spans nodes."""
    build = worker_group if spec.workers.multi_node else worker_pod
    return build(cluster, namespace, owner, spec, index, role)


def router_deployment(cluster: str, namespace: str, owner: dict[str, Any],
                      spec: RolloutClusterSpec, image: str = DEFAULT_OPERATOR_IMAGE
                      ) -> dict[str, Any]:  # fmt: skip
    labels = {L.CLUSTER: cluster, L.COMPONENT: L.ROUTER}
    args = [
        "router", "--cluster", f"{namespace}/{cluster}", "--redis-url", redis_url(cluster, spec),
        "--discovery", "kubernetes", "--switch-mode", spec.kvTransfer.switchMode,
        "--port", str(spec.router.port),
    ]  # fmt: skip
    container = {
        "name": "router",
        "image": image,
        "args": args,
        "env": redis_password_env(cluster, spec),
        "ports": [{"name": "http", "containerPort": spec.router.port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(f"{cluster}-router", namespace, owner, L.ROUTER, cluster),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"serviceAccountName": f"{cluster}-router", "containers": [container]},
            },
        },
    }


def router_service(cluster: str, namespace: str, owner: dict[str, Any],
                   spec: RolloutClusterSpec) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cluster, namespace, owner, L.ROUTER, cluster),
        "spec": {
            "type": spec.router.serviceType,
            "selector": {L.CLUSTER: cluster, L.COMPONENT: L.ROUTER},
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http"}],
        },
    }


def role_service(cluster: str, namespace: str, owner: dict[str, Any], role: Role,
                 spec: RolloutClusterSpec) -> dict[str, Any]:  # fmt: skip
    """Headless: DNS names of the workers currently in `role` (for tools and debugging)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{cluster}-{role.value}", namespace, owner, L.WORKER, cluster),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": {L.CLUSTER: cluster, L.COMPONENT: L.WORKER, L.ROLE: role.value},
            "ports": [{"name": "http", "port": spec.workers.port, "targetPort": "http"}],
        },
    }


def router_rbac(cluster: str, namespace: str, owner: dict[str, Any]) -> list[dict[str, Any]]:
    """The router watches its cluster's worker pods and nothing else."""
    name = f"{cluster}-router"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": _meta(name, namespace, owner, L.ROUTER, cluster)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _meta(name, namespace, owner, L.ROUTER, cluster),
         "rules": [r.as_dict() for r in ROUTER_RULES]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(name, namespace, owner, L.ROUTER, cluster),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]  # fmt: skip


def managed_redis(cluster: str, namespace: str, owner: dict[str, Any]) -> list[dict[str, Any]]:
    """A single Redis for the cluster's events and in-flight counts, password from the
    `<cluster>-redis` Secret (created once by the operator)."""
    name = f"{cluster}-redis"
    labels = {L.CLUSTER: cluster, L.COMPONENT: "redis"}
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["--requirepass", "$(REDIS_PASSWORD)", "--appendonly", "yes"],
        "env": [{"name": "REDIS_PASSWORD",
                 "valueFrom": {"secretKeyRef": {"name": name, "key": "password"}}}],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 999,
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": _meta(name, namespace, owner, "redis", cluster),
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels},
                               "spec": {"containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": _meta(name, namespace, owner, "redis", cluster),
         "spec": {"selector": labels, "ports": [{"name": "redis", "port": 6379,
                                                 "targetPort": "redis"}]}},
    ]  # fmt: skip


def redis_secret(cluster: str, namespace: str, owner: dict[str, Any], password: str
                 ) -> dict[str, Any]:  # fmt: skip
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(f"{cluster}-redis", namespace, owner, "redis", cluster),
            "stringData": {"password": password}}  # fmt: skip


def endpoint(cluster: str, namespace: str, spec: RolloutClusterSpec) -> str:
    return f"http://{cluster}.{namespace}.svc:{spec.router.port}/v1"


def trainer_pod(cluster: str, namespace: str, owner: dict[str, Any], spec: RolloutClusterSpec
                ) -> dict[str, Any] | None:  # fmt: skip
    """The user's trainer, from their pod template, wired to the cluster: the endpoint (also
    as OPENAI_BASE_URL, so OpenAI clients need no code), the trajectory header, the Redis."""
    if spec.trainer is None:
        return None
    template = spec.trainer.template.model_dump()
    pod_spec: dict[str, Any] = dict(template.get("spec") or {})
    pod_spec.setdefault("restartPolicy", "OnFailure")
    url = endpoint(cluster, namespace, spec)
    wiring = [
        {"name": "PRORSA_ENDPOINT", "value": url},
        {"name": "OPENAI_BASE_URL", "value": url},
        {"name": "OPENAI_API_KEY", "value": "unused"},  # the router asks for none
        {"name": "PRORSA_TRAJECTORY_HEADER", "value": TRAJECTORY_HEADER},
        {"name": "PRORSA_REDIS_URL", "value": redis_url(cluster, spec)},
        *redis_password_env(cluster, spec),
    ]
    containers = []
    for c in pod_spec.get("containers") or []:
        own = {e.get("name") for e in c.get("env") or []}
        containers.append({**c, "env": [*(c.get("env") or []),
                                        *(e for e in wiring if e["name"] not in own)]})  # fmt: skip
    pod_spec["containers"] = containers
    meta = _meta(f"{cluster}-trainer", namespace, owner, L.TRAINER, cluster)
    user_meta = template.get("metadata") or {}
    meta["labels"] = {**(user_meta.get("labels") or {}), **meta["labels"]}
    if user_meta.get("annotations"):
        meta["annotations"] = dict(user_meta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def children(cluster: str, namespace: str, uid: str, spec: RolloutClusterSpec,
             roles: list[Role], router_image: str = DEFAULT_OPERATOR_IMAGE
             ) -> list[dict[str, Any]]:  # fmt: skip
    """Everything the cluster needs besides a managed Redis, in creation order."""
    owner = owner_reference(cluster, uid)
    objs = [
        *router_rbac(cluster, namespace, owner),
        router_service(cluster, namespace, owner, spec),
    ]
    objs += [role_service(cluster, namespace, owner, r, spec) for r in (Role.PREFILL, Role.DECODE)]
    objs.append(router_deployment(cluster, namespace, owner, spec, router_image))
    objs += [worker_unit(cluster, namespace, owner, spec, i, r) for i, r in enumerate(roles)]
    trainer = trainer_pod(cluster, namespace, owner, spec)
    if trainer is not None:
        objs.append(trainer)
    return objs
