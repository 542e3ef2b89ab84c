"""The forecasters by name: the persistence baselines and Prorsa's lifecycle forecaster.

`last` and `ewma` extrapolate the recent past; `lifecycle` (Prorsa) reasons per trajectory
about when tool calls return and when decodes finish (`policy/lifecycle_forecast.py`).
"""

from __future__ import annotations

from prorsa.policy.calibrate import EWMA_ALPHA
from prorsa.policy.events import State
from prorsa.policy.forecast import (
    MIN_EVIDENCE,
    Forecast,
    Forecaster,
    Horizon,
    RolloutMode,
    table_facts,
)
from prorsa.policy.lifecycle import LifecycleTable
from prorsa.policy.lifecycle_forecast import LifecycleForecaster


class LastValueForecaster:
    """Tomorrow looks like today: the last interval's rate and the current decode count."""

    name = "last"

    def __init__(self) -> None:
        self._prev: tuple[float, int] | None = None

    def _observed_rate(self, table: LifecycleTable, now: float) -> float:
        prev, self._prev = self._prev, (now, table.submitted_tokens_total)
        if prev is None or now <= prev[0]:
            return 0.0
        return (table.submitted_tokens_total - prev[1]) / (now - prev[0])

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast:
        rate = self._observed_rate(table, now)
        seqs = float(table.count(State.DECODE))
        kv = float(table.decode_context_tokens)
        return Forecast.flat(horizon, rate, seqs, kv, **table_facts(table))


class EwmaForecaster(LastValueForecaster):
    """Smoothed recent past (like NVIDIA Dynamo's load predictor with a moving average)."""

    name = "ewma"

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        super().__init__()
        self.alpha = alpha
        self._rate: float | None = None
        self._seqs: float | None = None
        self._kv: float | None = None

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast:
        rate = self._observed_rate(table, now)
        seqs = float(table.count(State.DECODE))
        kv = float(table.decode_context_tokens)
        a = self.alpha
        self._rate = rate if self._rate is None else self._rate + a * (rate - self._rate)
        self._seqs = seqs if self._seqs is None else self._seqs + a * (seqs - self._seqs)
        self._kv = kv if self._kv is None else self._kv + a * (kv - self._kv)
        return Forecast.flat(horizon, self._rate, self._seqs, self._kv, **table_facts(table))


FORECASTERS = {
    "last": LastValueForecaster,
    "ewma": EwmaForecaster,
    "lifecycle": LifecycleForecaster,
    "lifecycle-blend": LifecycleForecaster,
}


def make_forecaster(
    name: str, mode: RolloutMode = "sync", min_evidence: int = MIN_EVIDENCE
) -> Forecaster:
    if name in ("lifecycle", "lifecycle-blend"):
        return LifecycleForecaster(mode, blend=name == "lifecycle-blend", min_evidence=min_evidence)
    if name == "last":
        return LastValueForecaster()
    if name == "ewma":
        return EwmaForecaster()
    raise ValueError(f"unknown forecaster {name!r}; choose one of {sorted(FORECASTERS)}")
