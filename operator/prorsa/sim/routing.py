"""What the router does, in the simulator: where each turn's prefill and decode run.

The rules are `prorsa.policy.placement`'s, the ones the real router applies; this module only
holds the simulated workers' side of them (queues, caches, homes).
"""

from __future__ import annotations

from prorsa.policy.allocate import Role
from prorsa.policy.placement import pool_worthy, sheds_load, stays_local
from prorsa.sim.config import SimConfig
from prorsa.sim.roles import RoleCosts
from prorsa.sim.state import SimWorker, TrajRun


class SimRouter:
    def __init__(self, workers: list[SimWorker], costs: RoleCosts, cfg: SimConfig) -> None:
        self.workers = workers
        self.costs = costs
        self.cost = costs.decode  # the switch mode is the decode side's
        self.cfg = cfg
        self._dirty = True
        self._prefill_pool: list[SimWorker] = []
        self._decode_pool: list[SimWorker] = []

    def invalidate(self) -> None:
        """A worker changed role, drained or restarted: recompute who accepts what."""
        self._dirty = True

    def _pools(self) -> None:
        if self._dirty:
            self._prefill_pool = [w for w in self.workers if w.accepts(Role.PREFILL)]
            self._decode_pool = [w for w in self.workers if w.accepts(Role.DECODE)]
            self._dirty = False

    def place_prefill(
        self, tr: TrajRun, prompt: int, new_tokens: int
    ) -> tuple[SimWorker, bool, bool]:
        """Where this turn's prefill runs: (worker, local, pool_worthy).

        The shared rules of `prorsa.policy.placement`, as the router applies them to any
        worker that decodes (mixed ones included): the trajectory's home worker unless it hosts
        far more than its share; a pool prefill goes to the prefill worker with the least
        queued work, or to the one that prefilled this trajectory before if its cached prefix
        makes it cheaper (prefix affinity). Colocated clusters have no pool: all local.
        """
        rules = self.cfg.placement
        self._pools()
        home = self.workers[tr.decode_home] if tr.decode_home >= 0 else None
        if home is not None and home.accepts(Role.DECODE):
            moved = self.rebalance(tr, home)
            if moved is not None:
                # The old home holds the prefix: it prefills the turn (kv_both) and the new
                # home pulls the whole context over NIXL.
                if (
                    self.cost.switch_mode == "routing"
                    and home.cached(tr.idx) >= prompt - new_tokens
                ):
                    return home, False, False
                home = moved
        holds = (
            home is not None
            and home.accepts(Role.DECODE)
            and home.cached(tr.idx) >= prompt - new_tokens
        )
        worthy = pool_worthy(rules, holds, new_tokens)
        local = home if home is not None and home.accepts(Role.DECODE) else None
        pool = [w for w in self._prefill_pool if w.role == Role.PREFILL]
        if not pool or not worthy:
            return local or self.place_decode(tr), True, worthy
        cost = self.costs.prefill.prefill_s

        def remote_s(w: SimWorker) -> float:
            c = w.cached(tr.idx)
            if self.cfg.prefix_pull and home is not None:
                c = max(c, home.cached(tr.idx))
            return w.queue_s + cost(prompt - c, c)

        shortest = best = min(pool, key=lambda w: w.queue_s)
        if tr.prefill_home >= 0:
            ph = self.workers[tr.prefill_home]
            if (
                ph.role == Role.PREFILL
                and ph.accepts(Role.PREFILL)
                and remote_s(ph) <= remote_s(best)
            ):
                best = ph
        compute = prompt - best.cached(tr.idx)
        if self.cfg.prefix_pull and holds:
            compute = new_tokens
        if stays_local(rules, holds, new_tokens, shortest.queue_s, compute):
            return local or self.place_decode(tr), True, worthy
        tr.prefill_home = best.idx
        return best, False, worthy

    def place_decode(self, tr: TrajRun) -> SimWorker:
        self._pools()
        if tr.decode_home >= 0:
            home = self.workers[tr.decode_home]
            if home.accepts(Role.DECODE):
                return home
        pool = self._decode_pool or [w for w in self.workers if not w.restarting]
        w = min(pool, key=lambda w: w.homed)  # balance the trajectories each worker hosts
        self.set_home(tr, w)
        return w

    def rebalance(self, tr: TrajRun, home: SimWorker) -> SimWorker | None:
        """Move a trajectory to the least-loaded decode worker when its home should shed load
        (`sheds_load`: after role switches, sticky placement alone would leave new decode
        workers idle)."""
        pool = self._decode_pool
        if len(pool) < 2:
            return None
        avg = sum(w.homed for w in pool) / len(pool)
        target = min(pool, key=lambda w: w.homed)
        if not sheds_load(self.cfg.placement, home.homed, avg, target.homed):
            return None
        if target.homed >= avg:
            return None
        self.set_home(tr, target)
        return target

    def set_home(self, tr: TrajRun, w: SimWorker | None) -> None:
        if tr.decode_home >= 0:
            self.workers[tr.decode_home].homed -= 1
        tr.decode_home = -1 if w is None else w.idx
        if w is not None:
            w.homed += 1
