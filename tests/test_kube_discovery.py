"""Router discovery in Kubernetes: list + watch of worker pods, against kmock's API emulator."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import aiohttp
from kmock import KubernetesEmulator, Server

from prorsa.events.keys import ClusterKeys
from prorsa.kube import labels as L
from prorsa.kube.discovery import PodDiscovery, pod_endpoint, pod_endpoints
from prorsa.policy.allocate import Role
from prorsa.router.discovery import Endpoint

KEYS = ClusterKeys("rl", "demo")


def pod(name: str, role: str, ip: str | None = "10.0.0.1", ready: bool = True,
        cluster: str = "demo", **annotations: str) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": KEYS.namespace,
            "labels": {L.CLUSTER: cluster, L.COMPONENT: L.WORKER, L.ROLE: role},
            "annotations": annotations,
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_a_pod_becomes_an_endpoint_only_when_it_can_be_one() -> None:
    ep = pod_endpoint(pod("w0", "decode", **{L.DRAINING: "true", L.TARGET_ROLE: "prefill",
                                              L.PORT: "8100"}))  # fmt: skip
    assert ep == Endpoint("w0", "http://10.0.0.1:8100", Role.DECODE, True, True, Role.PREFILL)
    assert pod_endpoint(pod("w1", "decode", ip=None)) is None  # not scheduled yet
    assert pod_endpoint(pod("w2", "chef")) is None
    assert pod_endpoint(pod("w3", "prefill", ready=False)).ready is False  # type: ignore[union-attr]
    assert pod_endpoint(pod("w4", "mixed", cluster="")) is None


def test_watch_follows_relabels_and_deletions() -> None:
    async def main() -> list[list[Endpoint]]:
        async with KubernetesEmulator() as k8s, Server(k8s):
            base = str(k8s.url).rstrip("/")
            pods_url = f"{base}/api/v1/namespaces/{KEYS.namespace}/pods"
            async with aiohttp.ClientSession() as s:
                for p in (pod("w0", "prefill"), pod("w1", "decode", ip="10.0.0.2")):
                    async with s.post(pods_url, json=p) as r:
                        assert r.status < 300, await r.text()
                disc = PodDiscovery(base, KEYS, ssl_context=False)
                seen: list[list[Endpoint]] = []
                it = disc.watch().__aiter__()
                seen.append(await asyncio.wait_for(it.__anext__(), 5))
                patch = {"metadata": {"labels": {L.ROLE: "decode"},
                                      "annotations": {L.DRAINING: "false"}}}  # fmt: skip
                async with s.patch(
                    f"{pods_url}/w0",
                    json=patch,
                    headers={"Content-Type": "application/merge-patch+json"},
                ) as r:
                    assert r.status < 300, await r.text()  # fmt: skip
                seen.append(await asyncio.wait_for(it.__anext__(), 5))
                async with s.delete(f"{pods_url}/w1") as r:
                    assert r.status < 300, await r.text()
                seen.append(await asyncio.wait_for(it.__anext__(), 5))
                await it.aclose()  # type: ignore[attr-defined]
                return seen

    first, relabelled, deleted = asyncio.run(main())
    assert [(e.name, e.role) for e in first] == [("w0", Role.PREFILL), ("w1", Role.DECODE)]
    assert [(e.name, e.role) for e in relabelled] == [("w0", Role.DECODE), ("w1", Role.DECODE)]
    assert [e.name for e in deleted] == ["w0"]
    assert first[0].url == "http://10.0.0.1:8000"


def _group_pods(role: Role, ready: tuple[bool, ...] = (True,) * 4) -> list[dict[str, Any]]:
    """The pods the LeaderWorkerSet controller makes for the operator's group of a worker of
    four nodes whose prefill engines span two: the templates' metadata, LWS's node labels."""
    from prorsa.api.models import parse_spec
    from prorsa.kube import builders as b

    spec = parse_spec({
        "model": {"name": "m"}, "redis": {"url": "redis://r:6379/0"},
        "workers": {"replicas": 1, "gpusPerWorker": 32, "dataParallelSize": 32,
                    "prefill": {"gpusPerWorker": 16}},
        "kvTransfer": {"switchMode": "restart"},
    })  # fmt: skip
    lws = b.worker_group("demo", KEYS.namespace, b.owner_reference("demo", "u"), spec, 0, role)
    t = lws["spec"]["leaderWorkerTemplate"]
    out = []
    for node in range(4):
        meta = copy.deepcopy(t["leaderTemplate" if node == 0 else "workerTemplate"]["metadata"])
        name = "demo-worker-0-0" if node == 0 else f"demo-worker-0-0-{node}"
        meta.update(name=name, namespace=KEYS.namespace)
        meta["labels"][L.LWS_NODE] = str(node)
        status = {"podIP": f"10.0.1.{node}", "conditions": [
            {"type": "Ready", "status": "True" if ready[node] else "False"}]}  # fmt: skip
        out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status})
    return out


def test_a_worker_running_several_engines_is_one_endpoint_per_engine() -> None:
    """A multi-node worker whose prefill engines are half its width serves two endpoints in
    prefill (its first node's and its third's, each an engine's first node), one in decode
    (an engine over all four); both carry the worker's role and drain, and name the worker."""
    prefill = pod_endpoints(_group_pods(Role.PREFILL))
    assert [(e.name, e.url, e.owner) for e in prefill] == [
        ("demo-worker-0-0", "http://10.0.1.0:8000", "demo-worker-0-0"),
        ("demo-worker-0-0-2", "http://10.0.1.2:8000", "demo-worker-0-0"),
    ]
    assert all(e.role is Role.PREFILL and e.ready for e in prefill)
    decode = pod_endpoints(_group_pods(Role.DECODE))
    assert [e.name for e in decode] == ["demo-worker-0-0"]
    # an engine whose first node is not ready is not ready; a draining worker drains them all
    pods = _group_pods(Role.PREFILL, ready=(True, True, False, True))
    pods[0]["metadata"]["annotations"].update({L.DRAINING: "true", L.TARGET_ROLE: "decode"})
    eps = {e.name: e for e in pod_endpoints(pods)}
    assert not eps["demo-worker-0-0-2"].ready and eps["demo-worker-0-0"].ready
    assert all(e.draining and e.target_role is Role.DECODE for e in eps.values())
    # a node not scheduled yet (no IP) serves nothing; a garbled annotation: one endpoint
    pods[2]["status"].pop("podIP")
    assert [e.name for e in pod_endpoints(pods)] == ["demo-worker-0-0"]
    pods = _group_pods(Role.PREFILL)
    pods[0]["metadata"]["annotations"][L.ENGINE_NODES] = "{not json"
    assert [e.name for e in pod_endpoints(pods)] == ["demo-worker-0-0"]
