"""First-principles cost model of one GPU worker running vLLM.

Prefill is compute-bound: its time is FLOPs (weights GEMMs plus attention over the context)
over achievable FLOP/s. Decode is memory-bound: each step reads the weights once plus every
running sequence's KV cache. A colocated worker runs vLLM's chunked prefill: a step that holds
a prefill chunk is as slow as the chunk, and every decode in the batch waits for it.

The GPU and model tables are in `hardware`; the achievable fractions below, each with its
source. Engine units of several GPUs with expert parallelism are `lockstep`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from prorsa.policy.capacity import PREFILL_QUOTED_TOKENS, RoleCapacity, quoted_prefill_rate
from prorsa.sim.hardware import Hardware, ModelSpec


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achievable fractions and fixed overheads (published measurements, rounded)."""

    # Prefill model-FLOPs utilisation: 40-60% measured for 8B-70B prefill on H100 in the
    # DistServe and Splitwise papers; we take the middle.
    mfu: float = 0.5
    # Achievable HBM bandwidth: ~80-90% of peak in STREAM-like and decode kernels.
    bw_eff: float = 0.85
    # Per-step scheduling, sampling and launch overhead with CUDA graphs (vLLM V1 ~1-3 ms).
    step_overhead_s: float = 0.002
    per_seq_overhead_s: float = 20e-6
    # Per prefill request: tokenisation, scheduling, first-token sampling.
    prefill_overhead_s: float = 0.005
    # KV transfer: RDMA efficiency and per-transfer setup (NIXL descriptor exchange).
    link_eff: float = 0.8
    transfer_setup_s: float = 0.002
    # vLLM default max_num_batched_tokens for the OpenAI server on >=70 GiB GPUs (V1).
    chunk_tokens: int = 8192
    # Fraction of HBM vLLM may use (gpu_memory_utilization default) and activation reserve.
    gpu_mem_util: float = 0.9
    activation_reserve_bytes: float = 4e9


class OneGPUWorker:
    """What a worker of one GPU answers to the unit questions of `Cost`: one engine, one
    rank, and a colocated step that fills the token budget its decodes leave."""

    __slots__ = ()
    eff: Efficiency

    @property
    def gpus_per_worker(self) -> int:
        return 1

    @property
    def dp_ranks(self) -> int:
        return 1

    def mixed_chunk_tokens(self, batch: float, queued: float, jobs: int) -> float:
        return max(min(self.eff.chunk_tokens - batch, queued), 16.0)


@dataclass(frozen=True, slots=True)
class CostModel(OneGPUWorker):
    hw: Hardware
    model: ModelSpec
    eff: Efficiency = Efficiency()
    switch_mode: str = "routing"  # routing: drain only; restart: drain + engine restart

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> float:
        free = self.hw.hbm_bytes * self.eff.gpu_mem_util - self.model.weight_bytes
        free -= self.eff.activation_reserve_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on one {self.hw.name}")
        return free / self.model.kv_bytes_per_token

    @property
    def restart_s(self) -> float:
        return self.model.restart_s if self.switch_mode == "restart" else 0.0

    # ---- prefill ---------------------------------------------------------------------------

    def prefill_flops(self, new_tokens: float, context: float) -> float:
        """GEMMs (2 FLOPs per active parameter per token) + causal attention over context."""
        m = self.model
        gemm = 2.0 * m.active_params * new_tokens
        attn = 4.0 * m.layers * m.q_dim * new_tokens * (context + new_tokens / 2.0)
        return gemm + attn

    def prefill_s(self, new_tokens: float, context: float) -> float:
        if new_tokens <= 0:
            return self.eff.prefill_overhead_s
        compute = self.prefill_flops(new_tokens, context) / (self.hw.peak_flops * self.eff.mfu)
        return max(compute, self._weights_read_s()) + self.eff.prefill_overhead_s

    # ---- decode ----------------------------------------------------------------------------

    def _weights_read_s(self, batch: float = 1.0) -> float:
        m = self.model
        if m.experts:
            touched: float = 1.0 - (1.0 - m.top_k / m.experts) ** max(batch, 1.0)
            expert_bytes = (m.total_params - m.active_params) * 2.0
            dense_bytes = m.active_params * 2.0
            nbytes = dense_bytes + expert_bytes * touched
        else:
            nbytes = m.weight_bytes
        return nbytes / (self.hw.hbm_bw * self.eff.bw_eff)

    def _gemm_s(self, tokens: float) -> float:
        """Linear layers for `tokens` tokens: weights read once vs FLOPs, whichever binds."""
        compute = 2.0 * self.model.active_params * tokens / (self.hw.peak_flops * self.eff.mfu)
        return max(self._weights_read_s(tokens), compute)

    def _attention_prefill_s(self, chunk: float, context: float) -> float:
        m = self.model
        flops = 4.0 * m.layers * m.q_dim * chunk * (context + chunk / 2.0)
        return flops / (self.hw.peak_flops * self.eff.mfu)

    def _attention_decode_s(self, kv_tokens: float) -> float:
        return kv_tokens * self.model.kv_bytes_per_token / (self.hw.hbm_bw * self.eff.bw_eff)

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        """One decode step: linear layers (weights read) + attention reading every KV."""
        if batch <= 0:
            return 0.0
        return (
            self._gemm_s(batch)
            + self._attention_decode_s(kv_tokens)
            + self.eff.step_overhead_s
            + self.eff.per_seq_overhead_s * batch
        )

    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float:
        """A chunked-prefill step: `chunk` prefill tokens ride along with `batch` decodes.

        The linear layers of both share one weight read, but attention runs as separate
        kernels (compute-bound for the chunk, memory-bound for the decodes), so their times
        add: a decode step that carries a chunk is slower by the chunk's GEMMs and attention.
        """
        return (
            self._gemm_s(batch + chunk)
            + self._attention_prefill_s(chunk, chunk_ctx)
            + self._attention_decode_s(kv_tokens)
            + self.eff.step_overhead_s
            + self.eff.per_seq_overhead_s * batch
        )

    # ---- KV transfer -----------------------------------------------------------------------

    def kv_transfer_s(self, tokens: float) -> float:
        nbytes = tokens * self.model.kv_bytes_per_token
        return self.eff.transfer_setup_s + nbytes / (self.hw.link_bw * self.eff.link_eff)

    # ---- what the allocator needs ----------------------------------------------------------

    def role_capacity(
        self, typical_context: float = 8192.0, typical_new: float = PREFILL_QUOTED_TOKENS
    ) -> RoleCapacity:
        """The allocator's linearised view of this cost model."""
        per_req = self.prefill_s(typical_new, typical_context)
        bw = self.hw.hbm_bw * self.eff.bw_eff
        return RoleCapacity(
            prefill_tokens_per_s=typical_new / per_req,
            decode_base_step_s=self._weights_read_s(8.0) + self.eff.step_overhead_s,
            decode_s_per_seq=self.eff.per_seq_overhead_s,
            decode_s_per_kv_token=self.model.kv_bytes_per_token / bw,
            kv_capacity_tokens=self.kv_capacity_tokens,
            switch_s=self.restart_s,
        )


