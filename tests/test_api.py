"""The RolloutCluster API: models, the generated CRD (no drift, structural), and example specs
validated both by the models and by the CRD's schema."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from prorsa.api import crd as crd_mod
from prorsa.api.models import RolloutClusterSpec, parse_spec
from prorsa.policy.allocate import AllocationSettings

CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "rolloutclusters.prorsa.io.yaml"


def test_crds_directory_matches_the_models() -> None:
    assert CRD_FILE.read_text() == crd_mod.render(), (
        "crds/ drifted from operator/prorsa/api/models.py: run `prorsa crd --out crds/`"
    )


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for k, v in node.get("properties", {}).items():
            out += _walk(v, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def _schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD_FILE.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_the_schema_is_structural() -> None:
    for path, node in _walk(_schema()):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path


def test_subresources_columns_and_names() -> None:
    doc = yaml.safe_load(CRD_FILE.read_text())
    spec = doc["spec"]
    assert spec["names"]["shortNames"] == ["rcl"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.workers.replicas"
    assert "status" in version["subresources"]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Policy", "Prefill", "Decode", "P-GPUs", "D-GPUs", "Ready", "Phase", "Age"]
    rules = _schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert any("minPrefill + self.allocation.minDecode" in r["rule"] for r in rules)


def _openapi_to_jsonschema(node: Any) -> Any:
    """`nullable` is OpenAPI's; JSON Schema says it with a type list."""
    if isinstance(node, dict):
        out = {k: _openapi_to_jsonschema(v) for k, v in node.items()
               if not k.startswith("x-kubernetes")}  # fmt: skip
        if out.pop("nullable", False) and "type" in out:
            out["type"] = [out["type"], "null"]
        if out.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = out.pop("minimum")
        return out
    if isinstance(node, list):
        return [_openapi_to_jsonschema(v) for v in node]
    return node


def crd_valid(spec: dict[str, Any]) -> bool:
    schema = _openapi_to_jsonschema(_schema()["properties"]["spec"])
    try:
        jsonschema.validate(spec, schema)
        return True
    except jsonschema.ValidationError:
        return False


def _defaulted(node: dict[str, Any], value: Any) -> Any:
    """What the API server hands CEL: schema defaults filled in, nested ones too, and every
    `number` field a double (as Kubernetes types it, even when written as an integer)."""
    if node.get("type") == "number" and isinstance(value, int):
        return float(value)
    if node.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for name, prop in (node.get("properties") or {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = _defaulted(prop, out[name])
    return out


def cel_failures(spec: dict[str, Any]) -> list[str]:
    """Messages of the CRD's CEL rules that refuse `spec`, evaluated as the API server does:
    on the defaulted object (cel-python, a CEL implementation independent of ours)."""
    schema = _schema()["properties"]["spec"]
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(_defaulted(schema, spec))}
    failed = []
    for rule in schema["x-kubernetes-validations"]:
        if not env.program(env.compile(rule["rule"])).evaluate(activation):
            failed.append(rule["message"])
    return failed


GOOD = [
    {"model": {"name": "Qwen/Qwen3-8B"}},
    {
        "model": {"name": "/models/llama", "servedName": "policy"},
        "workers": {"replicas": 16, "gpusPerWorker": 1, "engineArgs": ["--max-model-len", "32768"],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {"anything": ["goes"]}}},
        "kvTransfer": {"connector": "nixl", "switchMode": "restart"},
        "allocation": {"policy": "static", "staticPrefill": 4, "minPrefill": 1, "minDecode": 2},
        "redis": {"url": "redis://redis:6379/0", "passwordSecretRef": {"name": "redis-auth"}},
        "router": {"replicas": 2, "serviceType": "LoadBalancer"},
        "trainer": {"template": {"spec": {"containers": [{"name": "t", "image": "trainer"}]}}},
    },
    {  # stage-specific parallelism: MoE prefill DP8/EP8 and decode TP2 x DP4/EP8 engines
        "model": {"name": "deepseek-ai/DeepSeek-V3"},
        "workers": {"replicas": 4, "gpusPerWorker": 8, "expertParallel": True,
                    "prefill": {"dataParallelSize": 8,
                                "engineArgs": ["--max-num-batched-tokens", "16384"]},
                    "decode": {"tensorParallelSize": 2, "engineArgs": ["--max-num-seqs", "256"]}},
        "kvTransfer": {"switchMode": "restart"},
        "allocation": {"capacityModel": "h200-deepseek-v3"},
    },
    {  # engines spanning nodes: prefill units of 4 nodes, decode units of 8 (two per slot)
        "model": {"name": "deepseek-ai/DeepSeek-V3"},
        "workers": {"replicas": 2, "gpusPerWorker": 64, "dataParallelSize": 64,
                    "expertParallel": True, "prefill": {"gpusPerWorker": 32}},
        "kvTransfer": {"switchMode": "restart"},
    },
    {  # the same engine configured twice over is not stage-specific: routing stays allowed
        "model": {"name": "m"},
        "workers": {"gpusPerWorker": 2, "prefill": {"gpusPerWorker": 2}},
    },
]  # fmt: skip


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_pass_models_and_schema(spec: dict[str, Any]) -> None:
    parse_spec(spec)
    assert crd_valid(spec)
    assert cel_failures(spec) == []


