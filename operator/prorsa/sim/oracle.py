"""The oracle forecast: the simulator's ground truth played forward.

It knows every trajectory's script: exact remaining output of each running decode, exact tool
return times, exact sizes of future turns. It still has to assume a decode pace (the observed
one) and instant prefills, so it is the best forecast a forecaster could hope for, and the
`oracle` policy (the predictive allocator fed this forecast) bounds what a better forecast can
buy. It does not bound every policy: the allocator's cost model is still an approximation.
"""

from __future__ import annotations

import math

from prorsa.policy.forecast import Forecast, table_facts
from prorsa.sim.engine import Simulator


def oracle_forecast(sim: Simulator) -> Forecast:
    now = sim.now
    dt, n = sim.horizon.step_s, sim.horizon.steps
    end = now + n * dt
    st = sim.table.stats
    tpot = st.tpot(0.02)
    prefill = [0.0] * n
    seqs = [0.0] * n
    kv = [0.0] * n

    def occupy(a: float, b: float, ctx: float) -> None:
        # decoding during [a, b): counted at every step end inside it
        h0 = max(0, int((a - now) / dt - 1e-9))
        for h in range(h0, n):
            t_end = now + (h + 1) * dt
            if t_end >= b:
                break
            if t_end >= a:
                seqs[h] += 1.0
                kv[h] += ctx

    for tr in sim.trajs:
        if tr.started_at < 0 or tr.ended_at >= 0:
            continue
        turns = tr.script.turns
        k = tr.turn
        ctx = float(tr.context)
        if tr.tool_until > now:  # in the tool call after turn k-1; turn k is submitted next
            nxt, t_sub = k, tr.tool_until
        else:
            if tr.in_decode >= 0:
                w = sim.workers[tr.in_decode]
                t_fin = now + max(tr.target - w.G, 0.0) * max(w.tau, 1e-4)
            else:  # prefilling, transferring or waiting for KV room: decodes from now
                t_fin = now + turns[k].output_tokens * tpot
            occupy(now, t_fin, ctx)
            ctx += turns[k].output_tokens
            nxt, t_sub = k + 1, t_fin + turns[k].tool_s
        while nxt < len(turns) and t_sub < end:
            new = turns[nxt].new_tokens
            prefill[int((t_sub - now) / dt)] += new / dt
            ctx += new
            t_fin = t_sub + turns[nxt].output_tokens * tpot
            occupy(t_sub, t_fin, ctx)
            ctx += turns[nxt].output_tokens
            t_sub = t_fin + turns[nxt].tool_s
            nxt += 1
    # What the table knows (backlog, request size, pace) comes from the table as for any
    # forecaster; the future is known, so the allocator need not wait for evidence.
    facts = table_facts(sim.table)
    facts["evidence"] = math.inf
    return Forecast(dt, prefill, seqs, kv, **facts)