def lognormal_sigma(median: float, p99: float) -> float:
    """Log-space std of a log-normal with the given median and 99th percentile."""
    return math.log(p99 / median) / 2.3263478740408408


class Cost(Protocol):
    """What the simulator asks of a cost model (`CostModel` or `MeasuredCost`)."""

    @property
    def eff(self) -> Efficiency: ...
    @property
    def switch_mode(self) -> str: ...
    @property
    def kv_capacity_tokens(self) -> float: ...
    @property
    def restart_s(self) -> float: ...
    @property
    def gpus_per_worker(self) -> int: ...  # an engine unit's GPUs (one simulated worker)
    @property
    def dp_ranks(self) -> int: ...  # prefills a worker runs at once (DP attention ranks)
    def prefill_s(self, new_tokens: float, context: float) -> float: ...
    def decode_step_s(self, batch: float, kv_tokens: float) -> float: ...
    def mixed_chunk_tokens(self, batch: float, queued: float, jobs: int) -> float: ...
    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float: ...
    def kv_transfer_s(self, tokens: float) -> float: ...
    def role_capacity(self) -> RoleCapacity: ...


@dataclass(frozen=True, slots=True)
class MeasuredCost(OneGPUWorker):
    """A cost model fitted to a real worker instead of derived from a datasheet: prefill is a
    fixed cost plus tokens over a measured throughput, a decode step a measured base plus a
    per-sequence cost and a cost per KV token it attends, a chunked-prefill step the two
    added. Built from an offline calibration or from what the controller learned online
    (`from_capacity`), to check the simulator against real vLLM workers
    (`benchmarks/sim_vs_real.py`)."""

    prefill_tokens_per_s: float
    prefill_fixed_s: float
    decode_base_s: float
    decode_per_seq_s: float
    kv_capacity: float
    decode_per_kv_s: float = 0.0
    # seconds each new token adds per cached token it attends (0: not measured)
    prefill_per_token_per_context_s: float = 0.0
    transfer_s: float = 0.005  # one NIXL pull between workers on one host
    switch_mode: str = "routing"
    eff: Efficiency = Efficiency(chunk_tokens=2048)

    @classmethod
    def from_capacity(cls, cap: RoleCapacity) -> MeasuredCost:
        """The cost a `RoleCapacity` prices (a calibration's, or what the controller learned
        online): its fixed cost per prefill request, its marginal rate at no context, its
        context term and its decode step, as `role_capacity()` gives them back."""
        fixed = cap.prefill_s(0.0, 0.0)
        per_token = cap.prefill_s(1.0, 0.0) - fixed  # at no context: the marginal rate
        return cls(
            prefill_tokens_per_s=1.0 / max(per_token, 1e-12),
            prefill_fixed_s=fixed,
            decode_base_s=cap.decode_base_step_s,
            decode_per_seq_s=cap.decode_s_per_seq,
            kv_capacity=cap.kv_capacity_tokens,
            decode_per_kv_s=cap.decode_s_per_kv_token,
            prefill_per_token_per_context_s=cap.prefill_s_per_token_per_context,
        )

    @property
    def kv_capacity_tokens(self) -> float:
        return self.kv_capacity

    @property
    def restart_s(self) -> float:
        return 0.0

    def _prefill_tokens_s(self, tokens: float, context: float) -> float:
        per_token = 1.0 / self.prefill_tokens_per_s
        return max(tokens, 0.0) * (per_token + self.prefill_per_token_per_context_s * context)

    def prefill_s(self, new_tokens: float, context: float) -> float:
        return self.prefill_fixed_s + self._prefill_tokens_s(new_tokens, context)

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_kv_s * kv_tokens

    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float:
        base = self.decode_step_s(batch, kv_tokens) if batch > 0 else self.prefill_fixed_s
        return base + self._prefill_tokens_s(chunk, chunk_ctx)

    def kv_transfer_s(self, tokens: float) -> float:
        return self.transfer_s

    def role_capacity(self) -> RoleCapacity:
        return RoleCapacity(
            prefill_tokens_per_s=quoted_prefill_rate(
                self.prefill_fixed_s, self.prefill_tokens_per_s
            ),
            prefill_request_s=self.prefill_fixed_s,
            decode_base_step_s=self.decode_base_s,
            decode_s_per_seq=self.decode_per_seq_s,
            decode_s_per_kv_token=self.decode_per_kv_s,
            kv_capacity_tokens=self.kv_capacity,
            prefill_s_per_token_per_context=self.prefill_per_token_per_context_s,
            prefill_context=0.0,  # the quoted rate is the one at no context
        )