def test_defaults_come_from_the_policy_settings() -> None:
    spec = parse_spec({"model": {"name": "m"}})
    assert spec.workers.replicas == 2 and spec.redis.managed and spec.router.port == 8080
    assert spec.allocation.settings() == AllocationSettings()


BAD_BOTH = [  # rejected by the schema (what kubectl apply sees) and by the models
    ({"model": {"name": "m"}, "workers": {"replicas": 0}}, "replicas"),
    ({"model": {"name": "m"}, "allocation": {"policy": "magic"}}, "policy"),
    ({"model": {"name": ""}}, "name"),
    ({"workers": {"replicas": 2}}, "model"),
    ({"model": {"name": "m"}, "router": {"serviceType": "Ingress"}}, "serviceType"),
    ({"model": {"name": "m"}, "redis": {"url": "http://x"}}, "url"),
    ({"model": {"name": "m"}, "allocation": {"intervalSeconds": 0}}, "intervalSeconds"),
    ({"model": {"name": "m"}, "allocation": {"minDecode": 0}}, "minDecode"),
    ({"model": {"name": "m"}, "workers": {"engineArgs": ["--x"] * 129}}, "engineArgs"),
]
BAD_CROSS_FIELD = [  # valid field by field; the CEL rules (and the models) refuse them
    ({"model": {"name": "m"}, "workers": {"replicas": 2},
      "allocation": {"minPrefill": 2, "minDecode": 1}}, "minPrefill \\+ minDecode"),
    ({"model": {"name": "m"}, "workers": {"replicas": 4},
      "allocation": {"policy": "static", "staticPrefill": 4}}, "staticPrefill"),
    ({"model": {"name": "m"}, "redis": {"url": "redis://r:6379", "managed": True}},
     "exactly one"),
    ({"model": {"name": "m"}, "allocation": {"horizonSeconds": 4}},
     "horizonSeconds .*must be >= allocation.intervalSeconds"),
    ({"model": {"name": "m"}, "allocation": {"horizonSeconds": 30, "intervalSeconds": 45}},
     "horizonSeconds .*must be >= allocation.intervalSeconds"),
    ({"model": {"name": "m"}, "workers": {"engineArgs": ["--port", "9000"]}},
     "engineArgs must not set.*--port"),
    ({"model": {"name": "m"}, "workers": {"engineArgs": ["--enforce-eager",
      '--kv-transfer-config={"kv_connector":"X"}']}}, "engineArgs must not set.*--kv-transfer"),
    ({"model": {"name": "m"}, "workers": {"engineArgs": ["--model=/other"]}},
     "engineArgs must not set.*--model"),
    ({"model": {"name": "m"}, "workers": {"replicas": 8},
      "allocation": {"policy": "static", "staticPrefill": 1, "minPrefill": 2}},
     "staticPrefill .*must lie within"),
    ({"model": {"name": "m"}, "workers": {"replicas": 8},
      "allocation": {"policy": "static", "staticPrefill": 6, "minDecode": 3}},
     "staticPrefill .*must lie within"),
    ({"model": {"name": "m"}, "allocation": {"capacityModel": "h200-deepseek-v3"}},
     "capacityModel .*gpusPerWorker"),
    ({"model": {"name": "m"}, "workers": {"replicas": 4}, "allocation": {"initialPrefill": 4}},
     "initialPrefill .*must leave"),
    ({"model": {"name": "m"}, "workers": {"engineArgs": ["--data-parallel-size=2"]}},
     "workers.engineArgs must not set.*--data-parallel-size"),
    ({"model": {"name": "m"}, "workers": {"decode": {"engineArgs": ["-tp", "2"]}},
      "kvTransfer": {"switchMode": "restart"}}, "workers.decode.engineArgs must not set.*-tp"),
    ({"model": {"name": "m"}, "workers": {"prefill": {"engineArgs": ["--max-num-seqs", "8"]}}},
     "kvTransfer.switchMode routing"),
    ({"model": {"name": "m"}, "workers": {"decode": {"expertParallel": True}}},
     "kvTransfer.switchMode routing"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 8, "tensorParallelSize": 4,
                                          "dataParallelSize": 4}},
     "workers: tensorParallelSize x pipelineParallelSize x dataParallelSize .4 x 1 x 4 = 16"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 4, "decode": {"tensorParallelSize": 3}},
      "kvTransfer": {"switchMode": "restart"}}, "workers.decode: tensorParallelSize"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 16, "tensorParallelSize": 16}},
     "workers: an engine of 16 GPUs spans nodes"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 8, "prefill": {"gpusPerWorker": 4}},
      "kvTransfer": {"switchMode": "restart"}}, "workers.prefill.gpusPerWorker .4. must tile"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 24, "prefill": {"gpusPerWorker": 16}},
      "kvTransfer": {"switchMode": "restart"}}, "workers.prefill.gpusPerWorker .16. must tile"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 8, "decode": {"gpusPerWorker": 16,
      "tensorParallelSize": 16}}, "kvTransfer": {"switchMode": "restart"}},
     "workers.decode: an engine of 16 GPUs"),
    ({"model": {"name": "m"}, "workers": {"gpusPerWorker": 8, "decode": {"gpusPerWorker": 16,
      "dataParallelSize": 16}}, "kvTransfer": {"switchMode": "restart"},
      "allocation": {"capacityModel": "h100-deepseek-v3"}},
     "capacityModel h100-deepseek-v3 .*workers.gpusPerWorker .8. must be a multiple of 16"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "field"), BAD_BOTH)
