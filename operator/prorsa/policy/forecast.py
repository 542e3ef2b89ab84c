"""What a demand forecast is, and how one is scored.

Every forecaster answers the same question from the lifecycle table: for each step of the
horizon, how many prefill tokens per second will be submitted, and how many sequences (and KV
tokens) will be decoding at the end of the step. The forecasters are plug-ins behind
`Forecaster` (`policy/forecasters.py`: the baselines and the registry by name;
`policy/lifecycle_forecast.py`: Prorsa's). `ForecastScorer` measures each one's error
against what actually happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from prorsa.policy.lifecycle import LifecycleTable

# Completed decodes a forecast's statistics must rest on before it is trusted: by the
# predictive policy to act on (`AllocationSettings.min_evidence`), by the forecaster's online
# calibration to learn from.
MIN_EVIDENCE = 200

RolloutMode = Literal["sync", "async"]


@dataclass(frozen=True, slots=True)
class Horizon:
    step_s: float = 5.0
    steps: int = 12

    @property
    def seconds(self) -> float:
        return self.step_s * self.steps


@dataclass(slots=True)
class Forecast:
    """Expected demand per horizon step (index 0 is the step starting now)."""

    step_s: float
    prefill_tokens_per_s: list[float]  # prefill work submitted during the step
    decode_seqs: list[float]  # sequences decoding at the end of the step
    decode_kv_tokens: list[float]  # their KV footprint
    prefill_backlog_tokens: float = 0.0  # submitted already, not yet prefilled
    mean_prefill_tokens: float = 1.0  # per request: turns a token backlog into waiting requests
    decode_s_per_token: float = 0.02  # observed decode pace (incl. queueing)
    remote_prefill_share: float = 1.0  # of prefill work, the part the prefill pool serves
    pool_amplification: float = 1.0  # tokens the pool computes per token of its share
    mean_decode_s: float = 1.0  # one decode request, queueing included (a switch drains this)
    evidence: float = 0.0  # completed decodes the statistics behind this forecast have seen
    recompute_fraction: float = 0.0  # of prefill work, the part recomputing evicted contexts
    resident_kv_tokens: float = 0.0  # context of every live trajectory (decode caches keep it)
    live_trajectories: float = 0.0  # trajectories in flight (that context is theirs)

    @classmethod
    def flat(
        cls, horizon: Horizon, prefill_rate: float, seqs: float, kv: float, **kw: float
    ) -> Forecast:
        n = horizon.steps
        return cls(horizon.step_s, [prefill_rate] * n, [seqs] * n, [kv] * n, **kw)


class Forecaster(Protocol):
    name: str

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast: ...


def table_facts(table: LifecycleTable) -> dict[str, float]:
    """What every forecast reports about now, whatever it predicts about the future."""
    st = table.stats
    mean_req = st.tool_output_tokens.get(st.first_prompt_tokens.get(512.0))
    resident = float(table.resident_context_tokens)
    live = table.in_flight
    recomputed = st.recompute_share.get(0.0) * (resident / live if live else 0.0)
    return {
        "recompute_fraction": recomputed / (recomputed + max(mean_req, 1.0)),
        "resident_kv_tokens": resident,
        "live_trajectories": float(live),
        "prefill_backlog_tokens": float(table.prefill_backlog_tokens),
        "mean_prefill_tokens": max(mean_req, 1.0),
        "decode_s_per_token": st.tpot(0.02),
        "remote_prefill_share": st.remote_share.get(1.0),
        "pool_amplification": st.pool_amplification(),
        "mean_decode_s": st.decode_s.get(1.0),
        "evidence": float(st.decode_duration.n),
    }


@dataclass
class ForecastScorer:
    """Weighted MAPE of forecasts against realised demand, over every horizon step.

    Realised prefill demand is the tokens submitted during each step; realised decode load is
    the number of sequences decoding at the step's end. Error is sum|F - A| / sum A (a MAPE
    weighted by actual demand, which stays defined when a step has zero demand).
    """

    horizon: Horizon
    pending: list[tuple[float, Forecast]] = field(default_factory=list)
    abs_err: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    actual_sum: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    _samples: list[tuple[float, int, int]] = field(default_factory=list)

    def record_forecast(self, now: float, fc: Forecast) -> None:
        self.pending.append((now, fc))

    def record_actual(self, now: float, submitted_total: int, decoding: int) -> None:
        """Called once per step with the table's cumulative counters."""
        self._samples.append((now, submitted_total, decoding))
        dt = self.horizon.step_s
        still: list[tuple[float, Forecast]] = []
        for t0, fc in self.pending:
            if now + 1e-9 < t0 + self.horizon.seconds:
                still.append((t0, fc))
                continue
            self._score(t0, fc, dt)
        self.pending = still
        horizon_start = now - self.horizon.seconds - dt
        self._samples = [s for s in self._samples if s[0] >= horizon_start - 1e-9]

    def _score(self, t0: float, fc: Forecast, dt: float) -> None:
        by_time = {round(s[0] / dt): s for s in self._samples}
        base = by_time.get(round(t0 / dt))
        if base is None:
            return
        prev = base
        for h in range(len(fc.decode_seqs)):
            cur = by_time.get(round(t0 / dt) + h + 1)
            if cur is None:
                return
            actual_rate = (cur[1] - prev[1]) / dt
            self.abs_err["prefill"] += abs(fc.prefill_tokens_per_s[h] - actual_rate)
            self.actual_sum["prefill"] += actual_rate
            self.abs_err["decode"] += abs(fc.decode_seqs[h] - cur[2])
            self.actual_sum["decode"] += cur[2]
            prev = cur

    def mape(self) -> dict[str, float]:
        """Percent error per kind; NaN where no horizon has been scored yet (a run shorter
        than its horizon has no forecast to judge, which is not a perfect one)."""
        return {
            k: (100.0 * self.abs_err[k] / self.actual_sum[k]) if self.actual_sum[k] else math.nan
            for k in self.abs_err
        }
