"""The worker agent's pure parts: the vLLM command per role and switch mode, and role labels
read the way the kubelet writes them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from prorsa.policy.allocate import Role
from prorsa.worker.engine import Connector, EngineSpec, SwitchMode, command, kv_transfer_config
from prorsa.worker.roles import FileRoleSource, parse_labels


def _kv(argv: list[str]) -> dict[str, object]:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]


def test_routing_mode_runs_every_role_as_kv_both() -> None:
    spec = EngineSpec("/models/m", port=8001, kv_buffer_device="cpu")
    for role in Role:
        argv, _ = command(spec, role)
        assert _kv(argv) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                             "kv_buffer_device": "cpu"}  # fmt: skip
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8001"


def test_restart_mode_gives_explicit_producer_and_consumer_roles() -> None:
    spec = EngineSpec("m", switch_mode=SwitchMode.RESTART)
    assert _kv(command(spec, Role.PREFILL)[0])["kv_role"] == "kv_producer"
    assert _kv(command(spec, Role.DECODE)[0])["kv_role"] == "kv_consumer"
    assert _kv(command(spec, Role.MIXED)[0])["kv_role"] == "kv_both"


def test_nccl_and_no_connector() -> None:
    spec = EngineSpec("m", connector=Connector.NCCL, nccl_port=21001, port=8100,
                      switch_mode=SwitchMode.RESTART)  # fmt: skip
    cfg = kv_transfer_config(spec, Role.DECODE)
    assert cfg is not None and cfg["kv_connector"] == "P2pNcclConnector"
    assert cfg["kv_role"] == "kv_consumer" and cfg["kv_port"] == "21001"
    argv, _ = command(EngineSpec("m", connector=Connector.NONE), Role.MIXED)
    assert "--kv-transfer-config" not in argv


def test_per_instance_environment_and_extra_args_pass_through() -> None:
    spec = EngineSpec("m", side_channel_port=5601, side_channel_host="10.0.0.7", cpu_cores="1",
                      kv_cache_gib=2, served_model_name="tiny",
                      extra_args=("--max-model-len", "2048"))  # fmt: skip
    argv, env = command(spec, Role.DECODE)
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7",
                   "VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}  # fmt: skip
    assert argv[-2:] == ["--max-model-len", "2048"]
    assert argv[argv.index("--served-model-name") + 1] == "tiny"


@pytest.mark.parametrize("bad", [{"port": 0}, {"side_channel_port": 70000}, {"model": ""}])
def test_invalid_specs_fail_loudly(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineSpec(**{"model": "m", **bad})  # type: ignore[arg-type]


def test_downward_api_labels_file() -> None:
    text = 'app="x"\nprorsa.io/cluster="rl"\nprorsa.io/role="decode"\nbroken line\nq="a\\"b"\n'
    labels = parse_labels(text)
    assert labels["prorsa.io/role"] == "decode" and labels["q"] == 'a"b'
    assert "broken line" not in labels


def test_file_role_source_follows_the_kubelet_rewriting_the_file(tmp_path: Path) -> None:
    f = tmp_path / "labels"
    src = FileRoleSource(f)

    async def read() -> Role | None:
        return await src.current()

    assert asyncio.run(read()) is None  # not there yet: keep the current role
    f.write_text('prorsa.io/role="prefill"\n')
    assert asyncio.run(read()) is Role.PREFILL
    f.write_text('prorsa.io/role="decode"\n')
    assert asyncio.run(read()) is Role.DECODE
    f.write_text('prorsa.io/role="chef"\n')
    assert asyncio.run(read()) is None


def test_core_lists() -> None:
    from prorsa.worker.engine import parse_cores

    assert parse_cores("0") == {0}
    assert parse_cores("0-2,5") == {0, 1, 2, 5}
    assert parse_cores("0|1") == {0, 1}  # one list per rank of a parallel engine
    with pytest.raises(ValueError, match="0-3,5"):
        parse_cores("a-b")
    with pytest.raises(ValueError):
        EngineSpec("m", cpu_cores="x")


def test_pinning_a_process_group_binds_all_its_threads(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from prorsa.worker.agent import pin_process_group

    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, "
            "args=(30,), daemon=True).start(); time.sleep(30)",
        ],
        start_new_session=True,
    )
    try:
        import time

        time.sleep(0.5)
        assert pin_process_group(child.pid, {core}) >= 2  # main thread + the extra thread
        for task in Path(f"/proc/{child.pid}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == {core}
    finally:
        child.kill()
        child.wait()


def test_drain_reads_running_and_waiting_requests_from_vllm_metrics() -> None:
    """The agent's idle check parses vLLM's Prometheus text (served here by a real HTTP
    server with the two series vLLM exposes)."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from prorsa.worker.agent import engine_idle

    page = {"text": ""}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    async def main() -> list[bool]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with TestServer(app) as server, aiohttp.ClientSession() as s:
            url = str(server.make_url("")).rstrip("/")
            out = []
            for running, waiting in ((2.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
                page["text"] = (
                    "# HELP vllm:num_requests_running Number of requests running.\n"
                    f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
                    f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
                    'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n'
                )
                out.append(await engine_idle(s, url))
            return out

    assert asyncio.run(main()) == [False, False, True]


def test_local_ports_stay_out_of_the_kernels_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarting engine's internals bind(0) from the ephemeral range; ports we hand out
    (worker HTTP, NIXL side channel) must never be among those, or a restart can lose its own
    side-channel port to its new process."""
    import socket

    from prorsa.local import processes
    from prorsa.local.processes import free_port

    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # spread, not one port over and over
    for port in ports:
        assert not lo <= port <= hi, port
    taken = free_port()
    with socket.socket() as held:  # a port in use is never returned
        held.bind(("127.0.0.1", taken))
        held.listen()
        monkeypatch.setattr(processes, "_OUR_PORTS", (taken, taken + 2))
        assert {free_port() for _ in range(20)} == {taken + 1}


def test_an_engine_spanning_nodes_meets_at_its_first_node() -> None:
    """Each node of a multi-node engine (a LeaderWorkerSet group) runs the same role
    arguments; the first serves the API at the group's address, the others run their
    data-parallel ranks headless from their own start rank (vLLM's multi-node DP)."""
    from prorsa.worker.engine import EngineLayout, restart_needed

    prefill = EngineLayout(gpus=16, data=16, expert=True, nodes=2).vllm_args()
    decode = [*EngineLayout(gpus=16, tensor=8, data=2, nodes=2).vllm_args(),
              "--max-num-seqs", "256"]  # fmt: skip
    assert prefill == ["--data-parallel-size", "16", "--data-parallel-size-local", "8",
                       "--enable-expert-parallel"]  # fmt: skip
    roles = {Role.PREFILL: tuple(prefill), Role.DECODE: tuple(decode)}

    def node(rank: int) -> EngineSpec:
        return EngineSpec("m", role_args=roles, node_rank=rank, group_leader="g-0.g.team",
                          switch_mode=SwitchMode.RESTART)  # fmt: skip

    first, _ = command(node(0), Role.PREFILL)
    assert first[first.index("--data-parallel-address") + 1] == "g-0.g.team"
    assert "--headless" not in first and "--data-parallel-start-rank" not in first
    second, _ = command(node(1), Role.PREFILL)
    assert "--headless" in second and second[2] == "prorsa.worker.headless"  # vLLM's run_headless
    assert first[2] == "vllm.entrypoints.openai.api_server"
    assert second[second.index("--data-parallel-start-rank") + 1] == "8"
    third, _ = command(node(1), Role.DECODE)  # TP8 x DP2: one rank per node
    assert third[third.index("--data-parallel-start-rank") + 1] == "1"
    assert restart_needed(node(1), Role.PREFILL, Role.DECODE)  # every node restarts
    with pytest.raises(ValueError, match="group leader"):
        EngineSpec("m", node_rank=1)


def test_a_role_with_engines_smaller_than_the_worker_runs_one_per_node_group() -> None:
    """A worker of four nodes whose prefill engines span two (DP16 over 2 x 8 GPUs) runs two
    prefill engines: nodes 0 and 2 serve an API each, nodes 1 and 3 run their ranks headless
    at their own engine's first node (named as a LeaderWorkerSet names its pods). In decode,
    one engine spans all four; in mixed, each node runs an engine of its own."""
    from prorsa.worker.engine import EngineLayout, headless, node_address

    roles = {
        Role.PREFILL: tuple(EngineLayout(gpus=16, data=16, expert=True, nodes=2).vllm_args()),
        Role.DECODE: tuple(EngineLayout(gpus=32, data=32, expert=True, nodes=4).vllm_args()),
        Role.MIXED: tuple(EngineLayout(gpus=8, data=8, expert=True).vllm_args()),
    }

    def node(rank: int, leader: str = "w-0.w.team") -> EngineSpec:
        return EngineSpec("m", role_args=roles, node_rank=rank, group_leader=leader,
                          switch_mode=SwitchMode.RESTART)  # fmt: skip

    def arg(argv: list[str], flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    prefill = [command(node(r), Role.PREFILL)[0] for r in range(4)]
    assert [arg(a, "--data-parallel-address") for a in prefill] == [
        "w-0.w.team", "w-0.w.team", "w-0-2.w.team", "w-0-2.w.team"]  # fmt: skip
    assert [headless(node(r), Role.PREFILL) for r in range(4)] == [False, True, False, True]
    assert [arg(a, "--data-parallel-start-rank") for a in prefill] == [None, "8", None, "8"]
    decode = [command(node(r), Role.DECODE)[0] for r in range(4)]
    assert {arg(a, "--data-parallel-address") for a in decode} == {"w-0.w.team"}
    assert [arg(a, "--data-parallel-start-rank") for a in decode] == [None, "8", "16", "24"]
    assert [headless(node(r), Role.DECODE) for r in range(4)] == [False, True, True, True]
    mixed = [command(node(r), Role.MIXED)[0] for r in range(4)]  # an engine per node
    assert not any("--data-parallel-address" in a or "--headless" in a for a in mixed)
    assert node_address("w-3.w.team.svc", 5) == "w-3-5.w.team.svc"
    with pytest.raises(ValueError, match="DNS name"):  # node 2 heads an engine: where is it?
        command(node(2, leader="10.0.0.7"), Role.PREFILL)


def test_the_other_nodes_follow_the_first_nodes_agent() -> None:
    """A follower reads the role from the first node's agent (its real probe server), keeps
    the last one while that agent is away."""
    import socket

    from prorsa.worker.agent import Agent, AgentConfig
    from prorsa.worker.roles import FixedRoleSource, LeaderRoleSource

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> list[Role | None]:
        cfg = AgentConfig("w-0", EngineSpec("m"), Role.PREFILL, "http://127.0.0.1:1",
                          probe_port=port)  # fmt: skip
        agent = Agent(cfg, FixedRoleSource(Role.PREFILL))
        follower = LeaderRoleSource(f"http://127.0.0.1:{port}")
        runner = await agent._serve_probes()
        assert runner is not None
        seen = [await follower.current()]
        agent.role = Role.DECODE  # relabelled
        seen.append(await follower.current())
        await runner.cleanup()
        seen.append(await follower.current())  # the first node's agent is gone
        return seen

    assert asyncio.run(main()) == [Role.PREFILL, Role.DECODE, None]
