"""The operator for real (kopf) against kmock's Kubernetes API emulator: a RolloutCluster
becomes pods, Services, a router and a status; scaling patches resize it; a spec that cannot be
honoured becomes a condition and an event, not a crash loop."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kopf
import kubernetes_validate
import yaml
from kmock import KubernetesEmulator, Server

from prorsa.api.models import GROUP, KIND, PLURAL, SINGULAR, VERSION
from prorsa.kube import handlers, rbac
from prorsa.kube import labels as L
from prorsa.kube.api import USER_AGENT, KubeApi
from prorsa.policy.allocate import Role

# at import, not inside a test: a test importing it while the emulator's thread ran once met
# CPython 3.11's "AST constructor recursion depth mismatch" in pytest's rewrite of it
from test_api import _openapi_to_jsonschema

NS = "team"
_server: dict[str, str] = {}


@kopf.on.login()
def _login(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=_server["url"])


CORE = [
    ("v1/pods", "Pod"), ("v1/services", "Service"), ("v1/secrets", "Secret"),
    ("v1/serviceaccounts", "ServiceAccount"), ("v1/events", "Event"),
    ("v1/configmaps", "ConfigMap"), ("apps/v1/deployments", "Deployment"),
    ("rbac.authorization.k8s.io/v1/roles", "Role"),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding"),
]  # fmt: skip


CLUSTER_SCOPED = [
    ("v1/namespaces", "Namespace"),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition"),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering"),
]


def _register_crd(k8s: KubernetesEmulator) -> None:
    for key, kind in CLUSTER_SCOPED:
        k8s.resources[key] = {"namespaced": False, "kind": kind, "singular": kind.lower(),
                              "shortnames": [], "categories": [], "subresources": [],
                              "verbs": ["create", "delete", "get", "list", "patch",
                                        "watch"]}  # fmt: skip
    verbs = ["create", "delete", "get", "list", "patch", "watch"]
    for key, kind in CORE:
        k8s.resources[key] = {"namespaced": True, "kind": kind, "singular": kind.lower(),
                              "shortnames": [], "categories": [], "subresources": [],
                              "verbs": verbs}  # fmt: skip
    lws = yaml.safe_load(LWS_CRD.read_text())["spec"]  # multi-node workers
    k8s.resources[f"{lws['group']}/{lws['versions'][0]['name']}/{lws['names']['plural']}"] = {
        "namespaced": True, "kind": lws["names"]["kind"], "singular": lws["names"]["singular"],
        "shortnames": lws["names"]["shortNames"], "categories": [],
        "subresources": sorted(lws["versions"][0]["subresources"]), "verbs": verbs,
    }  # fmt: skip
    k8s.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = {
        "namespaced": True, "kind": KIND, "singular": SINGULAR, "shortnames": ["rcl"],
        "categories": ["prorsa"], "subresources": ["status", "scale"],
        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
    }  # fmt: skip


def rcl(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    # kmock assigns neither a resourceVersion nor a uid; kopf's daemon bookkeeping needs the
    # first, and keeps its per-object memory by the second (two objects without one share it)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": NS, "resourceVersion": "1",
                         "uid": f"uid-{name}"},
            "spec": spec}  # fmt: skip


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


_VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create",
          "DELETE": "delete"}  # fmt: skip


def operator_calls(k8s: KubernetesEmulator) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every request kopf and the handlers made (discovery
    requests, which every account may make, name no resource)."""
    calls = set()
    for req in list(k8s):
        agent = req.headers.get("User-Agent", "")
        if (
            req.resource is None
            or req.resource.plural is None
            or not agent.startswith(("kopf/", USER_AGENT))
        ):
            continue
        verb = _VERBS.get(req.action.value if req.action else "") or (
            "patch" if req.method.value == "PATCH" else "update")  # fmt: skip
        plural = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        calls.add((req.resource.group or "", plural, verb))
    return calls


@contextlib.contextmanager
def serving_emulator() -> Iterator[KubernetesEmulator]:
    """kmock's API emulator with the resources the operator uses, serving from a thread and an
    event loop of its own, as an API server is a process of its own: kopf, when it stops,
    cancels every task of its loop that it did not find at startup, and would take the
    emulator's connections down with them while a daemon it respawned late still asks."""
    ready: queue.Queue[KubernetesEmulator | BaseException] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        try:
            async with KubernetesEmulator() as k8s, Server(k8s):
                _register_crd(k8s)
                ready.put(k8s)
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        except BaseException as e:
            ready.put(e)
            raise

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="kmock", daemon=True)
    thread.start()
    k8s = ready.get(timeout=30)
    if isinstance(k8s, BaseException):
        raise RuntimeError("the API emulator did not start") from k8s
    try:
        yield k8s
    finally:
        stop.set()
        thread.join(30)


