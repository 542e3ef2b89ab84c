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

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        return (
            self.decode_base_step_s
            + self.decode_s_per_seq * batch
            + self.decode_s_per_kv_token * kv_tokens
        )
