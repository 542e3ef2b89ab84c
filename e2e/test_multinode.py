"""A worker spanning two "nodes" on real vLLM, as a LeaderWorkerSet group runs it: two
`prorsa worker` agents. Where a role's engine spans both, the first serves the API
(data-parallel rank 0) and the second runs rank 1 headless; where the role's engines fit one
node, each node runs and serves its own. The first reads its role from a downward-API labels
file, as in a pod; a relabel restarts both nodes with the other role's arguments, and the
second only follows the first's agent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from e2e.client import TIMEOUT, complete
from prorsa.local.processes import Child, free_port
from prorsa.local.stack import SERVED_MODEL, _prorsa
from prorsa.policy.allocate import Role
from prorsa.worker.engine import EngineLayout

# Each role's engine: data parallel 2 over two nodes (one rank each), with its own KV size
# (each rank logs the override it got).
BLOCKS = {Role.PREFILL: "1024", Role.DECODE: "2048"}
ROLE_ARGS = {
    r.value: [*EngineLayout(gpus=2, data=2, nodes=2).vllm_args(), "--num-gpu-blocks-override", b]
    for r, b in BLOCKS.items()
}


@dataclass
class Group:
    url: str
    leader: Child
    follower: Child
    labels: Path
    follower_url: str = ""

    def relabel(self, role: Role) -> None:
        """What the kubelet does when the operator relabels the leader pod."""
        tmp = self.labels.with_suffix(".tmp")
        tmp.write_text(f'prorsa.io/role="{role.value}"\n')
        tmp.replace(self.labels)


def _start_group(d: Path, tiny_model: Path, role_args: dict[str, list[str]]) -> Group:
    d.mkdir(parents=True, exist_ok=True)
    labels = d / "labels"
    labels.write_text('prorsa.io/role="prefill"\n')
    port, agent_port, rpc, port1 = free_port(), free_port(), free_port(), free_port()
    common = [
        "--model", str(tiny_model), "--host", "127.0.0.1", "--served-model-name", SERVED_MODEL,
        "--role", "prefill", "--connector", "none", "--switch-mode", "restart",
        "--kv-cache-gib", "1", "--group-leader", "127.0.0.1", "--drain-timeout", "30",
        "--role-args", json.dumps(role_args),
    ]  # fmt: skip
    engine = ["--", "--max-model-len", "1024", "--data-parallel-rpc-port", str(rpc)]
    leader = Child("node-0", [
        *_prorsa(), "worker", *common, "--name", "group-0", "--port", str(port),
        "--probe-port", str(agent_port), "--role-file", str(labels), "--cpu-cores", "0",
        "--log-file", str(d / "node-0.engine.log"), *engine,
    ], d / "node-0.agent.log").start()  # fmt: skip
    follower = Child("node-1", [
        *_prorsa(), "worker", *common, "--name", "group-0-1", "--port", str(port1),
        "--node-rank", "1", "--probe-port", str(free_port()),
        "--leader-probe-port", str(agent_port), "--cpu-cores", "1",
        "--log-file", str(d / "node-1.engine.log"), *engine,
    ], d / "node-1.agent.log").start()  # fmt: skip
    return Group(f"http://127.0.0.1:{port}", leader, follower, labels,
                 f"http://127.0.0.1:{port1}")  # fmt: skip


def _running(d: Path, tiny_model: Path, role_args: dict[str, list[str]]) -> Iterator[Group]:
    g = _start_group(d, tiny_model, role_args)
    try:
        yield g
    finally:
        g.follower.stop()
        g.leader.stop()


@pytest.fixture(scope="module")
def group(workdir: Path, tiny_model: Path) -> Iterator[Group]:
    yield from _running(workdir / "multinode", tiny_model, ROLE_ARGS)


def _ranks_with(g: Group, blocks: str) -> int:
    """Ranks whose engine started with `blocks` KV blocks, from each node's engine log (the
    rank's own record of the arguments it got)."""
    marker = f"num_gpu_blocks_override={blocks}"
    return sum(
        marker
        in Path(str(c.log_path).replace(".agent.log", ".engine.log")).read_text(errors="replace")
        for c in (g.leader, g.follower)
    )


async def _serving(
    http: aiohttp.ClientSession, g: Group, timeout_s: float = 600, url: str | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in (g.leader, g.follower):
            assert child.alive, f"{child.name} exited:\n{child.tail()}"
        try:
            async with http.get((url or g.url) + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise AssertionError(f"the group never served:\n{g.leader.tail()}\n{g.follower.tail()}")


async def _generated(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {line.split('engine="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total{")}  # fmt: skip


def test_a_multi_node_engine_switches_roles_on_every_node(group: Group) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for role in (Role.PREFILL, Role.DECODE):
                if role is Role.DECODE:
                    group.relabel(role)
                    await asyncio.sleep(3.0)  # the agents poll their role every second
                await _serving(http, group)
                assert _ranks_with(group, BLOCKS[role]) == 2  # both nodes run the role's
                done = await asyncio.gather(*(
                    complete(http, group.url, f"node test {role.value} {i}", 8)
                    for i in range(8)))  # fmt: skip
                assert all(c.status == 200 and len(c.token_ids) == 8 for c in done), done
                per_rank = await _generated(http, group.url)
                assert set(per_rank) == {"0", "1"} and min(per_rank.values()) > 0, per_rank
        for child in (group.leader, group.follower):
            assert "role prefill -> decode (restarting vLLM)" in child.log_path.read_text()

    asyncio.run(main())


# A worker whose prefill engines fit one node (two engines, one per node, each with its own
# API) and whose decode engine spans both (data parallel 2, one rank per node).
SPLIT_ARGS = {
    Role.PREFILL.value: ["--num-gpu-blocks-override", BLOCKS[Role.PREFILL]],
    Role.DECODE.value: ROLE_ARGS[Role.DECODE.value],
}


@pytest.fixture(scope="module")
def split_group(workdir: Path, tiny_model: Path) -> Iterator[Group]:
    yield from _running(workdir / "multiengine", tiny_model, SPLIT_ARGS)


def test_a_worker_runs_one_engine_per_node_in_one_role_and_one_over_both_in_the_other(
    split_group: Group,
) -> None:
    g = split_group

    async def served(http: aiohttp.ClientSession, url: str, tag: str) -> None:
        done = await asyncio.gather(*(complete(http, url, f"{tag} {i}", 8) for i in range(4)))
        assert all(c.status == 200 and len(c.token_ids) == 8 for c in done), done

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            for step, role in enumerate((Role.PREFILL, Role.DECODE, Role.PREFILL)):
                if step:
                    g.relabel(role)
                    await asyncio.sleep(3.0)  # the agents poll their role every second
                await _serving(http, g)
                if role is Role.PREFILL:  # two engines, each serving on its own node
                    await _serving(http, g, url=g.follower_url)
                    for url in (g.url, g.follower_url):
                        await served(http, url, f"engine {url} {step}")
                        assert set(await _generated(http, url)) == {"0"}  # one rank each
                else:  # one engine over both nodes: the second has no API of its own
                    await served(http, g.url, f"group {step}")
                    per_rank = await _generated(http, g.url)
                    assert set(per_rank) == {"0", "1"} and min(per_rank.values()) > 0
                    with pytest.raises(aiohttp.ClientError):
                        async with http.get(g.follower_url + "/health") as r:
                            r.raise_for_status()
        for child in (g.leader, g.follower):
            text = child.log_path.read_text()
            assert "role prefill -> decode (restarting vLLM)" in text
            assert "role decode -> prefill (restarting vLLM)" in text

    asyncio.run(main())