@contextlib.asynccontextmanager
async def kmock_api() -> AsyncIterator[KubeApi]:
    """The emulator, a client for the handlers and another for the test. On the way out:
    every request the operator made is one the Helm chart's RBAC grants (`prorsa.kube.rbac`),
    so a new API call cannot go ungranted."""
    with serving_emulator() as k8s:
        url = str(k8s.url).rstrip("/")
        _server["url"] = url
        operator_api = KubeApi(url, ssl_context=False)
        api = KubeApi(url, ssl_context=False, user_agent="prorsa-tests")
        handlers.configure(operator_api)
        try:
            yield api
        finally:
            await api.close()
            await operator_api.close()
    rules = rbac.operator_rules(clusterwide=True)
    calls = operator_calls(k8s)
    assert ("", "pods", "list") in calls  # the requests were seen at all
    ungranted = {c for c in calls if not rbac.allowed(rules, *c)}
    assert not ungranted, f"API calls the chart's RBAC does not grant: {sorted(ungranted)}"


@contextlib.asynccontextmanager
async def running_operator(peering: str | None = None, priority: int = 0
                           ) -> AsyncIterator[None]:  # fmt: skip
    """The real operator (every handler of prorsa.kube.handlers) for the duration; alone, or
    one replica of several that elect one through kopf peering."""
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    op = asyncio.create_task(kopf.operator(
        standalone=peering is None, peering_name=peering, priority=priority, clusterwide=True,
        stop_flag=stop))  # fmt: skip
    try:
        yield
    finally:
        stop.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(op, 30)


async def rcl_status(api: KubeApi, name: str) -> dict[str, Any]:
    obj = await api.get(f"{GROUP}/{VERSION}", KIND, NS, name)
    return (obj or {}).get("status") or {}


async def worker_pods(api: KubeApi, cluster: str) -> list[dict[str, Any]]:
    return await api.list("v1", "Pod", NS, L.worker_selector(cluster))


