"""The Kubernetes Cluster adapter against kmock's API emulator and a real Redis: the switch
protocol relabels a worker pod through its annotations, and a controller started later
finishes a switch it finds half-done on the pods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kmock import KubernetesEmulator, Server
from redis.asyncio import Redis

from conftest import serve
from prorsa.api.models import parse_spec
from prorsa.control.controller import Controller, ControllerConfig
from prorsa.control.switch import SwitchOutcome, switch
from prorsa.events import inflight
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventReader
from prorsa.kube import builders as b
from prorsa.kube import labels as L
from prorsa.kube.api import KubeApi
from prorsa.kube.cluster import KubeCluster
from prorsa.policy.allocate import AllocationSettings, Role
from prorsa.policy.capacity import RoleCapacity

KEYS = ClusterKeys("team", "rl")
SPEC = parse_spec({"model": {"name": "m"}, "redis": {"url": "redis://r:6379/0"}})


async def _setup(k8s: KubernetesEmulator, api: KubeApi) -> None:
    verbs = ["create", "delete", "get", "list", "patch", "watch"]
    k8s.resources["v1/pods"] = {"namespaced": True, "kind": "Pod", "singular": "pod",
                                "shortnames": [], "categories": [], "subresources": ["status"],
                                "verbs": verbs}  # fmt: skip
    owner = b.owner_reference("rl", "uid")
    for i, role in enumerate((Role.PREFILL, Role.DECODE)):
        await api.create(b.worker_pod("rl", "team", owner, SPEC, i, role))
        await api.patch("v1", "Pod", "team", f"rl-worker-{i}", {"status": {
            "podIP": f"127.0.0.{i + 2}",
            "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip


async def _report(r: Redis, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.time()
        report = {inflight.field(f"rl-worker-{i}", "router-0"): inflight.value(0, 0, now)
                  for i in range(2)}  # fmt: skip
        await r.hset(KEYS.workers, mapping=report)
        await asyncio.sleep(0.05)


@asynccontextmanager
async def _two_pods(redis_url: str) -> AsyncIterator[tuple[KubeApi, KubeCluster, Redis]]:
    """A prefill and a decode worker pod, Ready, whose routers report nothing in flight."""
    async with KubernetesEmulator() as k8s, Server(k8s), Redis.from_url(redis_url) as r:
        api = KubeApi(str(k8s.url).rstrip("/"), ssl_context=False)
        await _setup(k8s, api)
        stop = asyncio.Event()
        reporter = asyncio.create_task(_report(r, stop))
        try:
            yield api, KubeCluster(api, r, KEYS), r
        finally:
            stop.set()
            await reporter
            await api.close()


def test_switch_relabels_a_pod_and_a_new_controller_finishes_a_half_done_one(
    redis_url: str,
) -> None:
    async def main() -> None:
        async with _two_pods(redis_url) as (api, cluster, r):
            workers = {w.name: w for w in await cluster.workers()}
            assert workers["rl-worker-0"].role is Role.PREFILL and workers["rl-worker-0"].ready
            out = await switch(cluster, "rl-worker-0", Role.DECODE, settle_s=0.1, poll_s=0.05)
            assert out is SwitchOutcome.DONE
            pod = await api.get("v1", "Pod", "team", "rl-worker-0")
            assert pod is not None and pod["metadata"]["labels"][L.ROLE] == "decode"
            assert pod["metadata"]["annotations"].get(L.DRAINING) != "true"

            await cluster.mark_draining("rl-worker-1", Role.PREFILL)  # then the operator died
            settings = AllocationSettings(policy="colocated")
            ctl = Controller(cluster, EventReader(r, KEYS.events), ControllerConfig(
                settings, RoleCapacity(1e4, 0.01, 0.0, 0.0, 1e6), settle_s=0.1))  # fmt: skip
            assert await ctl.recover() == 1
            await ctl.wait_switches()
            pod = await api.get("v1", "Pod", "team", "rl-worker-1")
            assert pod is not None and pod["metadata"]["labels"][L.ROLE] == "prefill"
            assert not any(w.draining for w in await cluster.workers())

    asyncio.run(main())


def test_a_worker_running_several_engines_is_drained_and_measured_across_them(
    redis_url: str,
) -> None:
    """A worker of two nodes whose prefill engines fit one node runs two engines: the
    controller sees one worker, waits for the requests of both before a switch completes and
    reads both engines' metrics; as decode (one engine over both) only the first's."""
    from aiohttp import web

    spec = parse_spec({
        "model": {"name": "m"}, "redis": {"url": "redis://r:6379/0"},
        "workers": {"replicas": 1, "gpusPerWorker": 16, "dataParallelSize": 16,
                    "prefill": {"gpusPerWorker": 8}},
        "kvTransfer": {"switchMode": "restart"},
    })  # fmt: skip

    async def engine(running: int) -> tuple[web.AppRunner, int]:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f"vllm:num_requests_running{{engine=\"0\"}} {running}.0\n"
                                     'vllm:num_requests_waiting{engine="0"} 1.0\n')  # fmt: skip

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return await serve(app)

    async def main() -> None:
        (r0, p0), (r1, p1) = await engine(2), await engine(3)
        async with KubernetesEmulator() as k8s, Server(k8s):
            api = KubeApi(str(k8s.url).rstrip("/"), ssl_context=False)
            await _setup(k8s, api)
            for i in range(2):  # only the group below
                await api.delete("v1", "Pod", "team", f"rl-worker-{i}")
            lws = b.worker_group("rl", "team", b.owner_reference("rl", "u"), spec, 0,
                                 Role.PREFILL)  # fmt: skip
            t = lws["spec"]["leaderWorkerTemplate"]
            for node, port in ((0, p0), (1, p1)):
                part = t["leaderTemplate" if node == 0 else "workerTemplate"]
                meta = {**part["metadata"], "name": f"rl-worker-0-0{'-1' * node}",
                        "namespace": "team"}  # fmt: skip
                meta["labels"] = {**meta["labels"], L.LWS_NODE: str(node)}
                meta["annotations"] = {**meta["annotations"], L.PORT: str(port)}
                await api.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                  "spec": part["spec"]})  # fmt: skip
                await api.patch("v1", "Pod", "team", meta["name"], {"status": {
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip
            async with Redis.from_url(redis_url) as redis:
                cluster = KubeCluster(api, redis, KEYS)
                cluster_workers = await cluster.workers()
            assert [w.name for w in cluster_workers] == ["rl-worker-0-0"]
            assert await cluster.engine_inflight("rl-worker-0-0") == (2 + 1) + (3 + 1)
            text = await cluster.engine_metrics(cluster_workers[0])
            assert text is not None and text.count("vllm:num_requests_running") == 2
            await api.patch("v1", "Pod", "team", "rl-worker-0-0",
                            {"metadata": {"labels": {L.ROLE: "decode"}}})  # fmt: skip
            assert await cluster.engine_inflight("rl-worker-0-0") == 2 + 1
            await r1.cleanup()  # an engine that does not answer: unknown, not idle
            await api.patch("v1", "Pod", "team", "rl-worker-0-0",
                            {"metadata": {"labels": {L.ROLE: "prefill"}}})  # fmt: skip
            assert await cluster.engine_inflight("rl-worker-0-0") is None
            await api.close()
        await r0.cleanup()

    asyncio.run(main())


def test_a_restarting_switch_relabels_the_pod_under_the_drain_until_it_is_not_ready(
    redis_url: str,
) -> None:
    """Restart mode: the pod is relabelled with its drain annotation kept, so no router sends
    its old engine work of the new role, and the drain is cleared once the pod stops being
    Ready (its agent took the engine down to restart it)."""

    async def main() -> None:
        async with _two_pods(redis_url) as (api, cluster, _):
            restart = switch(cluster, "rl-worker-0", Role.DECODE, settle_s=0.1,
                             poll_s=0.05, engine_check=True)  # fmt: skip
            sw = asyncio.create_task(restart)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                pod = await api.get("v1", "Pod", "team", "rl-worker-0")
                assert pod is not None
                if pod["metadata"]["labels"][L.ROLE] == "decode":
                    break
                await asyncio.sleep(0.05)
            assert pod["metadata"]["labels"][L.ROLE] == "decode"
            assert pod["metadata"]["annotations"].get(L.DRAINING) == "true"
            await asyncio.sleep(0.3)
            assert not sw.done()
            await api.patch("v1", "Pod", "team", "rl-worker-0", {"status": {
                "conditions": [{"type": "Ready", "status": "False"}]}})  # fmt: skip
            assert await asyncio.wait_for(sw, 10) is SwitchOutcome.DONE
            pod = await api.get("v1", "Pod", "team", "rl-worker-0")
            assert pod is not None and pod["metadata"]["annotations"].get(L.DRAINING) != "true"

    asyncio.run(main())
