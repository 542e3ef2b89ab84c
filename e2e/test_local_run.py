"""`prorsa local` on real vLLM workers, as a user runs it (prefix caching on): a rollout
recorded turn by turn and drawn like a simulated one, and the capacity the controller learns
online from the workers' own metrics set against an offline calibration of the same engines."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from redis.asyncio import Redis
from rich.console import Console

from prorsa.control.controller import capacity_text
from prorsa.events.keys import ClusterKeys
from prorsa.local.calibrate import agreement, calibrate
from prorsa.local.redis_server import RedisServer
from prorsa.local.runner import LocalOptions, run_document, run_policy
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.plot import load_run, plot_run
from prorsa.policy.allocate import Role
from prorsa.sim.presets import AUTO_PRIOR, preset

KEYS = ClusterKeys("e2e", "local")


@pytest.fixture(scope="module")
def local_stack(workdir: Path, tiny_model: Path, redis_server: RedisServer) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=tiny_model,
        workdir=workdir / "local",
        redis_url=redis_server.url,
        roles=[Role.PREFILL, Role.DECODE],
        keys=KEYS,
    )
    with LocalStack(cfg) as s:
        yield s


def test_a_local_run_is_recorded_drawn_and_learns_the_workers_capacity(
    local_stack: LocalStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One prefill and one decode worker, `--capacity auto` (the H200 datasheet as the prior):
    every turn timed; each decision recorded with roles, forecast and capacity; the same
    picture as the simulator's; and after one rollout the capacity learned from the engines'
    `/metrics` agrees with the offline calibration where the rollout measured it (the size of
    the prefills the pool served, the batch the decode worker ran) and has moved off the prior
    (the H200 datasheet lies near this CPU by chance on some figures: how near depends on the
    machine's speed, so the test asks that the evidence moved the estimate, not that the prior
    was far); the decision log shows the learned figures. The calibration is set beside what
    the engine itself timed of its requests (the instrument the controller learns with; the
    client's wall time adds the HTTP round trip, ~10 ms per request here) and runs on an idle
    machine; in the rollout the router, the agent loops, the controller and the vLLM frontends
    share the two cores with the engines (the test prints their share) and the decode engine
    receives KV over NIXL on its core. On this machine four runs learned -2%, -7%, -4% and
    +31% (prefill) and +12%, +24%, +18% and +17% (decode step) of the engine's calibration,
    with the rest of the stack at 9%, 12%, 10% and 9% of the CPU: at what that left the
    engines, the decode step is +1%, +9%, +6% and +6%. Against the wall clock, as before,
    prefill came out -29% to -47% and on a slower CI machine one decode step +56%.
    The bound here is therefore a factor of two either way: a guard against learning the
    wrong thing (a step per token instead of per step, a batch's prefill counted once per
    request: errors of the batch size, or of the prior's 7x on prefill), not the 20% target,
    which the README reports run by run."""
    stack = local_stack

    async def main() -> None:
        cal = await calibrate(stack.workers[0].url, SERVED_MODEL, stack.cfg.model,
                              stack.cfg.kv_cache_gib)  # fmt: skip
        assert cal.engine is not None, "the engine's own timings of the calibration requests"
        opts = LocalOptions(
            workload="swe", trajectories=24, live=False, capacity_model="auto", mode="async"
        )  # first prompts all along: prefill evidence
        opts.settings = replace(opts.settings, static_prefill=1)
        redis = Redis.from_url(stack.cfg.redis_url)
        try:
            with caplog.at_level(logging.INFO, logger="prorsa.control.controller"):
                run = await run_policy(opts, stack, redis, cal, "static", Console(quiet=True))
        finally:
            await redis.aclose()
        share = run.stack_cpu_share
        assert share > 0  # the router, agent loop and controller ran beside the engines
        doc = run_document(opts, [run], cal, "tiny")
        row = doc["results"]["static"]
        assert doc["source"] == "real" and row["turns_failed"] == 0
        assert len(row["turns"]) == row["turns_ok"] > 24  # swe: several turns each
        assert all(t["ok"] and t["seconds"] > 0 and t["output_tokens"] > 0 for t in row["turns"])
        done = row["completions_s"]
        assert len(done) == 24 and done == sorted(done)
        assert max(done) <= row["makespan_s"] + 1e-6
        tl = row["timeline"]
        assert len(tl) >= 3 and all((p["prefill"], p["decode"]) == (1, 1) for p in tl)
        assert [p["t"] for p in tl] == sorted(p["t"] for p in tl)
        assert sum(p["actual_prefill_tps"] for p in tl) > 0  # the table saw the turns
        path = tmp_path / "local.json"
        path.write_text(json.dumps(doc))
        png = plot_run(load_run(path), tmp_path / "local.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        assert run.capacity is not None and run.evidence is not None
        ev = run.evidence
        at = (ev["prefill_tokens_seen"], 0.0, ev["decode_batch_seen"], ev["decode_kv_seen"])
        learned = agreement(cal, run.capacity, *at)
        prior = agreement(cal, preset(AUTO_PRIOR).role_capacity(), *at)
        far = agreement(cal, run.capacity)  # 1,024 tokens, batch 8: beyond the evidence
        shared = (1 + learned["decode_step_s"]) * (1 - share) - 1  # at the CPU left to them
        print(f"learned {capacity_text(run.capacity)}; evidence {ev}; against the calibration "
              f"where measured {learned} (the prior: {prior}); at 1,024 tokens and batch 8 "
              f"{far}; the rest of the stack took {share:.0%} of the cores (decode step at "
              f"the CPU that left the engines: {shared:+.1%})")  # fmt: skip
        assert ev["prefill_samples"] > 0 and ev["decode_samples"] >= 3 and ev["kv_workers"] == 1
        assert all(0.5 <= 1 + v <= 2.0 for v in learned.values()), learned
        moved = {k: learned[k] - prior[k] for k in learned}  # the evidence, not the prior
        assert any(abs(v) > 0.1 for v in moved.values()), (learned, prior)
        assert row["capacity"]["kv_capacity_tokens"] == pytest.approx(cal.kv_capacity_tokens, 0.2)
        logged = [r.getMessage() for r in caplog.records if "capacity prefill" in r.getMessage()]
        assert logged, "the decision log shows the learned figures"

    asyncio.run(main())