async def mark_ready(api: KubeApi, cluster: str) -> None:
    """What the kubelet would report once the engines answer."""
    for i, p in enumerate(await worker_pods(api, cluster)):
        await api.patch("v1", "Pod", NS, p["metadata"]["name"], {"status": {
            "podIP": f"127.0.0.{i + 2}",
            "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip


async def role_counts(api: KubeApi, cluster: str) -> dict[str, int]:
    roles = [p["metadata"]["labels"][L.ROLE] for p in await worker_pods(api, cluster)]
    return {r: roles.count(r) for r in set(roles)}


@contextlib.asynccontextmanager
async def routers_reporting(redis_url: str, cluster: str, busy: dict[str, int]
                            ) -> AsyncIterator[None]:  # fmt: skip
    """A router's in-flight reports for the cluster's workers, every 100 ms: `busy` maps a
    worker to its running decodes (edit it to change what the router reports)."""
    import time

    from redis.asyncio import Redis

    from prorsa.events import inflight
    from prorsa.events.keys import ClusterKeys

    stop = asyncio.Event()
    keys = ClusterKeys(NS, cluster)

    async def report(r: Redis) -> None:
        while not stop.is_set():
            now = time.time()
            await r.hset(keys.workers, mapping={
                inflight.field(f"{cluster}-worker-{i}", "router-0"):
                inflight.value(0, busy.get(f"{cluster}-worker-{i}", 0), now)
                for i in range(8)})  # fmt: skip
            await asyncio.sleep(0.1)

    async with Redis.from_url(redis_url) as r:
        task = asyncio.create_task(report(r))
        try:
            yield
        finally:
            stop.set()
            await task


async def has_workers(api: KubeApi, cluster: str, n: int) -> bool:
    return len(await worker_pods(api, cluster)) == n


def _operator_metrics() -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(handlers.METRICS)
    return generate_latest(registry).decode()


async def decided(api: KubeApi, cluster: str, target: str) -> bool:
    last = (await rcl_status(api, cluster)).get("lastDecision") or {}
    return bool(last.get("target") == target)


def test_a_rollout_cluster_becomes_pods_services_and_status(redis_url: str) -> None:
    async def main() -> None:
        async with kmock_api() as api:
            assert await api.create(rcl("rl", {
                "model": {"name": "Qwen/Qwen3-8B"}, "workers": {"replicas": 2},
                "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1},
                "trainer": {"template": {"spec": {"containers": [
                    {"name": "grpo", "image": "trainer:1"}]}}},
            }))  # fmt: skip
            async with running_operator():
                await until(lambda: has_workers(api, "rl", 2), 20, "two worker pods")
                got = await worker_pods(api, "rl")
                assert sorted(p["metadata"]["labels"][L.ROLE] for p in got) == [
                    "decode", "prefill"]  # fmt: skip
                for p in got:
                    assert p["metadata"]["ownerReferences"][0]["name"] == "rl"
                for kind, api_version in (("Service", "v1"), ("ServiceAccount", "v1"),
                                          ("Deployment", "apps/v1"),
                                          ("Role", "rbac.authorization.k8s.io/v1"),
                                          ("RoleBinding", "rbac.authorization.k8s.io/v1"),
                                          ("Pod", "v1")):  # fmt: skip
                    children = await api.list(api_version, kind, NS, f"{L.CLUSTER}=rl")
                    assert children, kind
                    for child in children:  # deleting the RolloutCluster collects them
                        [ref] = child["metadata"]["ownerReferences"]
                        assert ref["kind"] == KIND and ref["name"] == "rl" and ref["controller"]
                trainer = await api.get("v1", "Pod", NS, "rl-trainer")
                assert trainer is not None  # wired to the endpoint (test_kube_builders)
                assert trainer["metadata"]["labels"][L.COMPONENT] == "trainer"
                svc = await api.get("v1", "Service", NS, "rl")
                assert svc is not None and svc["spec"]["selector"][L.COMPONENT] == "router"
                assert await api.get("apps/v1", "Deployment", NS, "rl-router") is not None

                async def has_endpoint() -> bool:
                    return bool((await rcl_status(api, "rl")).get("endpoint"))

                await until(has_endpoint, 20, "the endpoint in the status")
                await mark_ready(api, "rl")
                await until(lambda: decided(api, "rl", "1P:1D"), 30,
                            "the controller daemon's decision over 2 workers")  # fmt: skip
                exposition = _operator_metrics()  # what `prorsa operator` serves on /metrics
                assert 'prorsa_target_workers{cluster="rl",namespace="team",role="prefill"} 1.0' \
                    in exposition  # fmt: skip
                st = await rcl_status(api, "rl")
                assert st["endpoint"] == "http://rl.team.svc:8080/v1"
                assert st["replicas"] == 2 and st["selector"] == L.worker_selector("rl")

                await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "rl",
                                {"spec": {"workers": {"replicas": 3}}})  # fmt: skip
                await until(lambda: has_workers(api, "rl", 3), 30, "scale up to three workers")
                await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "rl",
                                {"spec": {"workers": {"replicas": 2}}})  # fmt: skip
                await until(lambda: has_workers(api, "rl", 2), 30, "scale down to two workers")
                kept = sorted(p["metadata"]["name"] for p in await worker_pods(api, "rl"))
                assert kept == ["rl-worker-0", "rl-worker-1"]  # the new, unready one went

                await api.delete("v1", "Pod", NS, "rl-worker-1")  # a node lost, an eviction

                async def replaced() -> bool:
                    events = await api.list("v1", "Event", NS, "")
                    return await has_workers(api, "rl", 2) and any(
                        e.get("reason") == "Replaced" for e in events)  # fmt: skip

                await until(replaced, 30, "the lost worker replaced")
                fresh = await api.get("v1", "Pod", NS, "rl-worker-1")
                assert fresh is not None and "status" not in fresh  # a new pod, not yet ready

                assert await api.create(rcl("bad", {
                    "model": {"name": "m"}, "workers": {"replicas": 2},
                    "allocation": {"minPrefill": 2, "minDecode": 1},
                }))  # fmt: skip

                async def refused() -> bool:
                    conds = (await rcl_status(api, "bad")).get("conditions") or []
                    return any(c["type"] == "Degraded" and c["reason"] == "InvalidSpec"
                               for c in conds)  # fmt: skip

                await until(refused, 20, "the InvalidSpec condition")
                assert await api.list("v1", "Pod", NS, L.worker_selector("bad")) == []

    asyncio.run(main())


def _pod(i: int, ready: bool, draining: bool = False) -> dict[str, Any]:
    ann = {L.DRAINING: "true"} if draining else {}
    return {"metadata": {"name": f"rl-worker-{i}", "annotations": ann},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}  # fmt: skip


def test_scale_down_picks_unready_then_newest_and_never_a_draining_worker() -> None:
    from prorsa.kube.handlers import _scale_down_victims

    live = [_pod(0, True), _pod(1, True, draining=True), _pod(2, True), _pod(3, False)]
    names = [p["metadata"]["name"] for p in _scale_down_victims(live, 2, live)]
    assert names == ["rl-worker-3", "rl-worker-2"]
    assert _scale_down_victims(live, 4, live) == []
    # the draining one is kept even when that leaves more than asked (next reconcile retries)
    assert [p["metadata"]["name"] for p in _scale_down_victims(live, 0, live)] == [
        "rl-worker-3", "rl-worker-2", "rl-worker-0"]  # fmt: skip


def test_an_invalid_edit_of_a_running_cluster_changes_nothing(redis_url: str) -> None:
    """`kubectl edit` with a value the API server's CEL rules would refuse (reaching the operator
    anyway, as through an older CRD): a Degraded/InvalidSpec condition and a Warning Event
    naming the field; no pod created, deleted or relabelled; a valid edit resumes."""

    async def main() -> None:
        async with kmock_api() as api:
            await api.create(rcl("edited", {
                "model": {"name": "m"}, "workers": {"replicas": 2}, "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1},
            }))  # fmt: skip
            async with running_operator():
                await until(lambda: has_workers(api, "edited", 2), 20, "two workers")
                await mark_ready(api, "edited")

                await until(lambda: decided(api, "edited", "1P:1D"), 30, "the daemon deciding")
                before = {p["metadata"]["name"]: p["metadata"]["labels"][L.ROLE]
                          for p in await worker_pods(api, "edited")}  # fmt: skip
                await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "edited", {"spec": {
                    "workers": {"replicas": 4, "engineArgs": ["--port", "9999"]}}})  # fmt: skip

                async def refused() -> bool:
                    st = await rcl_status(api, "edited")
                    return st.get("phase") == "Degraded" and any(
                        c["type"] == "Degraded"
                        and c["reason"] == "InvalidSpec"
                        and "engineArgs" in c["message"]
                        for c in st.get("conditions") or []
                    )

                await until(refused, 30, "the InvalidSpec condition on the running cluster")

                async def warned() -> bool:
                    events = await api.list("v1", "Event", NS, "")
                    return any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning"
                               and "engineArgs" in (e.get("message") or "")
                               for e in events)  # fmt: skip

                await until(warned, 20, "a Warning event naming the field")
                await asyncio.sleep(3)  # give a wrong reconcile the time to act
                after = {p["metadata"]["name"]: p["metadata"]["labels"][L.ROLE]
                         for p in await worker_pods(api, "edited")}  # fmt: skip
                assert after == before
                await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "edited", {"spec": {
                    "workers": {"replicas": 3, "engineArgs": []}}})  # fmt: skip
                await until(lambda: has_workers(api, "edited", 3), 30, "the valid edit applied")

    asyncio.run(main())


