"""What one worker of each role can do: the allocator's model of capacity.

The simulator derives it from its first-principles cost model; the controller derives it from
measured prefill and decode timings. Either way the allocator sees the same small shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoleCapacity:
    prefill_tokens_per_s: float  # one prefill worker, at typical context lengths
    decode_base_step_s: float  # per decode step: weights read + fixed overhead
    decode_s_per_seq: float  # per sequence in the batch (compute, sampling)
    decode_s_per_kv_token: float  # per KV token read each step
    kv_capacity_tokens: float  # KV cache one worker holds
    switch_s: float = 0.0  # extra seconds a role switch costs beyond draining (restarts)
    # Prefill tokens/s a decode worker gives up its decode time for when it prefills locally
    # (0: as fast as a prefill worker). Lower on expert-parallel units, where one rank's
    # chunk stalls every rank's decodes and costs the step its CUDA graphs.
    local_prefill_tokens_per_s: float = 0.0

    @property
    def local_prefill_rate(self) -> float:
        return self.local_prefill_tokens_per_s or self.prefill_tokens_per_s

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        return (
            self.decode_base_step_s
            + self.decode_s_per_seq * batch
            + self.decode_s_per_kv_token * kv_tokens
        )
