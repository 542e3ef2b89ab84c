"""Where a turn runs, as small composable parts (filters keep candidates, scorers rank them,
lower is better, ties go to the first key) plus the shared rules of `policy.placement`.

A turn is either split — prefill on a `prefill` worker, decode on a `decode` worker that pulls
the KV cache — or served whole by one worker that can do both phases (a `mixed` worker, a
decode worker appending to a context it holds, or any worker when a pool is empty).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prorsa.policy.placement import PlacementSettings, pool_worthy, sheds_load, stays_local
from prorsa.router.pool import Pool, Worker


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """What placement needs to know about one turn."""

    prompt_tokens: int
    new_tokens: int  # tokens beyond the context this trajectory's decode worker holds
    sticky: str | None  # the worker that decoded this trajectory's previous turn
    extends_context: bool  # the prompt extends the previous turn's prompt
    can_split: bool
    routing_switch: bool = True  # switch mode `routing`: a draining worker may serve its target


@dataclass(frozen=True, slots=True)
class Plan:
    decode: Worker  # serves the decode, or the whole turn when `prefill` is None
    prefill: Worker | None
    pool_worthy: bool  # reported in turn_submit, pool or not
    holds_prefix: bool
    # A handoff: the trajectory moved off a crowded decode worker, which still holds its
    # context and prefills the turn for the new one (only the new tokens are computed).
    handoff: bool = False


Filter = Callable[[Worker, TurnFacts], bool]
Scorer = Callable[[Worker, TurnFacts], float]


def pick(
    workers: Iterable[Worker], facts: TurnFacts, filters: list[Filter], scorers: list[Scorer]
) -> Worker | None:
    candidates = [w for w in workers if all(f(w, facts) for f in filters)]
    if not candidates:
        return None
    return min(candidates, key=lambda w: tuple(s(w, facts) for s in scorers))


# ---- filters ------------------------------------------------------------------------------


def healthy(w: Worker, f: TurnFacts) -> bool:
    return w.healthy


def serves_prefill(w: Worker, f: TurnFacts) -> bool:
    return w.serves_prefill(f.routing_switch)


def serves_decode(w: Worker, f: TurnFacts) -> bool:
    return w.serves_decode(f.routing_switch)


# ---- scorers ------------------------------------------------------------------------------


def prefill_tokens_queued(w: Worker, f: TurnFacts) -> float:
    return w.queued_prefill_tokens


def inflight(w: Worker, f: TurnFacts) -> float:
    return w.inflight


def not_sticky(w: Worker, f: TurnFacts) -> float:
    return 0.0 if w.name == f.sticky else 1.0


# ---- the placement of one turn ------------------------------------------------------------


class Placement:
    def __init__(
        self,
        pool: Pool,
        settings: PlacementSettings | None = None,
        hosted: Mapping[str, int] | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings or PlacementSettings()
        self.hosted = hosted if hosted is not None else {}  # trajectories sticking per worker
        self.prefill_tokens_per_s = 20_000.0  # learned from completed prefills (EWMA)

    def _hosted(self, w: Worker, f: TurnFacts) -> float:
        """Scorer: trajectories whose decode already sticks to this worker."""
        return self.hosted.get(w.name, 0)

    def learn_prefill_rate(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += 0.1 * (tokens / seconds - self.prefill_tokens_per_s)

    def _decode_worker(self, workers: list[Worker], facts: TurnFacts) -> Worker | None:
        decoders = [w for w in workers if healthy(w, facts) and serves_decode(w, facts)]
        sticky = next((w for w in decoders if w.name == facts.sticky), None)
        if sticky is not None:
            hosted = [int(self._hosted(w, facts)) for w in decoders]
            mean = sum(hosted) / len(hosted)
            if not sheds_load(self.settings, int(self._hosted(sticky, facts)), mean, min(hosted)):
                return sticky
        chosen = pick(decoders, facts, [], [self._hosted, inflight])
        # No decode-capable worker: any healthy worker serves the whole turn.
        return chosen or pick(workers, facts, [healthy], [inflight])

    def _old_home(self, workers: list[Worker], d: Worker, facts: TurnFacts) -> Worker | None:
        """The decode worker a trajectory was just moved off, if it can hand the context over:
        it still holds it and, in `routing` switch mode (every engine both produces and
        consumes KV), prefills the turn for the new worker, which pulls the KV, instead of
        the context being recomputed."""
        if not (facts.extends_context and facts.routing_switch and facts.can_split):
            return None
        if facts.sticky is None or facts.sticky == d.name:
            return None
        old = next((w for w in workers if w.name == facts.sticky), None)
        if old is None or not (healthy(old, facts) and serves_decode(old, facts)):
            return None
        return old

    def plan(self, facts: TurnFacts, exclude: frozenset[str] = frozenset()) -> Plan | None:
        """None when no healthy worker is left (the caller answers 503)."""
        workers = [w for w in self.pool.workers.values() if w.name not in exclude]
        d = self._decode_worker(workers, facts)
        if d is None:
            return None
        holds = facts.extends_context and d.name == facts.sticky
        old = self._old_home(workers, d, facts)
        if old is not None:
            return Plan(d, old, False, False, handoff=True)
        worthy = pool_worthy(self.settings, holds, facts.new_tokens)
        local = Plan(d, None, worthy, holds)
        if not (worthy and facts.can_split and serves_decode(d, facts)):
            return local
        p = pick(
            (w for w in workers if w is not d),
            facts,
            [healthy, serves_prefill],
            [prefill_tokens_queued, inflight],
        )
        if p is None:
            return local
        queue_s = p.queued_prefill_tokens / self.prefill_tokens_per_s
        if stays_local(self.settings, holds, facts.new_tokens, queue_s, facts.prompt_tokens):
            return local
        return Plan(d, p, worthy, holds)