def test_roles_with_their_own_engines_get_them(
    redis_url: str,
) -> None:
    """Stage-specific parallelism through the operator: each pod carries every role's vLLM
    arguments and the worker's GPUs, the status each role's engine size."""

    async def main() -> None:
        async with kmock_api() as api:
            await api.create(rcl("staged", {
                "model": {"name": "m"}, "redis": {"url": redis_url},
                "workers": {"replicas": 2, "gpusPerWorker": 4, "expertParallel": True,
                            "prefill": {"dataParallelSize": 4},
                            "decode": {"engineArgs": ["--max-num-seqs", "512"]}},
                "kvTransfer": {"switchMode": "restart"},
                "allocation": {"policy": "static", "staticPrefill": 1},
            }))  # fmt: skip
            async with running_operator():
                await until(lambda: has_workers(api, "staged", 2), 20, "two workers")
                for pod in await worker_pods(api, "staged"):
                    c = pod["spec"]["containers"][0]
                    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
                    per_role = json.loads(c["args"][c["args"].index("--role-args") + 1])
                    assert per_role["prefill"] == ["--data-parallel-size", "4",
                                                   "--enable-expert-parallel"]  # fmt: skip
                    assert per_role["decode"] == ["--tensor-parallel-size", "4",
                                                  "--enable-expert-parallel",
                                                  "--max-num-seqs", "512"]  # fmt: skip

                async def sized() -> bool:
                    st = await rcl_status(api, "staged")
                    return (st.get("prefillUnitGPUs"), st.get("decodeUnitGPUs")) == (4, 4)

                await until(sized, 20, "each role's engine size in the status")

    asyncio.run(main())


LWS_CRD = Path(__file__).parent / "data" / "leaderworkerset-crd.yaml"
LWS = "leaderworkerset.x-k8s.io/v1"


