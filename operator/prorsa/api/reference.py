"""The RolloutCluster configuration reference (docs/configuration.md), generated from the
models so it cannot disagree with them: `prorsa reference > docs/configuration.md`."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from prorsa.api import models as m
from prorsa.api.validations import SPEC_VALIDATIONS

_HEADER = """# RolloutCluster configuration reference

Generated from `operator/prorsa/api/models.py` by `prorsa reference`; a test fails when this
page and the models disagree. `apiVersion: {group}/{version}`, `kind: {kind}` (short name
`rcl`). The API server applies the defaults and bounds (the CRD schema) and the cross-field
rules at the end; the operator checks the same again and reports what it cannot honour as a
`Degraded` condition.
"""


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel) and t is not m.FreeForm:
            return t
    return None


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is list:
        return f"list of {_type(typing.get_args(annotation)[0])}"
    if origin is dict:
        return "map of string"
    if annotation is m.FreeForm:
        return "object (Kubernetes)"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(
        annotation, str(annotation))  # fmt: skip


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
    if value is PydanticUndefined or value is None:
        return "—"
    if isinstance(value, BaseModel):
        return "see below"
    if value in ([], {}, ""):
        return "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _bounds(f: FieldInfo) -> str:
    out = []
    for c in f.metadata:
        for kind, sign in ((Ge, "≥"), (Gt, ">"), (Le, "≤"), (Lt, "<")):
            if isinstance(c, kind):
                out.append(f"{sign} {getattr(c, kind.__name__.lower())}")
        if isinstance(c, MinLen) and c.min_length > 0:
            out.append("non-empty")
        if isinstance(c, MaxLen):
            out.append(f"≤ {c.max_length} chars")
        pattern = getattr(c, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows, nested = [], []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{path}` | {_type(f.annotation)} | {_default(f)} | {_bounds(f)} | "
                    f"{desc} |")  # fmt: skip
        sub = _model_of(f.annotation)
        if sub is not None:
            nested.append((sub, path + "."))
    for sub, p in nested:
        rows += _rows(sub, p)
    return rows


def reference() -> str:
    lines = [_HEADER.format(group=m.GROUP, version=m.VERSION, kind=m.KIND), "## spec", "",
             "| Field | Type | Default | Bounds | Meaning |", "|---|---|---|---|---|"]  # fmt: skip
    lines += _rows(m.RolloutClusterSpec, "spec.")
    lines += ["", "### Cross-field rules", ""]
    lines += [f"- {v['message']}" for v in SPEC_VALIDATIONS]
    lines += ["", "## status (written by the operator)", "",
              "| Field | Type | Default | Bounds | Meaning |", "|---|---|---|---|---|"]  # fmt: skip
    lines += _rows(m.RolloutClusterStatus, "status.")
    return "\n".join(lines) + "\n"
