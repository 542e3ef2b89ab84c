"""The operator for real (kopf) against kmock's Kubernetes API emulator: a RolloutCluster
becomes pods, Services, a router and a status; scaling patches resize it; a spec that cannot be
honoured becomes a condition and an event, not a crash loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kopf
from kmock import KubernetesEmulator, Server

from prorsa.api.models import GROUP, KIND, PLURAL, SINGULAR, VERSION
from prorsa.kube import handlers
from prorsa.kube import labels as L
from prorsa.kube.api import KubeApi

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
]


def _register_crd(k8s: KubernetesEmulator) -> None:
    for key, kind in CLUSTER_SCOPED:
        k8s.resources[key] = {"namespaced": False, "kind": kind, "singular": kind.lower(),
                              "shortnames": [], "categories": [], "subresources": [],
                              "verbs": ["get", "list", "watch"]}  # fmt: skip
    verbs = ["create", "delete", "get", "list", "patch", "watch"]
    for key, kind in CORE:
        k8s.resources[key] = {"namespaced": True, "kind": kind, "singular": kind.lower(),
                              "shortnames": [], "categories": [], "subresources": [],
                              "verbs": verbs}  # fmt: skip
    k8s.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = {
        "namespaced": True, "kind": KIND, "singular": SINGULAR, "shortnames": ["rcl"],
        "categories": ["prorsa"], "subresources": ["status", "scale"],
        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
    }  # fmt: skip


def rcl(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    # kmock keeps no resourceVersion of its own; kopf's daemon bookkeeping tests for one
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": NS, "resourceVersion": "1"},
            "spec": spec}  # fmt: skip


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def kmock_api() -> AsyncIterator[KubeApi]:
    """kmock's API emulator with the resources the operator uses, and a client for it that
    both kopf (through the login handler) and the handlers use."""
    async with KubernetesEmulator() as k8s, Server(k8s):
        _register_crd(k8s)
        url = str(k8s.url).rstrip("/")
        _server["url"] = url
        api = KubeApi(url, ssl_context=False)
        handlers.configure(api)
        try:
            yield api
        finally:
            await api.close()


@contextlib.asynccontextmanager
async def running_operator() -> AsyncIterator[None]:
    """The real operator (every handler of prorsa.kube.handlers) for the duration."""
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    op = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop))
    try:
        yield
    finally:
        stop.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(op, 30)


async def rcl_status(api: KubeApi, name: str) -> dict[str, Any]:
    obj = await api.get(f"{GROUP}/{VERSION}", KIND, NS, name)
    return (obj or {}).get("status") or {}


def test_a_rollout_cluster_becomes_pods_services_and_status(redis_url: str) -> None:
    async def main() -> None:
        async with kmock_api() as api:
            assert await api.create(rcl("rl", {
                "model": {"name": "Qwen/Qwen3-8B"}, "workers": {"replicas": 2},
                "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1},
            }))  # fmt: skip
            async with running_operator():

                async def pods() -> list[dict[str, Any]]:
                    return await api.list("v1", "Pod", NS, L.worker_selector("rl"))

                async def n_pods(n: int) -> bool:
                    return len(await pods()) == n

                await until(lambda: n_pods(2), 20, "two worker pods")
                got = await pods()
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
                svc = await api.get("v1", "Service", NS, "rl")
                assert svc is not None and svc["spec"]["selector"][L.COMPONENT] == "router"
                assert await api.get("apps/v1", "Deployment", NS, "rl-router") is not None

                async def has_endpoint() -> bool:
                    return bool((await rcl_status(api, "rl")).get("endpoint"))

                await until(has_endpoint, 20, "the endpoint in the status")
                for i, p in enumerate(got):  # what the kubelet would report
                    await api.patch("v1", "Pod", NS, p["metadata"]["name"], {"status": {
                        "podIP": f"127.0.0.{i + 2}",
                        "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip

                async def decided() -> bool:  # once it sees the two ready workers
                    last = (await rcl_status(api, "rl")).get("lastDecision") or {}
                    return last.get("target") == "1P:1D"

                await until(decided, 30, "the controller daemon's decision over 2 workers")
                st = await rcl_status(api, "rl")
                assert st["endpoint"] == "http://rl.team.svc:8080/v1"
                assert st["replicas"] == 2 and st["selector"] == L.worker_selector("rl")

                await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "rl",
                                {"spec": {"workers": {"replicas": 3}}})  # fmt: skip
                await until(lambda: n_pods(3), 30, "scale up to three workers")
                # Scaling down is covered by test_scale_down_picks_idle_workers: kmock's merge
                # patch keeps keys set to null, so kopf's per-handler progress records are
                # never purged there and a second update of one object is skipped.

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
    names = [p["metadata"]["name"] for p in _scale_down_victims(live, 2)]
    assert names == ["rl-worker-3", "rl-worker-2"]
    assert _scale_down_victims(live, 4) == []
    # the draining one is kept even when that leaves more than asked (next reconcile retries)
    assert [p["metadata"]["name"] for p in _scale_down_victims(live, 0)] == [
        "rl-worker-3", "rl-worker-2", "rl-worker-0"]  # fmt: skip


def test_editing_the_allocation_relabels_a_worker_through_the_drain_protocol(
    redis_url: str,
) -> None:
    """`kubectl edit` of allocation.staticPrefill: the cluster's controller daemon drains a
    decode worker, waits for the routers' in-flight reports, relabels it, says so in an Event
    and in the status."""
    import time

    from redis.asyncio import Redis

    from prorsa.events import inflight
    from prorsa.events.keys import ClusterKeys

    async def main() -> None:
        async with kmock_api() as api, Redis.from_url(redis_url) as r:
            await api.create(rcl("edit", {
                "model": {"name": "m"}, "workers": {"replicas": 3}, "redis": {"url": redis_url},
                "allocation": {"policy": "static", "staticPrefill": 1, "intervalSeconds": 1,
                               "cooldownSeconds": 0},
            }))  # fmt: skip
            stop_reports = asyncio.Event()

            async def routers_report_idle() -> None:
                keys = ClusterKeys(NS, "edit")
                while not stop_reports.is_set():
                    now = time.time()
                    await r.hset(keys.workers, mapping={
                        inflight.field(f"edit-worker-{i}", "router-0"): inflight.value(0, 0, now)
                        for i in range(3)})  # fmt: skip
                    await asyncio.sleep(0.1)

            reporter = asyncio.create_task(routers_report_idle())
            try:
                async with running_operator():

                    async def pods() -> list[dict[str, Any]]:
                        return await api.list("v1", "Pod", NS, L.worker_selector("edit"))

                    async def three() -> bool:
                        return len(await pods()) == 3

                    await until(three, 20, "three workers")
                    for i, p in enumerate(await pods()):
                        await api.patch("v1", "Pod", NS, p["metadata"]["name"], {"status": {
                            "podIP": f"127.0.0.{i + 2}",
                            "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip

                    async def decided() -> bool:
                        last = (await rcl_status(api, "edit")).get("lastDecision") or {}
                        return last.get("target") == "1P:2D"

                    await until(decided, 30, "the decision over three ready workers")
                    await api.patch(f"{GROUP}/{VERSION}", KIND, NS, "edit",
                                    {"spec": {"allocation": {"staticPrefill": 2}}})  # fmt: skip

                    async def two_prefill() -> bool:
                        roles = [p["metadata"]["labels"][L.ROLE] for p in await pods()]
                        return roles.count("prefill") == 2

                    await until(two_prefill, 60, "a worker relabelled to prefill")
                    annotations = [p["metadata"].get("annotations") or {} for p in await pods()]
                    assert not any(a.get(L.DRAINING) == "true" for a in annotations)

                    async def counted() -> bool:
                        return (await rcl_status(api, "edit")).get("switchesTotal", 0) >= 1

                    await until(counted, 30, "the switch in the status")
                    events = await api.list("v1", "Event", NS, "")
                    assert any(e.get("reason") == "Switching" for e in events), events
            finally:
                stop_reports.set()
                await reporter

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

    asyncio.run(main())
