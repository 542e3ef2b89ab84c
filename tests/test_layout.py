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
