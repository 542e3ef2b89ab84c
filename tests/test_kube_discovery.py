"""Router discovery in Kubernetes: list + watch of worker pods, against kmock's API emulator."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from kmock import KubernetesEmulator, Server

from prorsa.events.keys import ClusterKeys
from prorsa.kube import labels as L
from prorsa.kube.discovery import PodDiscovery, pod_endpoint
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
