"""Cost model of one engine unit of G GPUs: data-parallel attention plus expert parallelism.

The regime large MoE models are served in (DeepSeek, SGLang and vLLM wide-EP): each of the G
ranks runs attention and the dense layers for its own requests; routed experts are spread over
the ranks and every MoE layer dispatches tokens to their experts and combines the results
(all-to-all). The ranks step in lockstep, so:

- the unit's step is the slowest rank's, paid by every rank (an idle rank runs a dummy pass);
- a step in which any rank prefills runs without CUDA graphs, without two-batch overlap and
  with DeepEP's normal (bandwidth) kernels instead of its low-latency ones;
- one prefill chunk on one rank therefore stalls the decodes of all G ranks.

The simulator sees a unit as one worker: batch and KV are the unit's, spread evenly over its
ranks (the DP scheduler balances requests); a prefill job runs on one rank and up to G jobs run
at once. With G = 1 and no experts this is not used: `CostModel` is the one-GPU model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prorsa.policy.capacity import PREFILL_QUOTED_TOKENS, RoleCapacity
from prorsa.sim.costmodel import Efficiency
from prorsa.sim.hardware import Hardware, ModelSpec, interp, low_latency_a2a_s, normal_a2a_bw

_ONE_GPU = Efficiency()  # the shared constants, defined (with sources) in one place


@dataclass(frozen=True, slots=True)
class EPEfficiency:
    """Achievable fractions of the kernels an EP unit runs, each from its published figure."""

    # FP8 GEMMs end to end, fitted to one published row: SGLang's prefill of DeepSeek-V3 on
    # 96 H100 (EP32, 1K prompts, 57,674 input tok/s per node; `benchmarks/calibration.py`
    # checks the other rows against it). 0.30 of the FP8 peak is well under DeepGEMM's kernel
    # figure (1,350+ TFLOPS, 0.68): activation quantisation, routing, norms and the SMs the
    # all-to-all kernels occupy are not modelled separately, and this fraction carries them.
    gemm_eff: float = 0.30
    # Prefill attention: FlashAttention-3 reaches 740 of 989 BF16 TFLOPS on H100 (75%).
    prefill_attn_eff: float = 740.0 / 989.0
    # Decode attention (FlashMLA, H800): 3,000 of 3,350 GB/s memory-bound, 580 of 989 TFLOPS
    # compute-bound.
    decode_attn_bw_eff: float = 3000.0 / 3350.0
    decode_attn_flops_eff: float = 580.0 / 989.0
    # Weight reads outside attention, per step with CUDA graphs and per sequence: the one-GPU
    # model's figures (`Efficiency`, with their sources).
    bw_eff: float = _ONE_GPU.bw_eff
    graph_step_s: float = _ONE_GPU.step_overhead_s
    per_seq_s: float = _ONE_GPU.per_seq_overhead_s
    # Without CUDA graphs every kernel is launched from the host. Derived: ~20 kernels per
    # layer (norms, projections, RoPE, attention, gate, top-k, dispatch, two grouped GEMMs,
    # activation, combine, shared expert, residuals) at ~5 us launch latency each.
    eager_launch_s_per_layer: float = 20 * 5e-6
    # Two-batch overlap on all-decode steps, net gain by tokens per rank (SGLang large-scale EP
    # blog: -27% at 32, break-even at 64-128, +25.5% at 256). Engines enable it where it helps,
    # so the gain used is max(1, interpolated).
    tbo_tokens: tuple[float, ...] = (32.0, 96.0, 256.0)
    tbo_gain: tuple[float, ...] = (0.73, 1.0, 1.255)
    # Tokens a rank computes per step. Prefill units: DeepSeek's profile runs 16K tokens per
    # GPU. Colocated units: vLLM's max_num_batched_tokens (the one-GPU model's) per DP rank.
    prefill_rank_tokens: int = 16384
    mixed_rank_tokens: int = _ONE_GPU.chunk_tokens
    # Memory fractions, KV transfer and per-request overhead: as the one-GPU model.
    gpu_mem_util: float = _ONE_GPU.gpu_mem_util
    activation_reserve_bytes: float = _ONE_GPU.activation_reserve_bytes
    link_eff: float = _ONE_GPU.link_eff
    transfer_setup_s: float = _ONE_GPU.transfer_setup_s
    prefill_overhead_s: float = _ONE_GPU.prefill_overhead_s


def _tbo(e: EPEfficiency, tokens_per_rank: float) -> float:
    return max(1.0, interp(e.tbo_tokens, e.tbo_gain, tokens_per_rank))


@dataclass(frozen=True, slots=True)
class _Rates:
    """Per-unit constants of the step model, derived once from the tables (the simulator
    asks for ~10^5 steps per run)."""

    attn_decode_s_per_kv: float  # memory- or compute-bound, whichever binds (both linear)
    attn_prefill_s_per_pair: float
    dense_read_s: float
    dense_s_per_token: float
    local_experts: float
    expert_read_s: float  # every local expert of every MoE layer read once
    expert_s_per_pair: float
    # Expert imbalance: max over mean of the token-expert pairs a rank computes in a step.
    # With EPLB's placement balancing the experts' average load, what is left is the sampling
    # noise of one batch (a multinomial over ranks; the max of G ~ mean + sqrt(2 ln G)
    # standard deviations). Derived; the Waterfill/LPLB blog (lmsys, 2026) names this
    # residual per-batch imbalance.
    imbalance_z: float  # sqrt(2 ln G)
    ll_a2a_s_per_token: float
    normal_a2a_s_per_token: float
    eager_s: float


def _rates(hw: Hardware, m: ModelSpec, g: int, e: EPEfficiency) -> _Rates:
    fp8 = (hw.peak_fp8_flops or hw.peak_flops) * e.gemm_eff
    bw = hw.hbm_bw * e.bw_eff
    wbytes = m.weight_bytes_per_param
    normal = 0.0
    if g > 1:
        # FP8 dispatch (1 byte) and BF16 combine (2 bytes) of each token, once per peer that
        # holds one of its experts: across nodes DeepEP sends once per node over RDMA and
        # forwards over NVLink (its bandwidth figures count those RDMA bytes).
        per_node = hw.gpus_per_node
        peers = g if g <= per_node else min(g // per_node, m.max_nodes_per_token)
        hit = peers * (1.0 - (1.0 - 1.0 / peers) ** m.top_k)
        remote = hit * (peers - 1) / peers
        normal = m.moe_layers * remote * m.hidden * 3.0 / normal_a2a_bw(hw, g)
    return _Rates(
        attn_decode_s_per_kv=max(
            m.kv_bytes_per_token / (hw.hbm_bw * e.decode_attn_bw_eff),
            m.attn_flops_decode / (hw.peak_flops * e.decode_attn_flops_eff),
        ),
        attn_prefill_s_per_pair=m.attn_flops_prefill / (hw.peak_flops * e.prefill_attn_eff),
        dense_read_s=m.dense_params * wbytes / bw,
        dense_s_per_token=2.0 * m.dense_params / fp8,
        local_experts=m.experts / g,
        expert_read_s=(m.experts / g) * m.expert_params * m.moe_layers * wbytes / bw,
        expert_s_per_pair=2.0 * m.expert_params * m.moe_layers / fp8,
        imbalance_z=math.sqrt(2.0 * math.log(g)) if g > 1 else 0.0,
        ll_a2a_s_per_token=m.moe_layers * low_latency_a2a_s(g, 1.0, m.hidden) if g > 1 else 0.0,
        normal_a2a_s_per_token=normal,
        eager_s=e.eager_launch_s_per_layer * m.layers,
    )


@dataclass(frozen=True, slots=True)
class LockstepCost:
    """One engine unit of `gpus` GPUs (DP attention = EP = gpus) of `hw` serving `model`."""

    hw: Hardware
    model: ModelSpec
    gpus: int
    ep: EPEfficiency = EPEfficiency()
    switch_mode: str = "routing"
    _k: _Rates = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_k", _rates(self.hw, self.model, self.gpus, self.ep))

    # ---- what the simulator asks (the `Cost` protocol) --------------------------------------

    @property
    def eff(self) -> Efficiency:
        """The engine reads the unit's per-step token budget from here."""
        return Efficiency(chunk_tokens=self.gpus * self.ep.mixed_rank_tokens)

    @property
    def gpus_per_worker(self) -> int:
        return self.gpus

    @property
    def dp_ranks(self) -> int:
        return self.gpus

    @property
    def kv_capacity_tokens(self) -> float:
        m = self.model
        per_gpu = self.hw.hbm_bytes * self.ep.gpu_mem_util - self.ep.activation_reserve_bytes
        per_gpu -= (m.dense_params + m.routed_params / self.gpus) * m.weight_bytes_per_param
        if per_gpu <= 0:
            raise ValueError(f"{m.name} does not fit on {self.gpus} x {self.hw.name}")
        return self.gpus * per_gpu / m.kv_bytes_per_token

    @property
    def restart_s(self) -> float:
        return self.model.restart_s if self.switch_mode == "restart" else 0.0

    def prefill_s(self, new_tokens: float, context: float) -> float:
        """Seconds of the unit's time a prefill takes when its ranks are all prefilling (up to
        G jobs at once, one rank each; a rank batches short prompts up to its token budget):
        the rank's share of its steps for this job, over G."""
        if new_tokens <= 0:
            return self.ep.prefill_overhead_s
        c = float(self.ep.prefill_rank_tokens)
        if new_tokens <= c:  # n such prompts share one step
            n = max(1.0, math.floor(c / new_tokens))
            rank_s = self.prefill_step_s(new_tokens, context, self.gpus, prompts=n) / n
        else:  # chunked: successive steps attend to what the earlier chunks computed
            steps = math.ceil(new_tokens / c)
            per = new_tokens / steps
            rank_s = sum(
                self.prefill_step_s(per, context + i * per, self.gpus) for i in range(steps)
            )
        return (rank_s + self.ep.prefill_overhead_s) / self.gpus

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self.step_s(batch / self.gpus, kv_tokens / self.gpus, 0.0, 0.0, 0)

    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float:
        ranks = max(1, min(self.gpus, jobs))
        return self.step_s(
            batch / self.gpus, kv_tokens / self.gpus, chunk / ranks, chunk_ctx, ranks
        )

    def mixed_chunk_tokens(self, batch: float, queued: float, jobs: int) -> float:
        """Prefill tokens a colocated unit computes this step: one chunk per rank that holds a
        job, within the rank's token budget after its own decodes."""
        ranks = max(1, min(self.gpus, jobs))
        room = max(self.ep.mixed_rank_tokens - batch / self.gpus, 16.0)
        return max(min(ranks * room, queued), 16.0)

    def kv_transfer_s(self, tokens: float) -> float:
        nbytes = tokens * self.model.kv_bytes_per_token
        return self.ep.transfer_setup_s + nbytes / (self.hw.link_bw * self.ep.link_eff)

    # ---- the lockstep step ----------------------------------------------------------------

    def _rank_compute_s(
        self, own_tokens: float, kv: float, chunk: float, chunk_ctx: float, unit_tokens: float
    ) -> float:
        """One rank's attention, dense layers and experts for one step."""
        k, m = self._k, self.model
        attn = kv * k.attn_decode_s_per_kv
        if chunk > 0:
            attn += chunk * (chunk_ctx + chunk / 2.0) * k.attn_prefill_s_per_pair
        dense = max(k.dense_read_s, own_tokens * k.dense_s_per_token)
        pairs = unit_tokens * m.top_k / self.gpus
        if pairs > 0 and self.gpus > 1:  # the residual imbalance (see `_Rates`)
            pairs *= 1.0 + k.imbalance_z / math.sqrt(max(pairs, 1.0))
        le = k.local_experts
        touched = 1.0 if le <= 1 else 1.0 - (1.0 - 1.0 / le) ** pairs
        experts = max(k.expert_read_s * touched, pairs * k.expert_s_per_pair)
        return attn + dense + experts

    def _a2a_s(self, tokens_per_rank: float, low_latency: bool) -> float:
        k = self._k
        if tokens_per_rank <= 0:
            return 0.0
        if low_latency:
            return tokens_per_rank * k.ll_a2a_s_per_token
        return tokens_per_rank * k.normal_a2a_s_per_token

    def step_s(
        self,
        rank_batch: float,
        rank_kv: float,
        chunk: float,
        chunk_ctx: float,
        ranks_prefilling: int,
    ) -> float:
        """The unit's step: the slowest rank (one holding a prefill chunk, if any), then the
        all-to-all, then launch overheads; all-decode steps get graphs, TBO, low-latency EP."""
        e = self.ep
        unit_tokens = rank_batch * self.gpus + chunk * ranks_prefilling
        slowest = self._rank_compute_s(rank_batch + chunk, rank_kv, chunk, chunk_ctx, unit_tokens)
        if ranks_prefilling == 0 or chunk <= 0:
            step = (slowest + self._a2a_s(rank_batch, low_latency=True)) / _tbo(e, rank_batch)
            return step + e.graph_step_s + e.per_seq_s * rank_batch
        a2a = self._a2a_s(rank_batch + chunk, low_latency=False)
        return slowest + a2a + self._k.eager_s + e.per_seq_s * rank_batch

    def prefill_step_s(
        self, chunk: float, chunk_ctx: float, ranks_prefilling: int, prompts: float = 1.0
    ) -> float:
        """A step of a prefill unit, each prefilling rank computing `prompts` prompts of `chunk`
        tokens: two-batch overlap hides the all-to-all under compute when every rank agrees
        on the mode (SGLang runs TBO only then)."""
        tokens = chunk * prompts
        unit_tokens = tokens * ranks_prefilling
        compute = self._rank_compute_s(tokens, 0.0, 0.0, 0.0, unit_tokens)
        compute += prompts * chunk * (chunk_ctx + chunk / 2.0) * self._k.attn_prefill_s_per_pair
        a2a = self._a2a_s(tokens, low_latency=False)
        overlap = ranks_prefilling >= self.gpus
        step = max(compute, a2a) if overlap else compute + a2a
        return step + self._k.eager_s

    # ---- what the allocator needs ------------------------------------------------------------

    def role_capacity(
        self, typical_context: float = 8192.0, typical_new: float = PREFILL_QUOTED_TOKENS
    ) -> RoleCapacity:
        """The allocator's linearised view of one unit: prefill throughput at typical sizes;
        decode step as base + per sequence + per KV token, fitted around a typical batch."""
        per_req = self.prefill_s(typical_new, typical_context)
        b0 = 64.0 * self.gpus
        kv0 = b0 * typical_context
        base = self.decode_step_s(1.0, 0.0)
        per_seq = (self.decode_step_s(b0, 0.0) - base) / b0
        per_kv = (self.decode_step_s(b0, kv0) - self.decode_step_s(b0, 0.0)) / kv0
        # A decode unit prefilling locally: the first append of a step costs the whole step
        # (every rank waits for its chunk, the step runs without graphs); appends on the
        # other ranks of the same step cost only their own work.
        # The first append's own cost: its tokens, and their attention to its context.
        append, tiny, decode = typical_new, 16.0, self.decode_step_s(b0, kv0)
        bare = self.mixed_step_s(b0, kv0, tiny, typical_context, 1)
        one = self.mixed_step_s(b0, kv0, append, typical_context, 1)
        bare0 = self.mixed_step_s(b0, kv0, tiny, 0.0, 1)
        one0 = self.mixed_step_s(b0, kv0, append, 0.0, 1)
        every = self.mixed_step_s(b0, kv0, append * self.gpus, typical_context, self.gpus)
        more = max((every - one) / (append * (self.gpus - 1)), 1e-12) if self.gpus > 1 else 0.0
        rank_rate = (append - tiny) / max(one0 - bare0, 1e-9)
        attend = max((one - bare) - (one0 - bare0), 0.0) / ((append - tiny) * typical_context)
        # Context dependence of prefill: the same request at 4x the typical context.
        far = 4.0 * typical_context
        slope = (self.prefill_s(typical_new, far) - per_req) / typical_new / (far - typical_context)
        return RoleCapacity(
            prefill_tokens_per_s=typical_new / per_req,
            local_prefill_tokens_per_s=1.0 / more if more else append / max(one - decode, 1e-9),
            local_prefill_step_s=max(bare - decode, 0.0) if more else 0.0,
            local_prefill_rank_tokens_per_s=rank_rate if more else 0.0,
            local_prefill_rank_s_per_token_per_context=attend if more else 0.0,
            prefill_s_per_token_per_context=max(slope, 0.0),
            prefill_context=typical_context,
            decode_base_step_s=base,
            decode_s_per_seq=max(per_seq, 0.0),
            decode_s_per_kv_token=max(per_kv, 0.0),
            kv_capacity_tokens=self.kv_capacity_tokens,
            switch_s=self.restart_s,
        )
