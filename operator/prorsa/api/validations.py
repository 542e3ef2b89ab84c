"""Cross-field rules of the `RolloutCluster` spec that the API server enforces (CEL).

The API server has no pydantic: each rule here mirrors a validator of `models.py` in CEL, so
`kubectl apply` refuses what the operator would refuse, with the same message naming the
field. `tests/test_api.py` runs both over the same specs and checks they agree.
"""

from __future__ import annotations

from prorsa.api.models import OPERATOR_ENGINE_FLAGS, PARALLEL_SIZES, SHOWN_FLAGS, UNIT_GPUS

_OWNED_RE = "^(" + "|".join(OPERATOR_ENGINE_FLAGS) + ")(=.*)?$"
_CEL_SETTINGS = ("gpusPerWorker", "tensorParallelSize", "pipelineParallelSize",
                 "dataParallelSize", "expertParallel", "engineArgs")  # fmt: skip
_CEL_UNSET = {"gpusPerWorker": "1", "tensorParallelSize": "0", "pipelineParallelSize": "1",
              "dataParallelSize": "0", "expertParallel": "false"}  # fmt: skip


def _cel_pick(role: str | None, field: str, unset: str) -> str:
    """The role's value of `field`, else the shared one, else `unset`."""
    shared = f"(has(self.workers.{field}) ? self.workers.{field} : {unset})"
    if role is None:
        return shared
    r = f"self.workers.{role}"
    if field in PARALLEL_SIZES:  # a role with GPUs of its own derives its sizes from them
        shared = f"(has({r}) && has({r}.gpusPerWorker) ? {unset} : {shared})"
    return f"(has({r}) && has({r}.{field}) ? {r}.{field} : {shared})"


def _cel_setting(role: str, field: str) -> str:
    if field == "engineArgs":  # the role's own arguments (the shared ones are common)
        r = f"self.workers.{role}"
        return f"(has({r}) && has({r}.engineArgs) ? {r}.engineArgs : [])"
    return _cel_pick(role, field, _CEL_UNSET[field])


def _let(name: str, value: str, body: str) -> str:
    """CEL has no `let` here (cel.bind is not everywhere): a one-element list binds it."""
    return f"[{value}].all({name}, {body})"


_NODE = "(has(self.workers.gpusPerNode) ? self.workers.gpusPerNode : 8)"
_ROLE_BLOCKS = ((None, "workers"), ("prefill", "workers.prefill"), ("decode", "workers.decode"))


def _cel_layout_ok(role: str | None) -> str:
    product = ("((tp > 0 && dp > 0) ? tp * pp * dp == g : (tp > 0 ? g % (tp * pp) == 0 : "
               "(dp > 0 ? g % (dp * pp) == 0 : m % pp == 0 && g % m == 0)))")  # fmt: skip
    tp_eff = "(tp > 0 ? tp : (dp > 0 ? g / (dp * pp) : m / pp))"
    nodes = f"(g <= n || (g % n == 0 && {tp_eff} * pp > 0 && n % ({tp_eff} * pp) == 0))"
    body = _let("m", "(g < n ? g : n)", f"{product} && {nodes}")
    sizes = (("dp", "dataParallelSize", "0"), ("tp", "tensorParallelSize", "0"),
             ("pp", "pipelineParallelSize", "1"), ("g", "gpusPerWorker", "1"))  # fmt: skip
    for name, field, unset in sizes:
        body = _let(name, _cel_pick(role, field, unset), body)
    return _let("n", _NODE, body)


def _cel_tiles() -> str:
    body = " && ".join(f"s % {g} == 0 && ({g} == s || {g} % n == 0)" for g in ("p", "d"))
    body = _let("s", "(p > d ? p : d)", body)
    body = _let("d", _cel_pick("decode", "gpusPerWorker", "1"), body)
    body = _let("p", _cel_pick("prefill", "gpusPerWorker", "1"), body)
    return _let("n", _NODE, body)


