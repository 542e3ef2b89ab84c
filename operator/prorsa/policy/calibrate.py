"""Online calibration of a forecast per lead time, against what then happened.

Once step h of an earlier forecast has happened, the forecaster learns two things about its
lead-h forecasts:
- a gain: the running ratio of actual to forecast demand (a geometric mean), which removes
  a systematic error the model misses (an unseen phase change, a cache regime);
- a blend: the convex mix of the model and the persistence forecasts (the last interval, and
  its moving average) whose recent absolute error at that lead was the lowest. A model that
  reasons per trajectory wins where the population is about to change; persistence wins
  where it is steady or where the model's assumptions do not hold for this agent. Which one
  holds is a property of the workload, learned here as it runs, per lead time, from the same
  evidence the gains use (forecast combination, as in Bates and Granger 1969, with weights
  picked by recent error). Only the `lifecycle-blend` forecaster uses the blend: it lowers
  the error averaged over a run, but persistence, picked in steady stretches, misses the
  phase change the allocator must see coming.
Pure: fed the table's counters, no clock or I/O of its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

CANDIDATES = ("model", "last", "ewma")  # the forecasts a blend mixes, in column order
_GRID = 4  # blend weights in steps of 1/4
_COMBOS = np.array(
    [c for c in itertools.product(range(_GRID + 1), repeat=len(CANDIDATES)) if sum(c) == _GRID],
    dtype=np.float64,
) / float(_GRID)
_MODEL_ONLY = int(np.flatnonzero(_COMBOS[:, 0] == 1.0)[0])
# Weight of the last interval in the smoothed persistence forecast (the `ewma` forecaster's).
EWMA_ALPHA = 0.3
# The most a gain learns from one step: actual over forecast is clipped to this range. Lower
# than it is high: a step with no demand (ratio 0) counts at the floor, and where demand is
# sparse or has stopped, the typical step is far below the forecast mean (chosen on the
# tuning seeds among 1/2, 1/3, 1/4, 1/8 and 1/16; 1/8 lost on the validation seeds).
GAIN_CLIP = (0.25, 2.0)
# Until a lead has this many scored forecasts, the model alone is used at that lead.
MIN_SCORED = 3
# A mix must beat the model alone by this share of its error to replace it: persistence is
# not picked on noise.
MARGIN = 0.05


@dataclass
class _Past:
    t0: float
    raw_p: list[float]  # the model's forecast before gains, prefill tokens/s per step
    raw_s: list[float]  # ... decoding sequences at each step's end
    cand_p: np.ndarray  # (steps, candidates): what each candidate forecast, after gains
    cand_s: np.ndarray


@dataclass
class LeadCalibration:
    """Gains and blend weights per lead time (index h: the step h steps after now)."""

    steps: int
    step_s: float
    gain_rate: float = 0.2  # EWMA weight of a new gain ratio (0: gains off)
    blend_rate: float = 0.1  # EWMA weight of a new absolute error in the blend's scores
    gain_p: list[float] = field(init=False)
    gain_d: list[float] = field(init=False)
    _err_p: np.ndarray = field(init=False)
    _err_s: np.ndarray = field(init=False)
    _scored: np.ndarray = field(init=False)
    _past: list[_Past] = field(init=False, default_factory=list)
    _seen: list[tuple[float, int, int]] = field(init=False, default_factory=list)
    _ewma: tuple[float, float] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.gain_p, self.gain_d = [1.0] * self.steps, [1.0] * self.steps
        self._err_p = np.zeros((self.steps, len(_COMBOS)))
        self._err_s = np.zeros((self.steps, len(_COMBOS)))
        self._scored = np.zeros(self.steps)

    def observe(self, now: float, submitted_total: int, decoding: int) -> tuple[float, int]:
        """Score every earlier forecast whose step ended now; returns the persistence
        figures for now: the last step's prefill rate and the sequences decoding."""
        dt = self.step_s
        self._seen.append((now, submitted_total, decoding))
        self._seen = [x for x in self._seen if x[0] >= now - (self.steps + 2) * dt]
        start = min(self._seen, key=lambda x: abs(x[0] - (now - dt)))
        rate = -1.0  # unknown
        if abs(start[0] - (now - dt)) < dt / 2:
            rate = (submitted_total - start[1]) / (now - start[0])
        keep = []
        for past in self._past:
            h = round((now - past.t0) / dt) - 1  # step h of that forecast ended now
            if 0 <= h < self.steps and rate >= 0:
                self._score(h, past, rate, decoding)
            if h < self.steps - 1:
                keep.append(past)
        self._past = keep
        last_rate = max(rate, 0.0)
        a = EWMA_ALPHA
        if self._ewma is None:
            self._ewma = (last_rate, float(decoding))
        else:
            r, s = self._ewma
            self._ewma = (r + a * (last_rate - r), s + a * (decoding - s))
        return last_rate, decoding

    def _score(self, h: int, past: _Past, rate: float, decoding: int) -> None:
        a = self.gain_rate
        if past.raw_p[h] > 0:
            self.gain_p[h] = _toward(self.gain_p[h], rate / past.raw_p[h], a)
        if past.raw_s[h] > 0:
            self.gain_d[h] = _toward(self.gain_d[h], decoding / past.raw_s[h], a)
        b = self.blend_rate
        self._err_p[h] += b * (np.abs(_COMBOS @ past.cand_p[h] - rate) - self._err_p[h])
        self._err_s[h] += b * (np.abs(_COMBOS @ past.cand_s[h] - decoding) - self._err_s[h])
        self._scored[h] += 1

    def combine(
        self, now: float, raw_p: list[float], raw_s: list[float], model_p: list[float],
        model_s: list[float], last: tuple[float, int], mix: bool = True, score: bool = True,
    ) -> tuple[list[float], list[float]]:  # fmt: skip
        """The forecast to use: per lead, the mix of the model (after gains) and persistence
        with the lowest recent error (`mix=False`: the model); remembers the candidates to
        score them once their steps have happened (`score=False`: not this one)."""
        assert self._ewma is not None, "observe() first"
        n = self.steps
        cand_p = np.column_stack([model_p, np.full(n, last[0]), np.full(n, self._ewma[0])])
        cand_s = np.column_stack([model_s, np.full(n, float(last[1])), np.full(n, self._ewma[1])])
        if score:
            self._past.append(_Past(now, raw_p, raw_s, cand_p, cand_s))
        if not mix:
            return model_p, model_s
        w_p, w_s = self.weights()
        return (
            np.einsum("hk,hk->h", w_p, cand_p).tolist(),
            np.einsum("hk,hk->h", w_s, cand_s).tolist(),
        )

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, candidates) weights for prefill and for decode."""
        return self._pick(self._err_p), self._pick(self._err_s)

    def _pick(self, err: np.ndarray) -> np.ndarray:
        best = np.argmin(err, axis=1)
        model = err[:, _MODEL_ONLY]
        rows = np.arange(self.steps)
        keep_model = (self._scored < MIN_SCORED) | (err[rows, best] >= (1 - MARGIN) * model)
        picked: np.ndarray = _COMBOS[np.where(keep_model, _MODEL_ONLY, best)]
        return picked


def _toward(gain: float, ratio: float, rate: float) -> float:
    """The gain moved toward one more ratio of actual to forecast (clipped, `GAIN_CLIP`), on a
    log scale: the error scored is absolute, and demand per step is bursty, so a forecast of
    the typical step is as often twice the demand as half of it; averaged as ratios (1 and
    1/2 against 2) those errors would raise every forecast. A step without demand counts, at
    the clip's floor."""
    r = min(max(ratio, GAIN_CLIP[0]), GAIN_CLIP[1])
    return float(gain * (r / gain) ** rate)
