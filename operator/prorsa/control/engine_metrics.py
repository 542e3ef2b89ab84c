"""What a vLLM engine's `/metrics` tells about its capacity, turned into evidence for the
capacity estimator (`policy/learn.py`).

Every decision the controller reads each worker's Prometheus text; between two reads of one
worker the counters' differences give:

- prefill (workers in the prefill or mixed role): requests prefilled, the tokens they
  computed (`vllm:request_prefill_kv_computed_tokens`, cached tokens excluded), their context
  (`vllm:request_prompt_tokens` minus those) and the seconds they took
  (`vllm:request_prefill_time_seconds`). Prefills batched into one engine step each report
  the whole step, so the summed prefill time counts a step once per request in it: it is
  divided by the requests per step (prefill tokens per step, `vllm:iteration_tokens_total`
  less the decode tokens, over the tokens per request; at least 1) and capped at the window
  before it is shared out per request;
- decode steps (decode or mixed role): the mean step (`vllm:inter_token_latency_seconds`:
  every sequence of a step reports the step once), at the mean batch — those reports over the
  engine's steps (`vllm:iteration_tokens_total`'s count; the running gauge when absent) —
  and the KV in use (`vllm:kv_cache_usage_perc` of the cache). Prefills the worker ran
  itself (appends to contexts it holds) lengthen the steps they rode in; the allocator prices
  them apart (`RoleCapacity.local_prefill_*`), so the window also says how many such tokens
  its steps carried, and the estimator learns what they cost there beside the step itself.
  vLLM counts the prompt tokens whose KV came from a prefill worker (NIXL) as computed too;
  those (`vllm:external_prefix_cache_hits`) are not the worker's own prefill: receiving them
  is part of its steps;
- KV capacity: `vllm:cache_config_info`'s blocks x block size.

A counter that went down (the engine restarted) discards that window. Data-parallel engines
report one series per engine (label `engine`); a worker's series are summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from prorsa.policy.allocate import Role
from prorsa.policy.learn import CapacityEstimator

_HISTOGRAMS = {
    "vllm:request_prefill_time_seconds": "prefill_s",
    "vllm:request_prefill_kv_computed_tokens": "computed",
    "vllm:request_prompt_tokens": "prompt",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:iteration_tokens_total": "step_tokens",
}


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One read of an engine's metrics: histogram sums and counts, gauges, cache size."""

    t: float
    sums: dict[str, float]
    counts: dict[str, float]
    running: float = 0.0
    kv_usage: float = 0.0  # fraction of the KV cache in use
    kv_capacity_tokens: float = 0.0  # 0: not reported
    received_tokens: float = 0.0  # prompt tokens whose KV another engine computed (counter)

    @property
    def kv_tokens(self) -> float:
        return self.kv_usage * self.kv_capacity_tokens


def parse_engine_metrics(text: str, t: float) -> EngineSample | None:
    """The sample in `text` (Prometheus exposition), or None when it holds no vLLM metrics
    or cannot be parsed."""
    sums = dict.fromkeys(_HISTOGRAMS.values(), 0.0)
    counts = dict.fromkeys(_HISTOGRAMS.values(), 0.0)
    running = usage = capacity = received = 0.0
    usage_series = 0
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        return None
    for fam in families:
        name = fam.name
        key = _HISTOGRAMS.get(name)
        for s in fam.samples:
            if key is not None:
                if s.name == f"{name}_sum":
                    sums[key] += s.value
                    seen = True
                elif s.name == f"{name}_count":
                    counts[key] += s.value
            elif name == "vllm:num_requests_running":
                running += s.value
                seen = True
            elif name == "vllm:external_prefix_cache_hits" and s.name.endswith("_total"):
                received += s.value
            elif name == "vllm:kv_cache_usage_perc":
                usage += s.value
                usage_series += 1
            elif name == "vllm:cache_config_info":
                blocks = _number(s.labels.get("num_gpu_blocks"))
                size = _number(s.labels.get("block_size"))
                capacity += blocks * size
    if not seen:
        return None
    return EngineSample(t, sums, counts, running, usage / max(usage_series, 1), capacity, received)


def _number(value: str | None) -> float:
    try:
        x = float(value) if value not in (None, "", "None") else 0.0
    except ValueError:
        return 0.0
    return x if math.isfinite(x) and x > 0 else 0.0