# The rules, each mirroring a validator of `models.py`.
SPEC_VALIDATIONS: list[dict[str, str]] = [
    {
        "rule": "!has(self.allocation) || !has(self.workers) || "
        "self.allocation.minPrefill + self.allocation.minDecode <= self.workers.replicas",
        "message": "allocation.minPrefill + allocation.minDecode must be <= workers.replicas",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.staticPrefill) || "
        "!has(self.workers) || self.allocation.staticPrefill < self.workers.replicas",
        "message": "allocation.staticPrefill must leave a decode worker",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.learnCapacity) || "
        "self.allocation.learnCapacity || "
        "(has(self.allocation.capacityModel) && self.allocation.capacityModel != 'auto')",
        "message": "allocation.capacityModel auto is learned online: set "
        "allocation.learnCapacity true or name a preset",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.horizonSeconds) || "
        "!has(self.allocation.intervalSeconds) || "
        "self.allocation.horizonSeconds >= self.allocation.intervalSeconds",
        "message": "allocation.horizonSeconds must be >= allocation.intervalSeconds",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.staticPrefill) || "
        "!has(self.allocation.policy) || self.allocation.policy != 'static' || "
        "!has(self.workers) || (self.allocation.staticPrefill >= self.allocation.minPrefill && "
        "self.allocation.staticPrefill <= self.workers.replicas - self.allocation.minDecode)",
        "message": "allocation.staticPrefill must lie within allocation.minPrefill and "
        "workers.replicas - allocation.minDecode",
    },
    *(
        {
            "rule": f"!has(self.workers) || !has({where}) || !has({where}.engineArgs) || "
            f"{where}.engineArgs.all(a, !a.matches('{_OWNED_RE}'))",
            "message": f"{where[5:]}.engineArgs must not set what the operator sets: "
            + SHOWN_FLAGS,
        }
        for where in ("self.workers", "self.workers.prefill", "self.workers.decode")
    ),
    *(
        {
            "rule": "!has(self.workers) || "
            + (f"!has(self.workers.{role}) || " if role else "")
            + _cel_layout_ok(role),
            "message": f"{where}: tensorParallelSize x pipelineParallelSize x dataParallelSize "
            "must equal gpusPerWorker, and an engine wider than workers.gpusPerNode needs "
            "whole nodes with tensor x pipeline parallel dividing a node",
        }
        for role, where in _ROLE_BLOCKS
    ),
    {
        "rule": "!has(self.workers) || " + _cel_tiles(),
        "message": "workers.prefill.gpusPerWorker and workers.decode.gpusPerWorker (default: "
        "workers.gpusPerWorker) must tile a worker of the larger one: divide it, in whole nodes "
        "of workers.gpusPerNode",
    },
    {
        "rule": "!has(self.workers) || !has(self.kvTransfer) || "
        "!has(self.kvTransfer.switchMode) || self.kvTransfer.switchMode != 'routing' || "
        + " && ".join(
            f"{_cel_setting('prefill', f)} == {_cel_setting('decode', f)}" for f in _CEL_SETTINGS
        ),
        "message": "kvTransfer.switchMode routing cannot run workers.prefill and workers.decode "
        "engines configured apart (a switch there restarts the engine): use restart",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.initialPrefill) || "
        "!has(self.workers) || "
        "self.allocation.initialPrefill <= self.workers.replicas - self.allocation.minDecode",
        "message": "allocation.initialPrefill must leave allocation.minDecode decode workers",
    },
    {
        "rule": "!has(self.allocation) || !has(self.allocation.capacityModel) || "
        "!has(self.workers) || "
        + " && ".join(
            f"(self.allocation.capacityModel != '{k}' || {_cel_pick(r, 'gpusPerWorker', '1')}"
            f" % {v} == 0)"
            for k, v in UNIT_GPUS.items()
            for r in (None, "prefill", "decode")
        ),
        "message": "allocation.capacityModel of engine units needs every role's gpusPerWorker "
        "to be a multiple of its unit: " + ", ".join(f"{k} = {v}" for k, v in UNIT_GPUS.items()),
    },
    {
        "rule": "!has(self.redis) || (has(self.redis.url) != "
        "(has(self.redis.managed) && self.redis.managed))",
        "message": "redis: set exactly one of url and managed: true",
    },
]
