"""Stage-specific parallelism: each role's engine configuration, and the slots they share.

Prefill and decode want different parallel configurations (DeepSeek's production: prefill
units of EP32, decode units of EP144), so a disaggregated cluster is laid out in slots of
S = max(G_prefill, G_decode) GPUs: a slot in the prefill role runs S / G_prefill prefill
engines, in the decode role S / G_decode decode engines. A colocated cluster runs one
configuration for both phases, in units of G_colocated. A switch between roles whose
configurations differ restarts the slot's engines (the model's restart time); between equal
ones it is a routing change (or the switch mode's restart).
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.policy.allocate import Role
from prorsa.policy.capacity import RoleCapacity
from prorsa.sim.costmodel import Cost, Efficiency


@dataclass(frozen=True, slots=True)
class Slot:
    """`engines` independent engines of one configuration on a slot's GPUs, seen as one
    simulated worker: work spreads evenly over the engines."""

    unit: Cost
    engines: int

    @property
    def eff(self) -> Efficiency:
        e = self.unit.eff
        return Efficiency(chunk_tokens=e.chunk_tokens * self.engines)

    @property
    def switch_mode(self) -> str:
        return self.unit.switch_mode

    @property
    def kv_capacity_tokens(self) -> float:
        return self.unit.kv_capacity_tokens * self.engines

    @property
    def restart_s(self) -> float:
        return self.unit.restart_s

    @property
    def gpus_per_worker(self) -> int:
        return self.unit.gpus_per_worker * self.engines

    @property
    def dp_ranks(self) -> int:
        return self.unit.dp_ranks * self.engines

    def prefill_s(self, new_tokens: float, context: float) -> float:
        return self.unit.prefill_s(new_tokens, context) / self.engines

    def decode_step_s(self, batch: float, kv_tokens: float) -> float:
        return self.unit.decode_step_s(batch / self.engines, kv_tokens / self.engines)

    def mixed_chunk_tokens(self, batch: float, queued: float, jobs: int) -> float:
        return self.unit.mixed_chunk_tokens(batch / self.engines, queued, jobs)

    def mixed_step_s(
        self, batch: float, kv_tokens: float, chunk: float, chunk_ctx: float, jobs: int = 1
    ) -> float:
        """The step of the engine holding the chunk, taken for the slot (a rare path: a slot
        prefills locally only when no pool can take a turn)."""
        e = self.engines
        return self.unit.mixed_step_s(batch / e, kv_tokens / e, chunk, chunk_ctx, jobs)

    def kv_transfer_s(self, tokens: float) -> float:
        return self.unit.kv_transfer_s(tokens)

    def role_capacity(self) -> RoleCapacity:
        c = self.unit.role_capacity()
        e = float(self.engines)
        return RoleCapacity(
            prefill_tokens_per_s=c.prefill_tokens_per_s * e,
            decode_base_step_s=c.decode_base_step_s,
            decode_s_per_seq=c.decode_s_per_seq / e,
            decode_s_per_kv_token=c.decode_s_per_kv_token / e,
            kv_capacity_tokens=c.kv_capacity_tokens * e,
            switch_s=c.switch_s,
            local_prefill_tokens_per_s=c.local_prefill_rate * e,
            local_prefill_step_s=c.local_prefill_step_s,  # each engine's step pays it
            local_prefill_rank_tokens_per_s=c.local_prefill_rank_tokens_per_s,
            local_prefill_rank_s_per_token_per_context=c.local_prefill_rank_s_per_token_per_context,
            prefill_s_per_token_per_context=c.prefill_s_per_token_per_context / e,
            prefill_context=c.prefill_context,
            prefill_request_s=c.prefill_request_s / e,  # e requests at once
        )


def _slot(unit: Cost, gpus: int) -> Cost:
    g = unit.gpus_per_worker
    if gpus % g:
        raise ValueError(f"a {gpus}-GPU slot cannot hold engines of {g} GPUs")
    return unit if gpus == g else Slot(unit, gpus // g)


@dataclass(frozen=True, slots=True)
class RoleCosts:
    """The cost of a worker in each role: one configuration per role, or one for all."""

    prefill: Cost
    decode: Cost
    colocated: Cost

    @classmethod
    def single(cls, cost: Cost) -> RoleCosts:
        return cls(cost, cost, cost)

    @property
    def staged(self) -> bool:
        """Whether prefill and decode run different engine configurations."""
        return self.prefill != self.decode

    def slot_gpus(self, colocated: bool) -> int:
        if colocated:
            return self.colocated.gpus_per_worker
        return max(self.prefill.gpus_per_worker, self.decode.gpus_per_worker)

    def laid_out(self, colocated: bool) -> RoleCosts:
        """Each role's cost as a whole slot (engines of that role filling it)."""
        if colocated:
            return self
        s = self.slot_gpus(False)
        return RoleCosts(_slot(self.prefill, s), _slot(self.decode, s), self.colocated)

    def of(self, role: Role) -> Cost:
        if role is Role.PREFILL:
            return self.prefill
        if role is Role.DECODE:
            return self.decode
        return self.colocated

    def switch_s(self, old: Role, new: Role) -> float:
        """Seconds a switch costs after its drain: an engine restart when the roles' engine
        configurations differ, else what the switch mode says."""
        a, b = self.of(old), self.of(new)
        if self.staged and a != b:
            return max(_restart(a), _restart(b))
        return b.restart_s

    def role_capacity(self, colocated: bool) -> RoleCapacity:
        """The allocator's view: prefill figures of a prefill slot, decode figures of a
        decode slot, and a switch between them."""
        if colocated:
            return self.colocated.role_capacity()
        p, d = self.prefill.role_capacity(), self.decode.role_capacity()
        switch = self.switch_s(Role.DECODE, Role.PREFILL)
        return RoleCapacity(
            prefill_tokens_per_s=p.prefill_tokens_per_s,
            decode_base_step_s=d.decode_base_step_s,
            decode_s_per_seq=d.decode_s_per_seq,
            decode_s_per_kv_token=d.decode_s_per_kv_token,
            kv_capacity_tokens=d.kv_capacity_tokens,
            switch_s=switch,
            local_prefill_tokens_per_s=d.local_prefill_rate,
            local_prefill_step_s=d.local_prefill_step_s,
            local_prefill_rank_tokens_per_s=d.local_prefill_rank_tokens_per_s,
            local_prefill_rank_s_per_token_per_context=d.local_prefill_rank_s_per_token_per_context,
            prefill_s_per_token_per_context=p.prefill_s_per_token_per_context,
            prefill_context=p.prefill_context,
            prefill_request_s=p.prefill_request_s,
        )


def _restart(c: Cost) -> float:
    """A full engine restart of `c`'s model, whatever its switch mode."""
    unit = c.unit if isinstance(c, Slot) else c
    model = getattr(unit, "model", None)
    return float(getattr(model, "restart_s", 0.0))


def role_costs(cost: Cost | RoleCosts) -> RoleCosts:
    return cost if isinstance(cost, RoleCosts) else RoleCosts.single(cost)