def test_bad_specs_fail_both_with_the_field_named(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        RolloutClusterSpec.model_validate(spec)
    assert not crd_valid(spec)


@pytest.mark.parametrize(("spec", "message"), BAD_CROSS_FIELD)
def test_cross_field_rules(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RolloutClusterSpec.model_validate(spec)
    assert crd_valid(spec)  # only CEL catches these at the API server
    failed = cel_failures(spec)
    field = message.split(" ")[0]
    assert failed and all(field in f for f in failed), failed


def test_unknown_fields_are_refused_by_the_models() -> None:
    with pytest.raises(ValidationError, match="replicaz"):
        parse_spec({"model": {"name": "m"}, "workers": {"replicaz": 3}})


def test_the_configuration_reference_matches_the_models() -> None:
    """docs/configuration.md is `prorsa reference`: regenerate it after changing the models."""
    from prorsa.api.reference import reference

    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert page.read_text() == reference()
    for field in ("spec.allocation.horizonSeconds", "spec.redis.passwordSecretRef.key",
                  "status.conditions.reason"):  # fmt: skip
        assert f"`{field}`" in page.read_text()


def test_every_capacity_model_is_a_simulator_preset_or_auto_and_they_differ() -> None:
    import typing

    from prorsa.api.models import Allocation
    from prorsa.kube.handlers import worker_capacity
    from prorsa.sim.presets import AUTO_PRIOR, PRESETS

    choices = typing.get_args(Allocation.model_fields["capacityModel"].annotation)
    assert set(choices) == set(PRESETS) | {"auto"} and AUTO_PRIOR in PRESETS
    assert parse_spec({"model": {"name": "m"}}).allocation.capacityModel == "auto"
    with pytest.raises(ValidationError, match="learnCapacity true or name a preset"):
        parse_spec({"model": {"name": "m"}, "allocation": {"learnCapacity": False}})
    from prorsa.api.models import UNIT_GPUS

    assert {k: unit for k, (_, _, unit) in PRESETS.items() if unit} == UNIT_GPUS
    h200 = worker_capacity(parse_spec({"model": {"name": "m"}}))
    h100_spec = {"model": {"name": "m"}, "allocation": {"capacityModel": "h100-dense-8b"}}
    h100 = worker_capacity(parse_spec(h100_spec))
    assert h100.decode_s_per_kv_token > h200.decode_s_per_kv_token  # less HBM bandwidth