class EngineEvidence:
    """Feeds an estimator from successive samples of each worker's engine."""

    def __init__(self, estimator: CapacityEstimator) -> None:
        self.estimator = estimator
        self._last: dict[str, EngineSample] = {}

    @property
    def workers(self) -> list[str]:
        return list(self._last)

    def forget(self, worker: str) -> None:
        self._last.pop(worker, None)
        self.estimator.forget_worker(worker)

    def feed(self, worker: str, role: Role, sample: EngineSample) -> None:
        est, now = self.estimator, sample.t
        if role is not Role.PREFILL and sample.kv_capacity_tokens > 0:
            est.observe_kv_capacity(worker, sample.kv_capacity_tokens)
        prev, self._last[worker] = self._last.get(worker), sample
        if prev is None or sample.t <= prev.t:
            return
        d_sum = {k: sample.sums[k] - prev.sums[k] for k in sample.sums}
        d_cnt = {k: sample.counts[k] - prev.counts[k] for k in sample.counts}
        if any(v < 0 for v in (*d_sum.values(), *d_cnt.values())):
            return  # the engine restarted: its counters began again
        window = sample.t - prev.t
        n = d_cnt["prefill_s"]
        local = local_prefill_tokens(prev, sample)
        if role is not Role.DECODE and n > 0 and d_cnt["computed"] > 0:
            new = local / d_cnt["computed"]
            prompt = d_sum["prompt"] / d_cnt["prompt"] if d_cnt["prompt"] > 0 else new
            per_step = 1.0
            if d_cnt["step_tokens"] > 0 and new > 0:
                prefill_tokens = max(d_sum["step_tokens"] - d_cnt["itl"], 0.0)
                per_step = max(1.0, prefill_tokens / d_cnt["step_tokens"] / new)
            seconds = min(d_sum["prefill_s"] / per_step, window) / n
            if new >= 1:
                est.observe_prefill(new, max(prompt - new, 0.0), seconds, now, requests=n)
        if role is not Role.PREFILL:
            w = decode_window(prev, sample)
            if w is not None:
                est.observe_decode_step(w.batch, w.kv_tokens, w.step_s, now, steps=w.steps,
                                        local_tokens=w.local_tokens)  # fmt: skip


def local_prefill_tokens(prev: EngineSample, sample: EngineSample) -> float:
    """Prompt tokens the engine computed itself between two reads: vLLM's computed tokens
    less those whose KV it received from a prefill worker."""
    computed = sample.sums["computed"] - prev.sums["computed"]
    received = sample.received_tokens - prev.received_tokens
    return max(computed - max(received, 0.0), 0.0)


class DecodeWindow(NamedTuple):
    """An engine's decode steps between two reads: their mean, at the mean batch and KV."""

    batch: float
    kv_tokens: float
    step_s: float
    steps: float
    local_tokens: float  # per step: prefill tokens the engine computed itself


def decode_window(prev: EngineSample, sample: EngineSample,
                  local_prefill_rate: float = math.inf) -> DecodeWindow | None:  # fmt: skip
    """The decode steps between two reads of one engine (None: no token was generated, or
    the counters went back); with `local_prefill_rate`, the prefill tokens the engine
    computed itself taken out of the mean step at that rate (tokens/s)."""
    d_sum = {k: sample.sums[k] - prev.sums[k] for k in sample.sums}
    d_cnt = {k: sample.counts[k] - prev.counts[k] for k in sample.counts}
    if d_cnt["itl"] <= 0 or any(v < 0 for v in (*d_sum.values(), *d_cnt.values())):
        return None
    if d_cnt["step_tokens"] > 0:
        batch = d_cnt["itl"] / d_cnt["step_tokens"]
        steps = d_cnt["step_tokens"]
    else:
        batch = (prev.running + sample.running) / 2
        steps = d_cnt["itl"] / batch if batch > 0 else 0.0
    if batch <= 0:
        return None
    # every sequence of a step waited for the prefill tokens it carried
    local = local_prefill_tokens(prev, sample)
    local_prefill_s = local / local_prefill_rate if local and local_prefill_rate > 0 else 0.0
    itl = d_sum["itl"] - batch * local_prefill_s
    step = max(itl, 0.5 * d_sum["itl"]) / d_cnt["itl"]  # steps stay mostly decode
    kv = (prev.kv_tokens + sample.kv_tokens) / 2
    return DecodeWindow(batch, kv, step, steps, local / steps if steps > 0 else 0.0)
