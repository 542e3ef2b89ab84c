"""What one worker of each role can do: the allocator's model of capacity.

The simulator derives it from its first-principles cost model; the controller derives it from
measured prefill and decode timings. Either way the allocator sees the same small shape.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_QUOTED_TOKENS = 1024.0  # the prefill size `RoleCapacity.prefill_tokens_per_s` is quoted at


def quoted_prefill_rate(fixed_s: float, tokens_per_s: float) -> float:
    """`RoleCapacity.prefill_tokens_per_s` of a prefill measured as a fixed cost per request
    plus a marginal rate: its tokens/s at PREFILL_QUOTED_TOKENS new tokens."""
    return PREFILL_QUOTED_TOKENS / (fixed_s + PREFILL_QUOTED_TOKENS / tokens_per_s)


@dataclass(frozen=True, slots=True)
class RoleCapacity:
    prefill_tokens_per_s: float  # one prefill worker, at typical context lengths
    decode_base_step_s: float  # per decode step: weights read + fixed overhead
    decode_s_per_seq: float  # per sequence in the batch (compute, sampling)
    decode_s_per_kv_token: float  # per KV token read each step
    kv_capacity_tokens: float  # KV cache one worker holds
    switch_s: float = 0.0  # extra seconds a role switch costs beyond draining (restarts)
    # Prefill tokens/s a decode worker gives up its decode time for when it prefills locally
    # (0: as fast as a prefill worker), beyond the step's fixed cost below.
    local_prefill_tokens_per_s: float = 0.0
    # What a decode step pays when it carries any local prefill (0: nothing beyond the
    # tokens' own work). On an expert-parallel unit the step runs without CUDA graphs, two-
    # batch overlap and low-latency all-to-all (`local_prefill_step_s`), and every rank waits
    # while one computes the first append's tokens (at `local_prefill_rank_tokens_per_s`);
    # appends on the other ranks of the same step cost `local_prefill_tokens_per_s`.
    local_prefill_step_s: float = 0.0
    local_prefill_rank_tokens_per_s: float = 0.0
    local_prefill_rank_s_per_token_per_context: float = 0.0  # that append attending its context
    # How prefill slows with the context it attends to: `prefill_tokens_per_s` holds at
    # `prefill_context` tokens of context; each further context token adds this many seconds
    # per new token (attention over the cached prefix). 0: no context dependence known.
    prefill_s_per_token_per_context: float = 0.0
    prefill_context: float = 8192.0
    # Seconds every prefill request costs whatever its size (scheduling, the step's fixed
    # work, the first token): part of `prefill_tokens_per_s` as quoted at
    # PREFILL_QUOTED_TOKENS new tokens, so short requests run below that rate (0: unknown).
    prefill_request_s: float = 0.0

    @property
    def local_prefill_rate(self) -> float:
        return self.local_prefill_tokens_per_s or self.prefill_tokens_per_s

    def local_prefill_first_s(self, tokens: float, context: float = 0.0) -> float:
        """Seconds a decode step grows by when it carries one append of `tokens` to a context
        of `context` tokens."""
        if not self.local_prefill_rank_tokens_per_s:
            return self.local_prefill_step_s
        attend = tokens * context * self.local_prefill_rank_s_per_token_per_context
        return self.local_prefill_step_s + tokens / self.local_prefill_rank_tokens_per_s + attend

    def prefill_slowdown(self, context: float) -> float:
        """Seconds per prefill token at `context` over those at `prefill_context` (>= 0.1)."""
        if not self.prefill_s_per_token_per_context:
            return 1.0
        base = 1.0 / self.prefill_tokens_per_s
        extra = self.prefill_s_per_token_per_context * (context - self.prefill_context)
        return max(0.1, (base + extra) / base)

    def prefill_s(self, tokens: float, context: float) -> float:
        """Seconds one prefill request of `tokens` new tokens attending `context` takes: its
        fixed cost, then its tokens at the rate the quoted one leaves, slowed by the context."""
        quoted = PREFILL_QUOTED_TOKENS / self.prefill_tokens_per_s
        fixed = min(max(self.prefill_request_s, 0.0), 0.9 * quoted)
        per_token = (quoted - fixed) / PREFILL_QUOTED_TOKENS
        extra = self.prefill_s_per_token_per_context * (context - self.prefill_context)
        return fixed + max(tokens, 0.0) * max(0.1 * per_token, per_token + extra)

    def prefill_rate(self, tokens: float, context: float) -> float:
        """Tokens/s one worker prefills in requests of `tokens` new tokens at `context`."""
        if not self.prefill_request_s:  # the quoted rate holds at every size
            return self.prefill_tokens_per_s / self.prefill_slowdown(context)
        return max(tokens, 1.0) / self.prefill_s(max(tokens, 1.0), context)

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        return (
            self.decode_base_step_s
            + self.decode_s_per_seq * batch
            + self.decode_s_per_kv_token * kv_tokens
        )
