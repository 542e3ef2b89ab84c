"""The CustomResourceDefinition, generated from the pydantic models (`prorsa crd`).

pydantic writes JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: no `$ref`
(definitions are inlined), `nullable` instead of `anyOf [X, null]`, boolean
`exclusiveMinimum`, no `additionalProperties: false` beside `properties` (the API server prunes
unknown fields instead), free-form objects marked `x-kubernetes-preserve-unknown-fields`, and
object defaults of `{}` so nested defaults apply. Cross-field rules ride along as CEL
`x-kubernetes-validations`.
"""

from __future__ import annotations

from typing import Any

import yaml

from prorsa.api import models as m
from prorsa.api.validations import SPEC_VALIDATIONS

_DROP = {"title"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    any_of = node.get("anyOf")
    if any_of is not None:
        options = [o for o in any_of if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express {any_of} structurally")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        merged = structural({**_resolve(options[0], defs), **rest}, defs)
        if len(options) < len(any_of):
            merged["nullable"] = True
        return merged
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DROP or k == "$defs":
            continue
        if k == "properties":
            out[k] = {name: structural(sub, defs) for name, sub in v.items()}
        elif k == "items":
            out[k] = structural(v, defs)
        elif k == "additionalProperties":
            if isinstance(v, dict):
                out[k] = structural(v, defs)
            elif v is True and not node.get("properties"):
                out["x-kubernetes-preserve-unknown-fields"] = True
            # False (extra="forbid"): the API server prunes unknown fields instead
        elif k == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = v, True
        elif k == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = v, True
        elif k == "default" and v is None:
            continue
        else:
            out[k] = v
    if node.get("additionalProperties") is True and not node.get("properties"):
        out.pop("properties", None)
    return out


def _object_defaults(schema: dict[str, Any], model_defaults: dict[str, Any]) -> None:
    """Give optional object fields the default the models give them, so the API server
    fills nested defaults in too."""
    props = schema.get("properties", {})
    for name, value in model_defaults.items():
        if name in props and isinstance(value, dict) and name not in schema.get("required", []):
            props[name]["default"] = value


def spec_schema() -> dict[str, Any]:
    raw = m.RolloutClusterSpec.model_json_schema(mode="validation")
    s = structural(raw, raw.get("$defs", {}))
    _object_defaults(s, {"workers": {}, "kvTransfer": {}, "allocation": {},
                         "redis": {"managed": True}, "router": {}})  # fmt: skip
    s["properties"]["workers"]["properties"]["resources"]["default"] = {}
    s["x-kubernetes-validations"] = SPEC_VALIDATIONS
    return s


def status_schema() -> dict[str, Any]:
    raw = m.RolloutClusterStatus.model_json_schema(mode="validation")
    return structural(raw, raw.get("$defs", {}))


def crd() -> dict[str, Any]:
    columns = [
        ("Policy", "string", ".spec.allocation.policy"),
        ("Prefill", "integer", ".status.prefill"),
        ("Decode", "integer", ".status.decode"),
        ("P-GPUs", "integer", ".status.prefillUnitGPUs"),
        ("D-GPUs", "integer", ".status.decodeUnitGPUs"),
        ("Ready", "integer", ".status.ready"),
        ("Phase", "string", ".status.phase"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{m.PLURAL}.{m.GROUP}"},
        "spec": {
            "group": m.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": m.KIND,
                "listKind": f"{m.KIND}List",
                "plural": m.PLURAL,
                "singular": m.SINGULAR,
                "shortNames": m.SHORT_NAMES,
                "categories": ["prorsa"],
            },
            "versions": [
                {
                    "name": m.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An elastic LLM rollout cluster for agentic RL.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.workers.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": n, "type": t, "jsonPath": p} for n, t, p in columns
                    ]
                    + [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `prorsa crd` from operator/prorsa/api/models.py; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
