"""Learn a cluster's real capacity online: a prior corrected by what its workers report.

The allocator prices splits with a `RoleCapacity`; a datasheet preset describes hardware and
engine flags the cluster may not have. This estimator starts from a prior (a preset, or the
local runner's calibration) and corrects it as evidence arrives, with its uncertainty:

- prefill seconds = c0 + tokens x (c1 + c2 x context)         features (1, n, n x ctx)
- decode step seconds = base + per_seq x batch + per_kv x kv + slow x local
                                                    features (1, batch, kv, local)
  where `local` is the seconds the prefill tokens a decode worker computed itself per step
  (appends to contexts it holds: every sequence of the step waits for them) take at the
  local prefill rate assumed so far (the prior's, scaled as the prefill pool's rate is
  learned), and `slow` (prior 1) is how much slower they run inside decode steps than that.

Each is a Bayesian linear regression: the prior is a Gaussian around the preset's coefficients
(relative width `prior_rel_sd`), the evidence decays with a half-life (a cluster's load and
flags change), and a sample far from the current fit is down-weighted (Huber), so one stalled
request or a slow worker does not drag the fit. KV capacity is the smallest a decode worker
reports; a switch costs what completed switches took, smoothed. Pure code: the simulator, the
local runner and the operator feed it through their adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from prorsa.policy.capacity import PREFILL_QUOTED_TOKENS, RoleCapacity

# A window's mean over n events (a worker's metrics between two reads) counts n / (n + N) of a
# full sample: its variance is the window-to-window spread plus the per-event jitter over n,
# taken here as N times that spread. A window of a few steps (a decode worker that was
# mostly idle) then teaches little; one of hundreds counts in full.
WINDOW_STEPS = 32.0
WINDOW_REQUESTS = 4.0


def _window_weight(events: float | None, half: float) -> float:
    if events is None:
        return 1.0  # one measured event, or a caller that does not say
    return max(events, 0.0) / (max(events, 0.0) + half)


@dataclass
class _Fit:
    """Bayesian linear regression with a Gaussian prior, decaying evidence, Huber weights."""

    prior: np.ndarray  # prior mean of the coefficients
    prior_sd: np.ndarray  # and its standard deviation
    noise_rel: float  # a sample's noise, relative to its prediction
    half_life_s: float
    xtx: np.ndarray = field(init=False)
    xty: np.ndarray = field(init=False)
    weight: float = 0.0  # decayed sum of sample weights (the evidence)
    last_t: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        k = len(self.prior)
        self.xtx = np.zeros((k, k))
        self.xty = np.zeros(k)

    def _decay(self, now: float) -> None:
        if now > self.last_t and self.half_life_s > 0:
            f = 0.5 ** ((now - self.last_t) / self.half_life_s)
            self.xtx *= f
            self.xty *= f
            self.weight *= f
        self.last_t = max(self.last_t, now)

    def coef(self) -> np.ndarray:
        p0 = np.diag(1.0 / self.prior_sd**2)
        theta: np.ndarray = np.linalg.solve(p0 + self.xtx, p0 @ self.prior + self.xty)
        return theta

    def cov(self) -> np.ndarray:
        inv: np.ndarray = np.linalg.inv(np.diag(1.0 / self.prior_sd**2) + self.xtx)
        return inv

    def add(self, x: np.ndarray, y: float, now: float, weight: float = 1.0) -> None:
        """One sample; `weight` (0-1]: how much of a full sample it is."""
        if not (math.isfinite(y) and y > 0 and np.all(np.isfinite(x)) and weight > 0):
            return  # nothing to learn from a broken report
        self._decay(now)
        pred = max(float(x @ self.coef()), 1e-9)
        sd = self.noise_rel * pred  # noise grows with the quantity measured
        r = abs(y - pred) / sd
        huber = weight * (1.0 if r <= 2.0 else 2.0 / r)  # far samples count less
        w = huber / (sd * sd)
        self.xtx += w * np.outer(x, x)
        self.xty += w * x * y
        self.weight += huber
        self.n += 1


@dataclass
class _Mean:
    """The mean of the last ~`window` values of a few quantities (an exponential average)."""

    width: int
    window: float = 50.0
    mean: tuple[float, ...] = ()
    n: int = 0

    def add(self, values: tuple[float, ...]) -> None:
        self.n += 1
        a = 1.0 / min(self.n, self.window)
        self.mean = tuple(m + a * (v - m) for m, v in zip(self.mean, values, strict=True))

    def __post_init__(self) -> None:
        self.mean = (0.0,) * self.width


def _sd(values: np.ndarray, rel: float, floor: np.ndarray) -> np.ndarray:
    sd: np.ndarray = np.maximum(np.abs(values) * rel, floor)
    return sd


@dataclass
class CapacityEstimator:
    """The allocator's capacity, learned: `capacity()` is the current estimate."""

    prior: RoleCapacity
    prior_rel_sd: float = 0.5  # how far the prior may be off (0.5: +-50% is one sd)
    noise_rel: float = 0.15  # one sample's noise relative to its value
    half_life_s: float = 1800.0
    _prefill: _Fit = field(init=False)
    _decode: _Fit = field(init=False)
    _kv: dict[str, float] = field(default_factory=dict, init=False)
    _switch_s: float | None = field(default=None, init=False)
    switches_seen: int = field(default=0, init=False)
    # where the evidence was measured: running means of what each fit saw (a fit is only
    # known near its evidence; elsewhere it is the prior's shape)
    _prefill_at: _Mean = field(default_factory=lambda: _Mean(2), init=False)
    _decode_at: _Mean = field(default_factory=lambda: _Mean(3), init=False)

    def __post_init__(self) -> None:
        p = self.prior
        per_token = 1.0 / p.prefill_tokens_per_s
        c2 = p.prefill_s_per_token_per_context
        c0 = p.prefill_s(0.0, p.prefill_context)  # the prior's fixed cost per request
        c1 = max(per_token - c0 / PREFILL_QUOTED_TOKENS - c2 * p.prefill_context, 0.1 * per_token)
        mu = np.array([c0, c1, c2])
        quoted_s = PREFILL_QUOTED_TOKENS * per_token
        floor = np.array([0.05 * quoted_s, 0.1 * per_token, 0.1 * per_token / 8192])
        self._prefill = _Fit(mu, _sd(mu, self.prior_rel_sd, floor), self.noise_rel,
                             self.half_life_s)  # fmt: skip
        mu = np.array([p.decode_base_step_s, p.decode_s_per_seq, p.decode_s_per_kv_token, 1.0])
        floor = np.array([0.1 * p.decode_base_step_s, 0.1 * p.decode_base_step_s / 64,
                          0.1 * p.decode_base_step_s / 1e6, 0.1])  # fmt: skip
        self._decode = _Fit(mu, _sd(mu, self.prior_rel_sd, floor), self.noise_rel,
                            self.half_life_s)  # fmt: skip

    # ---- evidence -----------------------------------------------------------------------------

    def _age(self, now: float) -> None:
        self._prefill._decay(now)
        self._decode._decay(now)

    def observe_prefill(self, tokens: float, context: float, seconds: float, now: float,
                        requests: float | None = None) -> None:  # fmt: skip
        """One prefill that computed `tokens` new tokens over `context` cached ones (or a
        window's mean prefill over `requests` of them)."""
        self._age(now)
        if tokens > 0:
            x = np.array([1.0, tokens, tokens * context])
            self._prefill.add(x, seconds, now, _window_weight(requests, WINDOW_REQUESTS))
            self._prefill_at.add((tokens, context))

    def observe_decode_step(self, batch: float, kv_tokens: float, seconds: float,
                            now: float, steps: float | None = None,
                            local_tokens: float = 0.0) -> None:  # fmt: skip
        """A decode step (or a window's mean over `steps` steps) at `batch` sequences holding
        `kv_tokens`, carrying `local_tokens` prefill tokens the worker computed itself (per
        step)."""
        self._age(now)
        if batch > 0:
            weight = _window_weight(steps, WINDOW_STEPS)
            # (the rate is a solve of the prefill fit: only where there is something to price)
            local_s = local_tokens / self._assumed_local_rate() if local_tokens > 0 else 0.0
            self._decode.add(np.array([1.0, batch, kv_tokens, local_s]), seconds, now, weight)
            self._decode_at.add((batch, kv_tokens, max(local_tokens, 0.0)))

    def observe_kv_capacity(self, worker: str, tokens: float) -> None:
        """What a decode worker's engine allocated (cache blocks x block size)."""
        if tokens > 0 and math.isfinite(tokens):
            self._kv[worker] = tokens

    def forget_worker(self, worker: str) -> None:
        self._kv.pop(worker, None)

    def observe_switch(self, extra_s: float) -> None:
        """Seconds a completed switch took beyond its drain (an engine restart, if any)."""
        if extra_s >= 0 and math.isfinite(extra_s):
            self.switches_seen += 1
            prev = self._switch_s if self._switch_s is not None else self.prior.switch_s
            self._switch_s = prev + (extra_s - prev) / min(self.switches_seen, 5)

    # ---- the estimate -------------------------------------------------------------------------

    def _prefill_rate(self) -> float:
        """The learned prefill rate, quoted as `RoleCapacity.prefill_tokens_per_s` is."""
        c0, c1, c2 = self._prefill.coef()
        per_token = max(c1, 1e-12) + max(c2, 0.0) * self.prior.prefill_context
        return float(PREFILL_QUOTED_TOKENS / (max(c0, 0.0) + PREFILL_QUOTED_TOKENS * per_token))

    def _assumed_local_rate(self) -> float:
        """The local prefill rate before the decode steps' own evidence: the prior's, scaled
        like the pool's learned rate (the decode fit's `slow` is relative to it)."""
        p = self.prior
        return p.local_prefill_rate * self._prefill_rate() / p.prefill_tokens_per_s

    def _local_slowdown(self) -> float:
        """How much slower a decode worker's own prefills run inside its steps (`slow`)."""
        return max(float(self._decode.coef()[3]), 0.1)

    def capacity(self) -> RoleCapacity:
        p = self.prior
        c0, _, c2 = self._prefill.coef()
        c2 = max(c2, 0.0)
        prefill = self._prefill_rate()
        base, per_seq, per_kv, _ = self._decode.coef()
        # local prefill scales like the pool's, and runs `slow` times slower inside decode steps
        speed = prefill / p.prefill_tokens_per_s / self._local_slowdown()
        return replace(
            p,
            prefill_tokens_per_s=prefill,
            prefill_s_per_token_per_context=c2,
            prefill_request_s=max(c0, 0.0),
            decode_base_step_s=max(base, 1e-6),
            decode_s_per_seq=max(per_seq, 0.0),
            decode_s_per_kv_token=max(per_kv, 0.0),
            kv_capacity_tokens=min(self._kv.values()) if self._kv else p.kv_capacity_tokens,
            switch_s=self._switch_s if self._switch_s is not None else p.switch_s,
            local_prefill_tokens_per_s=p.local_prefill_rate * speed,
            local_prefill_rank_tokens_per_s=p.local_prefill_rank_tokens_per_s * speed,
            local_prefill_rank_s_per_token_per_context=p.local_prefill_rank_s_per_token_per_context
            / speed,
        )

    def evidence(self) -> dict[str, float]:
        """How much the estimate rests on: decayed sample counts and relative uncertainty of
        the prefill rate and of a typical decode step (1 sd)."""
        p = self.prior
        x = np.array([1.0, PREFILL_QUOTED_TOKENS, PREFILL_QUOTED_TOKENS * p.prefill_context])
        pre = float(x @ self._prefill.coef())
        pre_sd = math.sqrt(max(float(x @ self._prefill.cov() @ x), 0.0))
        batch = 64.0
        y = np.array([1.0, batch, batch * p.prefill_context, 0.0])
        dec = float(y @ self._decode.coef())
        dec_sd = math.sqrt(max(float(y @ self._decode.cov() @ y), 0.0))
        return {
            "prefill_samples": self._prefill.weight,
            "decode_samples": self._decode.weight,
            "prefill_rel_sd": pre_sd / pre if pre > 0 else math.inf,
            "decode_rel_sd": dec_sd / dec if dec > 0 else math.inf,
            "kv_workers": float(len(self._kv)),
            "switches": float(self.switches_seen),
            "prefill_tokens_seen": self._prefill_at.mean[0],
            "prefill_context_seen": self._prefill_at.mean[1],
            "decode_batch_seen": self._decode_at.mean[0],
            "decode_kv_seen": self._decode_at.mean[1],
            "decode_local_tokens_seen": self._decode_at.mean[2],
            "local_prefill_slowdown": self._local_slowdown(),
        }
