"""The examples a user applies first: every manifest is valid (RolloutClusters against the CRD
schema and the models, the rest against the Kubernetes schemas), and they say what their
comments promise (16 predictive GPUs, the baselines, the trainer's endpoint)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from prorsa.api.models import KIND, parse_spec
from prorsa.kube import builders as b
from test_api import cel_failures, crd_valid

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def cluster(name: str) -> dict[str, Any]:
    [rc] = [d for d in docs(name) if d["kind"] == KIND]
    return rc


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_manifest_is_valid(name: str) -> None:
    for doc in docs(name):
        if doc["kind"] == KIND:
            assert crd_valid(doc["spec"]), f"{name}: the CRD schema refuses it"
            assert cel_failures(doc["spec"]) == [], f"{name}: the CRD's CEL rules refuse it"
            parse_spec(doc["spec"])  # the models (and the cross-field rules) accept it
        else:
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_the_swe_example_is_16_gpus_under_the_predictive_policy() -> None:
    spec = parse_spec(cluster("swe-agent-predictive.yaml")["spec"])
    assert spec.workers.replicas * spec.workers.gpusPerWorker == 16
    assert spec.allocation.policy == "predictive" and spec.trainer is not None


def test_the_baselines_differ_from_the_swe_example_only_in_the_policy() -> None:
    swe = parse_spec(cluster("swe-agent-predictive.yaml")["spec"])
    for name, policy in (("baseline-colocated.yaml", "colocated"),
                         ("baseline-static.yaml", "static")):  # fmt: skip
        base = parse_spec(cluster(name)["spec"])
        assert base.allocation.policy == policy
        assert base.model.name == swe.model.name and base.workers.replicas == swe.workers.replicas
        assert base.workers.engineArgs == swe.workers.engineArgs


def test_the_trainer_pod_talks_to_the_swe_clusters_endpoint_with_trajectory_ids() -> None:
    [pod] = docs("trainer-pod.yaml")
    [c] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    rc = cluster("swe-agent-predictive.yaml")
    assert env["OPENAI_BASE_URL"] == b.endpoint(rc["metadata"]["name"], "rl",
                                                parse_spec(rc["spec"]))  # fmt: skip
    script = c["args"][0]
    ast.parse(script)
    for path in ("/v1/chat/completions", "tool_start", "tool_end", "/end"):
        assert path in script
    assert "X-Prorsa-Trajectory" in script


def test_the_byo_redis_example_ships_the_secret_it_references() -> None:
    manifests = docs("bring-your-own-redis.yaml")
    secret = next(d for d in manifests if d["kind"] == "Secret")
    spec = parse_spec(cluster("bring-your-own-redis.yaml")["spec"])
    assert spec.redis.passwordSecretRef is not None and not spec.redis.managed
    assert spec.redis.passwordSecretRef.name == secret["metadata"]["name"]
    assert spec.redis.passwordSecretRef.key in secret["stringData"]


def test_the_expert_parallel_example_runs_stage_specific_engines() -> None:
    from prorsa.policy.allocate import Role

    w = parse_spec(cluster("deepseek-v3-ep.yaml")["spec"]).workers
    prefill, decode = w.layout(Role.PREFILL), w.layout(Role.DECODE)
    assert (prefill.gpus, prefill.data, prefill.expert) == (32, 32, True)
    assert (decode.gpus, decode.data, decode.expert) == (64, 64, True)
    assert w.slot_gpus * w.replicas == 128 and w.staged


def test_the_multi_node_examples_build_the_engines_they_describe() -> None:
    """deepseek-v3-multinode: every role's engine spans the worker's four nodes, with
    stage-specific arguments. deepseek-v3-ep: a worker of eight nodes runs one decode engine
    over all of them or two prefill engines of four, each an endpoint (the operator's pods
    say so; the prefill arguments give four nodes per engine to every node's agent)."""
    import json

    from prorsa.kube import builders as b
    from prorsa.kube import labels as L
    from prorsa.policy.allocate import Role
    from prorsa.worker.engine import engine_nodes

    w = parse_spec(cluster("deepseek-v3-multinode.yaml")["spec"]).workers
    assert w.multi_node and w.slot_gpus // w.gpusPerNode == 4 and w.staged
    for role in (Role.PREFILL, Role.DECODE):
        assert (w.layout(role).gpus, w.layout(role).data, w.layout(role).nodes) == (32, 32, 4)
    spec = parse_spec(cluster("deepseek-v3-ep.yaml")["spec"])
    lws = b.worker_group("ds", "rl", b.owner_reference("ds", "u"), spec, 0, Role.PREFILL)
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 8
    ann = t["workerTemplate"]["metadata"]["annotations"]
    assert json.loads(ann[L.ENGINE_NODES]) == {"prefill": 4}
    assert engine_nodes(spec.workers.layout(Role.PREFILL).vllm_args()) == 4
    assert engine_nodes(spec.workers.layout(Role.DECODE).vllm_args()) == 8