@dataclass(frozen=True, slots=True)
class ScaledCost:
    """A cluster that is not what its datasheet says: `base` with prefill `prefill_speed`
    times as fast and every decode step `decode_slowdown` times as long. The what-if for a
    capacity the allocator must learn online (other GPUs, engine flags, a slower model)."""

    base: Cost
    prefill_speed: float = 1.0
    decode_slowdown: float = 1.0

    @property
    def eff(self) -> Efficiency:
        return self.base.eff

    @property
    def model(self) -> object:  # what an engine restart loads (expert-parallel units)
        return getattr(self.base, "model", None)

    @property
    def switch_mode(self) -> str:
        return self.base.switch_mode

    @property
    def kv_capacity_tokens(self) -> float:
        return self.base.kv_capacity_tokens

    @property
    def restart_s(self) -> float:
        return self.base.restart_s

    @property
    def gpus_per_worker(self) -> int:
        return self.base.gpus_per_worker

    @property
    def dp_ranks(self) -> int:
        return self.base.dp_ranks

    def prefill_s(self, new_tokens: float, context: float) -> float:
        return self.base.prefill_s(new_tokens, context) / self.prefill_speed

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        return self.base.decode_step_s(batch, kv_tokens) * self.decode_slowdown

    def mixed_chunk_tokens(self, batch: float, queued: float, jobs: int) -> float:
        return self.base.mixed_chunk_tokens(batch, queued, jobs)

    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float:
        decode = self.base.decode_step_s(batch, kv_tokens)
        mixed = self.base.mixed_step_s(batch, kv_tokens, chunk, chunk_ctx, jobs)
        return decode * self.decode_slowdown + max(mixed - decode, 0.0) / self.prefill_speed

    def kv_transfer_s(self, tokens: float) -> float:
        return self.base.kv_transfer_s(tokens)

    def role_capacity(self) -> RoleCapacity:
        c, s, d = self.base.role_capacity(), self.prefill_speed, self.decode_slowdown
        return replace(
            c,
            prefill_tokens_per_s=c.prefill_tokens_per_s * s,
            prefill_s_per_token_per_context=c.prefill_s_per_token_per_context / s,
            prefill_request_s=c.prefill_request_s / s,
            local_prefill_tokens_per_s=c.local_prefill_tokens_per_s * s,
            local_prefill_rank_tokens_per_s=c.local_prefill_rank_tokens_per_s * s,
            local_prefill_rank_s_per_token_per_context=c.local_prefill_rank_s_per_token_per_context
            / s,
            local_prefill_step_s=c.local_prefill_step_s * d,
            decode_base_step_s=c.decode_base_step_s * d,
            decode_s_per_seq=c.decode_s_per_seq * d,
            decode_s_per_kv_token=c.decode_s_per_kv_token * d,
        )
