"""The Kubernetes objects of a RolloutCluster, built from its spec (pure functions)."""

from __future__ import annotations

import json

from prorsa.api.models import parse_spec
from prorsa.kube import builders as b
from prorsa.kube import labels as L
from prorsa.policy.allocate import Role
from prorsa.worker.roles import parse_labels

SPEC = parse_spec({
    "model": {"name": "Qwen/Qwen3-8B", "servedName": "policy"},
    "workers": {"replicas": 3, "gpusPerWorker": 2, "engineArgs": ["--max-model-len", "32768"],
                "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "auth", "key": "pw"}},
})  # fmt: skip


def objs() -> list[dict]:  # type: ignore[type-arg]
    return b.children("rl", "team", "uid-1", SPEC, [Role.PREFILL, Role.DECODE, Role.DECODE])


def test_every_child_is_owned_and_labelled() -> None:
    for o in objs():
        meta = o["metadata"]
        assert meta["namespace"] == "team" and meta["labels"][L.CLUSTER] == "rl"
        [owner] = meta["ownerReferences"]
        assert owner["uid"] == "uid-1" and owner["controller"] and owner["kind"] == "RolloutCluster"


def test_the_role_label_is_in_no_workload_selector() -> None:
    for o in objs():
        if o["kind"] in ("Deployment", "StatefulSet", "ReplicaSet"):
            assert L.ROLE not in o["spec"]["selector"]["matchLabels"]
            assert L.ROLE not in o["spec"]["template"]["metadata"]["labels"]
    roles = {o["metadata"]["name"]: o["spec"]["selector"] for o in objs()
             if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"}  # fmt: skip
    assert roles == {
        "rl-prefill": {L.CLUSTER: "rl", L.COMPONENT: L.WORKER, L.ROLE: "prefill"},
        "rl-decode": {L.CLUSTER: "rl", L.COMPONENT: L.WORKER, L.ROLE: "decode"},
    }


def test_worker_pods_read_their_role_from_their_own_labels() -> None:
    pods = [o for o in objs() if o["kind"] == "Pod"]
    assert [p["metadata"]["labels"][L.ROLE] for p in pods] == ["prefill", "decode", "decode"]
    pod = pods[0]
    c = pod["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--role-file") + 1] == "/etc/prorsa/labels"
    assert pod["spec"]["volumes"][0]["downwardAPI"]["items"][0]["fieldRef"] == {
        "fieldPath": "metadata.labels"
    }
    # the agent parses exactly what the kubelet writes for those labels
    written = "\n".join(f'{k}="{v}"' for k, v in pod["metadata"]["labels"].items())
    assert parse_labels(written)[L.ROLE] == "prefill"
    role_args = json.loads(args[args.index("--role-args") + 1])
    for role in ("prefill", "decode", "mixed"):
        assert role_args[role] == ["--tensor-parallel-size", "2", "--max-model-len", "32768"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["metadata"]["annotations"][L.PORT] == "8000"
    assert "$(POD_IP)" in args and pod["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists"}
    ]


def test_router_points_at_redis_with_the_secret_and_watches_pods() -> None:
    dep = next(o for o in objs() if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--redis-url") + 1] == "redis://r:6379/0"
    assert c["env"] == [{"name": "REDIS_PASSWORD",
                         "valueFrom": {"secretKeyRef": {"name": "auth", "key": "pw"}}}]  # fmt: skip
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    role = next(o for o in objs() if o["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    assert b.endpoint("rl", "team", SPEC) == "http://rl.team.svc:8080/v1"


def test_the_trainer_pod_is_the_users_template_wired_to_the_endpoint() -> None:
    spec = parse_spec({
        "model": {"name": "m"},
        "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "rs"}},
        "trainer": {"template": {
            "metadata": {"labels": {"team": "rl"}},
            "spec": {"containers": [{"name": "grpo", "image": "trainer:1",
                                     "env": [{"name": "OPENAI_API_KEY", "value": "mine"}]}]}}},
    })  # fmt: skip
    objs = b.children("rc", "ns", "uid", spec, [Role.DECODE])
    [pod] = [o for o in objs if o["metadata"]["name"] == "rc-trainer"]
    assert pod["metadata"]["labels"] == {"team": "rl", L.CLUSTER: "rc", L.COMPONENT: "trainer"}
    assert pod["metadata"]["ownerReferences"][0]["name"] == "rc"
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"]["value"] == "http://rc.ns.svc:8080/v1"
    assert env["PRORSA_ENDPOINT"]["value"] == env["OPENAI_BASE_URL"]["value"]
    assert env["PRORSA_TRAJECTORY_HEADER"]["value"] == "X-Prorsa-Trajectory"
    assert env["PRORSA_REDIS_URL"]["value"] == "redis://r:6379/0"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "rs"
    assert env["OPENAI_API_KEY"]["value"] == "mine"  # the user's own setting wins
    without = b.children("rc", "ns", "uid", parse_spec({"model": {"name": "m"}}), [])
    assert not [o for o in without if o["metadata"]["name"] == "rc-trainer"]


STAGED = parse_spec({
    "model": {"name": "deepseek-ai/DeepSeek-V3"},
    "workers": {"replicas": 4, "gpusPerWorker": 8, "expertParallel": True,
                "engineArgs": ["--max-model-len", "65536"],
                "prefill": {"dataParallelSize": 8,
                            "engineArgs": ["--max-num-batched-tokens", "16384"]},
                "decode": {"dataParallelSize": 4, "tensorParallelSize": 2,
                           "engineArgs": ["--max-num-seqs", "256"]}},
    "kvTransfer": {"switchMode": "restart"},
    "allocation": {"capacityModel": "h200-deepseek-v3"},
})  # fmt: skip


def test_each_role_runs_its_own_engine_and_the_agent_gets_them_all() -> None:
    from prorsa.worker.engine import EngineSpec, command, parse_role_args, restart_needed

    pods = [o for o in b.children("ds", "team", "u", STAGED, [Role.PREFILL, Role.DECODE])
            if o["kind"] == "Pod"]  # fmt: skip
    c = pods[0]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    per_role = parse_role_args(c["args"][c["args"].index("--role-args") + 1])
    assert per_role[Role.PREFILL] == ("--data-parallel-size", "8", "--enable-expert-parallel",
                                      "--max-model-len", "65536", "--max-num-batched-tokens",
                                      "16384")  # fmt: skip
    assert per_role[Role.DECODE] == ("--tensor-parallel-size", "2", "--data-parallel-size", "4",
                                     "--enable-expert-parallel", "--max-model-len", "65536",
                                     "--max-num-seqs", "256")  # fmt: skip
    engine = EngineSpec(model="m", role_args=per_role)
    argv, _ = command(engine, Role.DECODE)
    assert argv[-len(per_role[Role.DECODE]) :] == list(per_role[Role.DECODE])
    assert restart_needed(engine, Role.PREFILL, Role.DECODE)
    same = EngineSpec(model="m", role_args={r: per_role[Role.DECODE] for r in Role})
    assert not restart_needed(same, Role.PREFILL, Role.DECODE)  # routing: kv_both, same args
