"""The tables the cost models read: GPUs, models, and the measured kernels of expert parallelism.

Every figure names its source; "derived" marks arithmetic done here from published configs.
The step models themselves live in `costmodel` (one GPU, dense or MoE) and `lockstep` (an
engine unit of G GPUs with data-parallel attention and expert parallelism).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    link_bw: float  # bytes/s per GPU for KV transfer between workers (one NIC)
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)
    gpus_per_node: int = 8
    nvlink_a2a_bw: float = 0.0  # bytes/s per GPU of DeepEP normal-mode all-to-all in a node


# NVIDIA H100/H200 SXM datasheets: dense BF16 989 TFLOP/s, dense FP8 1,979 TFLOP/s; H100 80 GB
# HBM3 at 3.35 TB/s, H200 141 GB HBM3e at 4.8 TB/s. H800 is the export H100: same SXM compute
# and HBM (80 GB, 3.35 TB/s), NVLink cut to 400 GB/s. KV transfer rides one 400 Gb/s ConnectX-7
# NIC per GPU (50 GB/s), the DGX H100/H200 network and the DeepEP test bed.
# Normal-mode all-to-all inside a node: DeepEP README, intranode dispatch/combine 153-158 GB/s
# over NVLink on H800 (taken as 155 GB/s; H100/H200 NVLink is faster, so this is conservative).
HARDWARE = {
    "h200": Hardware("H200 SXM", 989e12, 141e9, 4.8e12, 50e9, 1979e12, 8, 155e9),
    "h100": Hardware("H100 SXM", 989e12, 80e9, 3.35e12, 50e9, 1979e12, 8, 155e9),
    "h800": Hardware("H800 SXM", 989e12, 80e9, 3.35e12, 50e9, 1979e12, 8, 155e9),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float  # per token (MoE: shared + top-k experts)
    layers: int
    q_dim: int  # attention heads x head dim
    kv_bytes_per_token: float  # KV cache bytes per token, all layers
    experts: int = 0
    top_k: int = 0
    restart_s: float = 30.0  # vLLM engine restart (weights from page cache, graph capture)
    # Expert-parallel view (0 where the one-GPU model does not need it):
    moe_layers: int = 0
    hidden: int = 0
    expert_params: float = 0.0  # one routed expert of one layer (gate, up, down)
    weight_bytes_per_param: float = 2.0  # BF16; FP8 checkpoints: 1
    # Attention FLOPs per (query token, context token), all layers: prefill as computed
    # (MLA: uncompressed heads), decode as computed (MLA: absorbed into the latent).
    attn_flops_prefill: float = 0.0
    attn_flops_decode: float = 0.0
    max_nodes_per_token: int = 1 << 30  # node-limited routing (DeepSeek-V3: 4 nodes)

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def routed_params(self) -> float:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def dense_params(self) -> float:
        """Weights every DP-attention rank holds and runs for each of its tokens: attention,
        shared experts, dense layers, embeddings (everything but the routed experts)."""
        return self.total_params - self.routed_params

    @property
    def active_routed_params(self) -> float:
        return self.moe_layers * self.top_k * self.expert_params


def _mla_kv_bytes(layers: int, kv_lora_rank: int, rope_dim: int) -> float:
    """MLA caches one compressed latent plus the decoupled RoPE key per token and layer, BF16."""
    return float(layers * (kv_lora_rank + rope_dim) * 2)


# Model configs from their published config.json:
# - Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads, head dim 128.
# - Qwen3-30B-A3B: 48 layers, 32 heads, 4 KV heads, head dim 128, 128 experts, top-8, 3.3B
#   active.
# - DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, the first 3 dense
#   (first_k_dense_replace=3) so 58 MoE; hidden 7168; 128 heads; MLA q_lora_rank 1536,
#   kv_lora_rank 512, qk_nope 128 + qk_rope 64, v_head_dim 128; 256 routed experts (top-8) and
#   1 shared, moe_intermediate_size 2048; 671B total / 37B active; FP8 weights. Derived: one
#   routed expert 3 x 7168 x 2048 = 44.0M parameters; KV (512 + 64) x 2 bytes x 61 layers =
#   70,272 bytes per token; attention FLOPs per (query, context) token pair: prefill
#   2 x (192 + 128) x 128 heads x 61 layers, decode (absorbed, FlashMLA) 2 x (576 + 512) x 128
#   x 61. Node-limited routing sends a token to at most 4 nodes (DeepSeek-V3 report, 2.1.2).
# - Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json): 94 layers all MoE; hidden 4096; 64
#   query heads, 4 KV heads, head dim 128; 128 experts, top-8, moe_intermediate_size 1536;
#   235B total / 22B active; served in FP8 (Qwen3-235B-A22B-FP8). Derived: one expert
#   3 x 4096 x 1536 = 18.9M parameters; KV 2 x 94 x 4 x 128 x 2 bytes = 192,512 bytes/token;
#   attention 4 x 64 x 128 x 94 FLOPs per pair (scores and values, GQA reads shared KV).
# Engine restart of a multi-GPU unit (an estimate, derived, no published measurement): the FP8
# weights of one node (DeepSeek-V3 ~790 GB over 8 GPUs, Qwen3-235B ~240 GB) read from local
# NVMe at ~7 GB/s, plus CUDA-graph capture and kernel JIT warm-up of a few tens of seconds:
# ~300 s and ~120 s.
MODELS = {
    "dense-8b": ModelSpec(
        "Llama-3.1-8B", 8.03e9, 8.03e9, 32, 4096, 2 * 32 * 8 * 128 * 2, restart_s=30.0
    ),
    "moe-30b-a3b": ModelSpec(
        "Qwen3-30B-A3B",
        30.5e9,
        3.3e9,
        48,
        4096,
        2 * 48 * 4 * 128 * 2,
        experts=128,
        top_k=8,
        restart_s=60.0,
    ),
    "deepseek-v3": ModelSpec(
        "DeepSeek-V3",
        671e9,
        37e9,
        61,
        128 * 128,
        _mla_kv_bytes(61, 512, 64),
        experts=256,
        top_k=8,
        restart_s=300.0,
        moe_layers=58,
        hidden=7168,
        expert_params=3 * 7168 * 2048,
        weight_bytes_per_param=1.0,
        attn_flops_prefill=2.0 * (192 + 128) * 128 * 61,
        attn_flops_decode=2.0 * (576 + 512) * 128 * 61,
        max_nodes_per_token=4,
    ),
    "qwen3-235b": ModelSpec(
        "Qwen3-235B-A22B",
        235e9,
        22e9,
        94,
        64 * 128,
        2 * 94 * 4 * 128 * 2,
        experts=128,
        top_k=8,
        restart_s=120.0,
        moe_layers=94,
        hidden=4096,
        expert_params=3 * 4096 * 1536,
        weight_bytes_per_param=1.0,
        attn_flops_prefill=4.0 * 64 * 128 * 94,
        attn_flops_decode=4.0 * 64 * 128 * 94,
    ),
}


# DeepEP README, low-latency kernels on H800 + 400 Gb/s CX7, 128 tokens per rank, top-8, 7168
# hidden (FP8 dispatch, BF16 combine): microseconds per MoE layer by EP size.
_LL_EP = (8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
_LL_DISPATCH_US = (77.0, 118.0, 155.0, 173.0, 192.0, 194.0)
_LL_COMBINE_US = (114.0, 195.0, 273.0, 314.0, 369.0, 360.0)
LL_TOKENS = 128.0
LL_HIDDEN = 7168.0
# DeepEP README, normal kernels (4,096 tokens): internode RDMA bandwidth by EP size.
_NORMAL_EP = (16.0, 32.0, 64.0)
_NORMAL_RDMA_GBPS = (43.0, 58.0, 51.0)


def interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear in x, clamped to the measured range."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    f = (x - xs[i]) / (xs[i + 1] - xs[i])
    return ys[i] + f * (ys[i + 1] - ys[i])


def low_latency_a2a_s(ep: int, tokens_per_rank: float, hidden: int) -> float:
    """Dispatch + combine of one MoE layer in DeepEP's low-latency mode. Derived: the measured
    128-token figure scaled by the bytes moved (tokens x hidden), the kernels being bandwidth-
    bound at that size (the README reports them near the link's bandwidth)."""
    if ep <= 1:
        return 0.0
    us = interp(_LL_EP, _LL_DISPATCH_US, ep) + interp(_LL_EP, _LL_COMBINE_US, ep)
    return us * 1e-6 * (tokens_per_rank / LL_TOKENS) * (hidden / LL_HIDDEN)


def normal_a2a_bw(hw: Hardware, ep: int) -> float:
    """Bytes/s per GPU of DeepEP's normal-mode all-to-all: NVLink inside one node, the
    measured RDMA bandwidth across nodes."""
    if ep <= hw.gpus_per_node:
        return hw.nvlink_a2a_bw
    return interp(_NORMAL_EP, _NORMAL_RDMA_GBPS, ep) * 1e9
