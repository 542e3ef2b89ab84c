"""The policy core stays pure: the simulator, the local runner and the operator all run it."""

from __future__ import annotations

import ast
from pathlib import Path

POLICY = Path(__file__).resolve().parents[1] / "operator" / "prorsa" / "policy"
FORBIDDEN = {"asyncio", "redis", "kopf", "kubernetes", "socket", "subprocess", "httpx", "aiohttp"}


def test_policy_imports_nothing_of_the_adapters_and_no_io() -> None:
    files = sorted(POLICY.glob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{f.name} imports {n}"
                if n.startswith("prorsa."):
                    assert n.startswith("prorsa.policy"), f"{f.name} imports {n}"


def _prorsa_imports(package: str) -> set[str]:
    """The prorsa subpackages a package (or one module, `name.py`) imports."""
    root = POLICY.parent / package
    found: set[str] = set()
    for f in [root] if root.is_file() else sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("prorsa.")
            ):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("prorsa.")}
    return found


def test_imports_follow_the_data_flow() -> None:
    """control sees only policy and events; events sees only policy; adapters never import
    the CLI or the operator's Kubernetes handlers. `prorsa.cancellation`, which imports
    nothing of prorsa, is the one module every layer may use."""
    assert _prorsa_imports("cancellation.py") == set()
    assert _prorsa_imports("control") <= {"control", "policy", "events", "cancellation"}
    assert _prorsa_imports("events") <= {"events", "policy", "cancellation"}
    for adapter in ("router", "worker", "local"):
        assert "cli" not in _prorsa_imports(adapter)
    for serving in ("router", "worker"):  # the local runner may borrow the sim's workloads
        assert "sim" not in _prorsa_imports(serving)