def _lws_schema() -> dict[str, Any]:
    crd = yaml.safe_load(LWS_CRD.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def assert_valid_group(group: dict[str, Any]) -> None:
    """What the API server would check of a LeaderWorkerSet: its CRD's schema (the upstream
    one, `tests/data`), and each pod template as a Pod of the Kubernetes schema."""
    jsonschema.validate(group, _openapi_to_jsonschema(_lws_schema()))
    t = group["spec"]["leaderWorkerTemplate"]
    for which in ("leaderTemplate", "workerTemplate"):
        meta = {"name": "p", **t[which]["metadata"]}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": t[which]["spec"]}
        kubernetes_validate.validate(pod, "1.37.0", strict=True)


async def groups(api: KubeApi, cluster: str) -> list[dict[str, Any]]:
    return await api.list(LWS, "LeaderWorkerSet", NS, L.group_selector(cluster))


async def lws_controller_creates(api: KubeApi, group: dict[str, Any]) -> dict[str, Any]:
    """What the LeaderWorkerSet controller does for a group (kmock runs no controllers): its
    leader pod `<name>-0` from the leader template, with the LWS labels, ready."""
    name = group["metadata"]["name"]
    t = group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    meta = copy.deepcopy(t["metadata"])
    meta.update(name=f"{name}-0", namespace=NS)
    meta["labels"].update({L.LWS_NAME: name, "leaderworkerset.sigs.k8s.io/worker-index": "0"})
    await api.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                      "spec": copy.deepcopy(t["spec"])})  # fmt: skip
    await api.patch("v1", "Pod", NS, meta["name"], {"status": {
        "podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip
    pod = await api.get("v1", "Pod", NS, meta["name"])
    assert pod is not None
    return pod


def test_workers_wider_than_a_node_are_leader_worker_sets(redis_url: str) -> None:
    """A worker of 16 GPUs on nodes of 8: a LeaderWorkerSet of two pods, valid against the
    upstream CRD and the Pod schema, whose first node serves and whose second runs its ranks
    headless. A switch records the role on the LeaderWorkerSet, a group it recreates gets its
    role back, scale-down removes a whole group."""

    async def main() -> None:
        async with kmock_api() as api:
            await api.create(rcl("wide", {
                "model": {"name": "m"}, "redis": {"url": redis_url},
                "workers": {"replicas": 2, "gpusPerWorker": 16, "dataParallelSize": 16,
                            "expertParallel": True,
                            "decode": {"engineArgs": ["--max-num-seqs", "256"]}},
                "kvTransfer": {"switchMode": "restart"},
                "allocation": {"policy": "static", "staticPrefill": 1},
            }))  # fmt: skip
            async with running_operator():

                async def two_groups() -> bool:
                    return len(await groups(api, "wide")) == 2

                await until(two_groups, 20, "two LeaderWorkerSets")
                assert await worker_pods(api, "wide") == []  # the LWS controller makes them
                by_role = {g["metadata"]["labels"][L.ROLE]: g for g in await groups(api, "wide")}
                assert sorted(by_role) == ["decode", "prefill"]
                for g in by_role.values():
                    assert_valid_group(g)
                    assert g["metadata"]["ownerReferences"][0]["name"] == "wide"
                    t = g["spec"]["leaderWorkerTemplate"]
                    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
                    leader = t["leaderTemplate"]["spec"]["containers"][0]
                    follower = t["workerTemplate"]["spec"]["containers"][0]
                    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one node
                    assert "--node-rank" not in leader["args"]
                    assert follower["args"][follower["args"].index("--node-rank") + 1] == \
                        "$(LWS_WORKER_INDEX)"  # fmt: skip
                    for c in (leader, follower):
                        per_role = json.loads(c["args"][c["args"].index("--role-args") + 1])
                        assert per_role["prefill"] == [
                            "--data-parallel-size", "16", "--data-parallel-size-local", "8",
                            "--enable-expert-parallel"]  # fmt: skip
                        assert per_role["decode"][-2:] == ["--max-num-seqs", "256"]
                        assert c["args"][c["args"].index("--group-leader") + 1] == \
                            "$(LWS_LEADER_ADDRESS)"  # fmt: skip
                    # only the first node is a worker the router and the controller see
                    assert t["leaderTemplate"]["metadata"]["labels"][L.COMPONENT] == L.WORKER
                    assert t["workerTemplate"]["metadata"]["labels"][L.COMPONENT] == \
                        L.WORKER_NODE  # fmt: skip

                pods = {r: await lws_controller_creates(api, g) for r, g in by_role.items()}

                async def ready() -> bool:
                    st = await rcl_status(api, "wide")
                    return (st.get("ready"), st.get("prefill"), st.get("decode")) == (2, 1, 1)

                await until(ready, 30, "the status from the leader pods")

                # a switch (the controller's adapter): the role goes on the LWS, then the pod
                from redis.asyncio import Redis

                from prorsa.events.keys import ClusterKeys
                from prorsa.kube.cluster import KubeCluster

                async with Redis.from_url(redis_url) as r:
                    cluster = KubeCluster(api, r, ClusterKeys(NS, "wide"))
                    leader = pods["prefill"]["metadata"]["name"]
                    await cluster.set_role(leader, Role.DECODE)
                group = await api.get(LWS, "LeaderWorkerSet", NS,
                                      by_role["prefill"]["metadata"]["name"])  # fmt: skip
                assert group is not None and group["metadata"]["labels"][L.ROLE] == "decode"
                assert (
                    group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"][
                        L.ROLE
                    ]
                    == "prefill"
                )  # the template is untouched: no rollout

                # the LWS recreates the group (a node lost): its leader starts as "prefill"
                await api.delete("v1", "Pod", NS, leader)
                fresh = await lws_controller_creates(api, group)
                assert fresh["metadata"]["labels"][L.ROLE] == "prefill"

                async def relabelled() -> bool:
                    pod = await api.get("v1", "Pod", NS, leader)
                    return bool(pod and pod["metadata"]["labels"][L.ROLE] == "decode")

                await until(relabelled, 30, "the recreated leader relabelled to its role")
                assert len(await groups(api, "wide")) == 2  # nothing replaced: the LWS does

                async def count(n: int) -> bool:
                    return len(await groups(api, "wide")) == n

                for n in (3, 2):
                    await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "wide",
                                    {"spec": {"workers": {"replicas": n}}})  # fmt: skip
                    await until(functools.partial(count, n), 30, f"scaled to {n} groups")
                kept = sorted(g["metadata"]["name"] for g in await groups(api, "wide"))
                assert kept == ["wide-worker-0", "wide-worker-1"]  # the new, podless one went

    asyncio.run(main())


def test_a_multi_node_worker_with_narrower_engines_is_built_for_them(redis_url: str) -> None:
    """Prefill engines of 8 GPUs in a 16-GPU worker spanning two nodes: one LeaderWorkerSet
    per worker whose pods say each prefill engine spans one node (the router serves one
    endpoint per engine), whose every node may serve an API, and whose status is the worker's."""

    async def main() -> None:
        async with kmock_api() as api:
            await api.create(rcl("split", {
                "model": {"name": "m"}, "redis": {"url": redis_url},
                "workers": {"replicas": 2, "gpusPerWorker": 16, "dataParallelSize": 16,
                            "prefill": {"gpusPerWorker": 8}},
                "kvTransfer": {"switchMode": "restart"},
                "allocation": {"initialPrefill": 1},
            }))  # fmt: skip
            async with running_operator():

                async def two() -> bool:
                    return len(await groups(api, "split")) == 2

                await until(two, 20, "two groups")
                made = await groups(api, "split")
                for g in made:
                    t = g["spec"]["leaderWorkerTemplate"]
                    for part in ("leaderTemplate", "workerTemplate"):
                        ann = t[part]["metadata"]["annotations"]
                        assert json.loads(ann[L.ENGINE_NODES]) == {"prefill": 1}
                        assert ann[L.PORT] == "8000"
                st = await rcl_status(api, "split")
                assert not any(c["type"] == "Degraded" and c["status"] == "True"
                               for c in st.get("conditions") or [])  # fmt: skip

    asyncio.run(main())


async def ask_for_a_second_prefill_worker(api: KubeApi, cluster: str) -> None:
    """Three workers of a static 1P cluster become ready and the daemon decides 1P:2D; then
    `kubectl edit` sets staticPrefill to 2."""
    await until(lambda: has_workers(api, cluster, 3), 20, "three workers")
    await mark_ready(api, cluster)
    await until(lambda: decided(api, cluster, "1P:2D"), 30,
                "the decision over three ready workers")  # fmt: skip
    await api.patch(f"{GROUP}/{VERSION}", KIND, NS, cluster,
                    {"spec": {"allocation": {"staticPrefill": 2}}})  # fmt: skip


def test_editing_the_allocation_relabels_a_worker_through_the_drain_protocol(
    redis_url: str,
) -> None:
    """`kubectl edit` of allocation.staticPrefill: the cluster's controller daemon drains a
    decode worker, waits for the routers' in-flight reports, relabels it, says so in an Event
    and in the status."""

    async def main() -> None:
        async with kmock_api() as api, routers_reporting(redis_url, "edit", {}):
            await api.create(rcl("edit", {
                "model": {"name": "m"}, "workers": {"replicas": 3}, "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1, "intervalSeconds": 1,
                               "cooldownSeconds": 0},
            }))  # fmt: skip
            async with running_operator():
                await ask_for_a_second_prefill_worker(api, "edit")

                async def two_prefill() -> bool:
                    return await role_counts(api, "edit") == {"prefill": 2, "decode": 1}

                await until(two_prefill, 60, "a worker relabelled to prefill")
                for p in await worker_pods(api, "edit"):
                    assert (p["metadata"].get("annotations") or {}).get(L.DRAINING) != "true"

                async def counted() -> bool:
                    return (await rcl_status(api, "edit")).get("switchesTotal", 0) >= 1

                await until(counted, 30, "the switch in the status")
                events = await api.list("v1", "Event", NS, "")
                assert any(e.get("reason") == "Switching" for e in events), events

    asyncio.run(main())


