"""An engine spanning two "nodes" on real vLLM, as a LeaderWorkerSet group runs it: two
`prorsa worker` agents, the first serving the API (data-parallel rank 0), the second running
rank 1 headless. The first reads its role from a downward-API labels file, as in a pod; a
relabel restarts both nodes with the other role's arguments, and the second only follows the
first's agent."""

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

    def relabel(self, role: Role) -> None:
        """What the kubelet does when the operator relabels the leader pod."""
        tmp = self.labels.with_suffix(".tmp")
        tmp.write_text(f'prorsa.io/role="{role.value}"\n')
        tmp.replace(self.labels)


@pytest.fixture(scope="module")
def group(workdir: Path, tiny_model: Path) -> Iterator[Group]:
    d = workdir / "multinode"
    d.mkdir(parents=True, exist_ok=True)
    labels = d / "labels"
    labels.write_text('prorsa.io/role="prefill"\n')
    port, agent_port, rpc = free_port(), free_port(), free_port()
    common = [
        "--model", str(tiny_model), "--host", "127.0.0.1", "--served-model-name", SERVED_MODEL,
        "--role", "prefill", "--connector", "none", "--switch-mode", "restart",
        "--kv-cache-gib", "1", "--group-leader", "127.0.0.1", "--drain-timeout", "30",
        "--role-args", json.dumps(ROLE_ARGS),
    ]  # fmt: skip
    engine = ["--", "--max-model-len", "1024", "--data-parallel-rpc-port", str(rpc)]
    leader = Child("node-0", [
        *_prorsa(), "worker", *common, "--name", "group-0", "--port", str(port),
        "--probe-port", str(agent_port), "--role-file", str(labels), "--cpu-cores", "0",
        "--log-file", str(d / "node-0.engine.log"), *engine,
    ], d / "node-0.agent.log").start()  # fmt: skip
    follower = Child("node-1", [
        *_prorsa(), "worker", *common, "--name", "group-0-1", "--port", str(free_port()),
        "--node-rank", "1", "--probe-port", str(free_port()),
        "--leader-probe-port", str(agent_port), "--cpu-cores", "1",
        "--log-file", str(d / "node-1.engine.log"), *engine,
    ], d / "node-1.agent.log").start()  # fmt: skip
    try:
        yield Group(f"http://127.0.0.1:{port}", leader, follower, labels)
    finally:
        follower.stop()
        leader.stop()


def _ranks_with(g: Group, blocks: str) -> int:
    """Ranks whose engine started with `blocks` KV blocks, from each node's engine log (the
    rank's own record of the arguments it got)."""
    marker = f"num_gpu_blocks_override={blocks}"
    return sum(
        marker
        in Path(str(c.log_path).replace(".agent.log", ".engine.log")).read_text(errors="replace")
        for c in (g.leader, g.follower)
    )


async def _serving(http: aiohttp.ClientSession, g: Group, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in (g.leader, g.follower):
            assert child.alive, f"{child.name} exited:\n{child.tail()}"
        try:
            async with http.get(g.url + "/health") as r:
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