def test_managed_redis_gets_a_generated_password_secret_and_a_missing_secret_is_reported() -> None:
    async def main() -> None:
        async with kmock_api() as api:
            await api.create(rcl("own", {"model": {"name": "m"}, "redis": {"managed": True}}))
            await api.create(rcl("byo", {"model": {"name": "m"}, "redis": {
                "url": "redis://r:6379/0", "passwordSecretRef": {"name": "nope"}}}))  # fmt: skip
            async with running_operator():

                async def reconciled() -> bool:  # the Redis first, the router later
                    return await api.get("apps/v1", "Deployment", NS, "own-router") is not None

                await until(reconciled, 20, "the managed Redis and the router")
                assert await api.get("apps/v1", "Deployment", NS, "own-redis") is not None
                secret = await api.get("v1", "Secret", NS, "own-redis")
                assert secret is not None
                password = (secret.get("stringData") or {}).get("password", "")
                assert len(password) >= 24
                router = await api.get("apps/v1", "Deployment", NS, "own-router")
                assert router is not None
                env = router["spec"]["template"]["spec"]["containers"][0]["env"]
                assert env[0]["valueFrom"]["secretKeyRef"] == {"name": "own-redis",
                                                                "key": "password"}  # fmt: skip
                await api.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {"name": "own-redis", "namespace": NS},
                        "stringData": {"password": "x"},
                    }
                )
                again = await api.get("v1", "Secret", NS, "own-redis")
                assert again is not None and again["stringData"]["password"] == password

                async def reported() -> bool:
                    conds = (await rcl_status(api, "byo")).get("conditions") or []
                    return any(c["reason"] == "SecretNotFound" and "nope" in c["message"]
                               for c in conds)  # fmt: skip

                await until(reported, 20, "the SecretNotFound condition")
                assert await api.list("v1", "Pod", NS, L.worker_selector("byo")) == []
                await api.create({"apiVersion": "v1", "kind": "Secret",
                                  "metadata": {"name": "nope", "namespace": NS},
                                  "stringData": {"password": "s3cret"}})  # fmt: skip
                # the handler looks again by itself: no edit of the RolloutCluster needed
                await until(lambda: has_workers(api, "byo", 2), 60, "workers once it exists")

    asyncio.run(main())


def test_calls_outside_the_granted_rules_are_caught() -> None:
    """The RBAC check of `kmock_api` can fail: a verb or a resource beyond the list is."""
    rules = rbac.operator_rules(clusterwide=True)
    assert rbac.allowed(rules, "", "pods", "patch")
    assert rbac.allowed(rules, "prorsa.io", "rolloutclusters/status", "patch")
    assert not rbac.allowed(rules, "", "pods", "update")
    assert not rbac.allowed(rules, "", "nodes", "list")
    assert not rbac.allowed(rules, "apps", "deployments", "delete")
    assert not rbac.allowed(rbac.operator_rules(clusterwide=False), "kopf.dev",
                            "clusterkopfpeerings", "patch")  # fmt: skip


def test_lifecycle_events_in_redis_make_the_predictive_daemon_relabel_workers(
    redis_url: str,
) -> None:
    """The router's events (256 trajectories decoding long outputs, none waiting for prefill)
    reach the daemon through Redis; the predictive policy moves both prefill workers to decode
    through the drain protocol, and the status shows the forecast it acted on."""
    import time

    from redis.asyncio import Redis

    from prorsa.events.keys import ClusterKeys
    from prorsa.events.schema import encode
    from prorsa.policy.events import Event, EventType

    async def main() -> None:
        async with kmock_api() as api, routers_reporting(redis_url, "pred", {}):
            await api.create(rcl("pred", {
                "model": {"name": "m"}, "workers": {"replicas": 4}, "redis": {"url": redis_url},
                "allocation": {"policy": "predictive", "intervalSeconds": 1,
                               "cooldownSeconds": 0},
            }))  # fmt: skip
            async with running_operator():
                await until(lambda: has_workers(api, "pred", 4), 20, "four workers")
                for p in (await worker_pods(api, "pred"))[:2]:  # as an earlier decision left them
                    await api.patch("v1", "Pod", NS, p["metadata"]["name"],
                                    {"metadata": {"labels": {L.ROLE: "prefill"}}})  # fmt: skip
                await mark_ready(api, "pred")

                await until(lambda: decided(api, "pred", "2P:2D"), 30,
                            "a first decision over 2P:2D (no events yet)")  # fmt: skip
                now = time.time()
                async with Redis.from_url(redis_url) as r:
                    stream = ClusterKeys(NS, "pred").events
                    for i in range(256):
                        t = f"traj-{i}"
                        for ev in (
                            Event(EventType.TRAJ_START, t, now - 30, group=f"g{i // 8}"),
                            Event(EventType.TURN_SUBMIT, t, now - 29, prompt_tokens=2000,
                                  uncached_tokens=2000),
                            Event(EventType.PREFILL_DONE, t, now - 28, worker="pred-worker-0",
                                  tokens=2000, seconds=0.1),
                            Event(EventType.DECODE_DONE, t, now - 20, worker="pred-worker-2",
                                  output_tokens=4000, seconds=60.0),
                            Event(EventType.TURN_SUBMIT, t, now - 3, prompt_tokens=6000,
                                  uncached_tokens=100),
                            Event(EventType.PREFILL_DONE, t, now - 2, worker="pred-worker-0",
                                  tokens=100, seconds=0.1),
                        ):  # fmt: skip
                            await r.xadd(stream, encode(ev))  # type: ignore[arg-type]

                async def all_decode() -> bool:
                    return await role_counts(api, "pred") == {"decode": 4}

                await until(all_decode, 60, "both prefill workers relabelled to decode")
                for p in await worker_pods(api, "pred"):
                    assert (p["metadata"].get("annotations") or {}).get(L.DRAINING) != "true"
                st = await rcl_status(api, "pred")
                assert st["lastForecast"]["decodeSequences"] > 100
                # capacityModel auto: learned online, from the H200 prior until the engines
                # (none answer here) report; the status says which and on how much evidence
                cap = st["capacity"]
                assert cap["source"] == "learned" and cap["prefillTokensPerSecond"] > 0
                assert cap["evidence"]["prefillSamples"] == 0 and cap["evidence"]["kvWorkers"] == 0
                events = [e for e in await api.list("v1", "Event", NS, "")
                          if e.get("reason") == "Switching"]  # fmt: skip
                assert any("prefill->decode" in e["message"] for e in events), events

    asyncio.run(main())


def test_an_operator_restarted_mid_switch_finishes_it(redis_url: str) -> None:
    """An edit asks for a second prefill worker while every decode worker is busy: the daemon
    marks one draining and waits. The operator stops there (the drain mark and target role
    stay on the pod); a new operator finds the half-done switch and, once the worker is idle,
    finishes it."""

    async def main() -> None:
        busy = {f"mid-worker-{i}": 1 for i in range(3)}
        async with kmock_api() as api, routers_reporting(redis_url, "mid", busy):
            await api.create(rcl("mid", {
                "model": {"name": "m"}, "workers": {"replicas": 3}, "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1, "intervalSeconds": 1,
                               "cooldownSeconds": 0, "drainTimeoutSeconds": 600},
            }))  # fmt: skip

            async def draining() -> list[dict[str, Any]]:
                return [
                    p
                    for p in await worker_pods(api, "mid")
                    if (p["metadata"].get("annotations") or {}).get(L.DRAINING) == "true"
                ]

            async def one_draining() -> bool:
                return len(await draining()) == 1

            async with running_operator():
                await ask_for_a_second_prefill_worker(api, "mid")
                await until(one_draining, 30, "a busy decode worker marked draining")
            [half_done] = await draining()  # the operator is gone; the switch is not
            assert half_done["metadata"]["annotations"][L.TARGET_ROLE] == "prefill"
            assert half_done["metadata"]["labels"][L.ROLE] == "decode"
            busy.clear()  # its last decode finished while no operator ran
            async with running_operator():

                async def finished() -> bool:
                    return await role_counts(api, "mid") == {"prefill": 2, "decode": 1}

                await until(finished, 60, "the new operator finishing the switch")
                assert await draining() == []
                pod = await api.get("v1", "Pod", NS, half_done["metadata"]["name"])
                assert pod is not None and pod["metadata"]["labels"][L.ROLE] == "prefill"

    asyncio.run(main())


def test_a_replica_waits_while_a_higher_priority_peer_is_alive(redis_url: str) -> None:
    """kopf peering: this operator (priority 10) sees a live peer of priority 1000 in the
    ClusterKopfPeering and does nothing; when that peer is gone, it takes over."""
    import datetime

    async def main() -> None:
        async with kmock_api() as api:
            lastseen = datetime.datetime.now(datetime.UTC).isoformat()
            peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                       "metadata": {"name": "prorsa"},
                       "status": {"leader-pod": {"priority": 1000, "lifetime": 600,
                                                 "lastseen": lastseen}}}  # fmt: skip
            assert await api.create(peering)
            await api.create(rcl("peer", {"model": {"name": "m"}, "workers": {"replicas": 2},
                                          "redis": {"url": redis_url}}))  # fmt: skip
            async with running_operator(peering="prorsa", priority=10):
                await asyncio.sleep(6)
                assert await worker_pods(api, "peer") == []  # the leader's job, not ours
                st = await api.get("kopf.dev/v1", "ClusterKopfPeering", None, "prorsa")
                assert st is not None and len(st["status"]) == 2  # we announced ourselves
                await api.patch(
                    "kopf.dev/v1",
                    "ClusterKopfPeering",
                    None,
                    "prorsa",
                    {"status": {"leader-pod": None}},
                )  # the leader left
                await until(lambda: has_workers(api, "peer", 2), 30, "this replica taking over")

    asyncio.run(main())


def test_workers_the_scheduler_cannot_place_make_the_cluster_degraded() -> None:
    """Too few GPUs or nodes: the spec is valid but cannot be honoured, and the status says
    why (the scheduler's own message), instead of sitting in Pending silently."""
    from prorsa.api.models import parse_spec
    from prorsa.kube.handlers import _status

    spec = parse_spec({"model": {"name": "m"}, "workers": {"replicas": 2}})
    placed = {"metadata": {"name": "c-worker-0", "labels": {L.ROLE: "decode"}},
              "status": {"conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    stuck = {"metadata": {"name": "c-worker-1", "labels": {L.ROLE: "prefill"}},
             "status": {"conditions": [{
                 "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
             }]}}  # fmt: skip
    st = _status("c", NS, spec, 3, [placed, stuck], [placed, stuck])
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Unschedulable"
    assert "c-worker-1" in degraded["message"] and "nvidia.com/gpu" in degraded["message"]
    assert st["ready"] == 1 and st["prefill"] == 1 and st["decode"] == 1
    healthy = _status("c", NS, spec, 3, [placed], [placed])
    assert next(c for c in healthy["conditions"] if c["type"] == "Degraded")["status"] == "False"
