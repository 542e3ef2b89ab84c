"""Demand forecasters: what prefill and decode will need over the next horizon.

Every forecaster answers the same question from the lifecycle table: for each step of the
horizon, how many prefill tokens per second will be submitted, and how many sequences (and KV
tokens) will be decoding at the end of the step. `last` and `ewma` extrapolate the recent
past; `lifecycle` (Prorsa) reasons per trajectory about when tool calls return and when
decodes finish. `ForecastScorer` measures each one's error against what actually happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from prorsa.policy.lifecycle import LifecycleTable, State
from prorsa.policy.stats import LogHistogram

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
    mean_decode_s: float = 1.0  # one decode request, queueing included (a switch drains this)
    evidence: float = 0.0  # completed decodes the statistics behind this forecast have seen

    @classmethod
    def flat(
        cls, horizon: Horizon, prefill_rate: float, seqs: float, kv: float, **kw: float
    ) -> Forecast:
        n = horizon.steps
        return cls(horizon.step_s, [prefill_rate] * n, [seqs] * n, [kv] * n, **kw)


class Forecaster(Protocol):
    name: str

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast: ...


def _common(table: LifecycleTable) -> dict[str, float]:
    st = table.stats
    mean_req = st.tool_output_tokens.get(st.first_prompt_tokens.get(512.0))
    return {
        "prefill_backlog_tokens": float(table.prefill_backlog_tokens),
        "mean_prefill_tokens": max(mean_req, 1.0),
        "decode_s_per_token": st.tpot(0.02),
        "remote_prefill_share": st.remote_share.get(1.0),
        "mean_decode_s": st.decode_s.get(1.0),
        "evidence": float(st.decode_duration.n),
    }


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
        return Forecast.flat(horizon, rate, seqs, kv, **_common(table))


class EwmaForecaster(LastValueForecaster):
    """Smoothed recent past (like NVIDIA Dynamo's load predictor with a moving average)."""

    name = "ewma"

    def __init__(self, alpha: float = 0.3) -> None:
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
        return Forecast.flat(horizon, self._rate, self._seqs, self._kv, **_common(table))


_TURN_TABLE = 256  # continuation probabilities looked up per turn index up to this depth


class LifecycleForecaster:
    """Prorsa's forecaster: plays every trajectory's lifecycle forward over the horizon.

    - In a tool call (or between turns) for `e` seconds: its next prefill arrives with the
      learned tool-latency distribution conditioned on having lasted `e`, times the
      probability that another turn follows; its size is the trajectory's mean tool output.
    - Decoding: it leaves decode after its remaining output, estimated from its GRPO group's
      output lengths (log-normal, conditioned on what it has generated so far).
    - Then the cycle repeats inside the horizon: prefills enter decode after the observed
      prefill latency, stay for a log-normal output length, go to a tool, come back.
    - Arrivals: none in `sync` mode (the batch is known); the recent start rate in `async`.

    The chain runs on a grid `substeps` times finer than the horizon step, so agent turns
    shorter than a step are followed rather than averaged away.
    """

    name = "lifecycle"

    def __init__(
        self,
        mode: RolloutMode = "sync",
        substeps: int = 4,
        calibration: float = 0.2,
        smoothing: float = 0.5,
    ) -> None:
        self.mode = mode
        self.substeps = substeps
        self.calibration = calibration  # EWMA weight of the online correction (0: off)
        self._gain_p: list[float] = []
        self._gain_d: list[float] = []
        self._past: list[tuple[float, list[float], list[float]]] = []
        self._seen: list[tuple[float, int, int]] = []
        self.smoothing = smoothing  # weight of the previous forecast for the same steps
        self._prev_prefill: list[float] | None = None
        self._prev_started: tuple[float, int] | None = None
        self._arrival_rate = 0.0

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast:
        st = table.stats
        hist = st.tool_latency
        dt, n = horizon.step_s, horizon.steps
        sub = self.substeps
        f = dt / sub
        m_bins = n * sub
        tpot = st.tpot(0.02)
        p_cont = st.p_continue
        mean_tool_out = st.tool_output_tokens.get(st.first_prompt_tokens.get(512.0))
        first_prompt = st.first_prompt_tokens.get(512.0)
        prefill_lag = st.prefill_latency_s.get(0.0)
        mu_all = st.output_len.mean if st.output_len.n > 0 else math.log(256.0)
        surv: list[float] | None = None  # set after the pass below (needs censored counts)

        def tool_returns(elapsed: float) -> list[float]:
            """P(return in fine bin m | the call has lasted `elapsed`)."""
            return _returns(hist, surv, elapsed, f, m_bins, dt)

        # ---- current state, one pass over the trajectories ----------------------------------
        nb = hist.bins
        bin_tokens = [0.0] * nb
        bin_count = [0.0] * nb
        in_tool = [0.0] * nb  # calls still running, by elapsed bin (censored durations)
        submit_tokens = [0.0] * m_bins  # prefill tokens submitted in fine bin m
        submit_count = [0.0] * m_bins
        leave = [0.0] * (m_bins + 1)  # today's decodes leaving in bin m (m_bins: later)
        prefilling = 0.0
        decoding = 0.0
        kv_now = 0.0
        hindex = hist.index
        p_by_turn = [st.p_continue_after(k) for k in range(_TURN_TABLE)]
        out_by_turn = [st.tool_output_after(k) for k in range(_TURN_TABLE)]
        chain_out = 0.0
        recompute = st.recompute_share.get(0.0)
        ctx_sum = ctx_n = 0.0
        group_gf: dict[str | None, float] = {}
        dhist = st.decode_duration
        dindex = dhist.index
        dec_cells = [0.0] * (3 * dhist.bins)  # decoding now, by (group length class, elapsed bin)
        in_decode = [0.0] * dhist.bins
        pop_cont = pop_n = 0.0
        exp = math.exp
        for t in table.trajs.values():
            s = t.state
            if s == State.DECODE:
                pop_cont += p_by_turn[t.turn if t.turn < _TURN_TABLE else _TURN_TABLE - 1]
                pop_n += 1.0
                elapsed = now - t.state_since
                gf = group_gf.get(t.group)
                if gf is None:
                    gf = group_gf[t.group] = table.group_factor(t.group)
                gb = 0 if gf < 0.7 else (1 if gf < 1.4 else 2)
                b = dindex(elapsed / _GF_REP[gb]) if elapsed > 0 else 0
                dec_cells[gb * nb + b] += 1.0
                in_decode[b] += 1.0
                decoding += 1.0
                chain_out += out_by_turn[t.turn if t.turn < _TURN_TABLE else _TURN_TABLE - 1]
                kv_now += t.context_tokens + elapsed / tpot
                ctx_sum += t.context_tokens
                ctx_n += 1.0
            elif s == State.PREFILL:
                prefilling += 1.0
            elif t.turn == 0:  # started, first turn not submitted yet
                submit_tokens[0] += first_prompt
                submit_count[0] += 1.0
            else:  # between turns: in a tool call or an inferred gap
                elapsed = now - t.state_since
                own = t.mean_tool_output
                depth = t.turn if t.turn < _TURN_TABLE else _TURN_TABLE - 1
                p_next = p_by_turn[depth]
                out = out_by_turn[depth] if own is None else 0.5 * (own + out_by_turn[depth])
                ctx = t.context_tokens
                ctx_sum += ctx
                ctx_n += 1.0
                chain_out += out_by_turn[depth]
                tokens = (out + recompute * ctx) * p_next
                pop_cont += p_next
                pop_n += 1.0
                hint = t.tool_hint
                if hint is not None and elapsed < hint:
                    k = int((hint - elapsed) / f)
                    if k < m_bins:
                        submit_tokens[k] += tokens
                        submit_count[k] += p_next
                    continue
                b = hindex(elapsed) if elapsed > 0 else 0
                bin_tokens[b] += tokens
                bin_count[b] += p_next
                in_tool[b] += 1.0
        if dhist.total > 0:
            dsurv = dhist.survival_table(in_decode, now)
            for cell, count in enumerate(dec_cells):
                if count:
                    gb, b = divmod(cell, dhist.bins)
                    probs = _returns(dhist, dsurv, _bin_mid(dhist, b), f / _GF_REP[gb], m_bins, dt)
                    for m in range(m_bins):
                        leave[m] += count * probs[m]
                    leave[m_bins] += count * max(0.0, 1.0 - sum(probs))
        elif decoding:  # nothing finished yet: assume they leave within the horizon, evenly
            for m in range(m_bins):
                leave[m] += decoding / m_bins
        if hist.total > 0:
            surv = hist.survival_table(in_tool, now)
        for b in range(nb):
            if bin_count[b]:
                probs = tool_returns(_bin_mid(hist, b))
                ct, tk = bin_count[b], bin_tokens[b]
                for m in range(m_bins):
                    submit_count[m] += ct * probs[m]
                    submit_tokens[m] += tk * probs[m]
        arrivals = self._arrivals(table, now) * f
        if arrivals:
            for m in range(m_bins):
                submit_count[m] += arrivals
                submit_tokens[m] += arrivals * first_prompt

        # ---- the chain: submit -> (prefill lag) -> decode -> tool -> submit ... -------------
        # Continuation in the chain: the current population's average at its turn depth.
        p_cont = pop_cont / pop_n if pop_n else p_cont
        # A returning trajectory's prefill: its tool output plus the evicted share of its context.
        chain_tokens = (chain_out / ctx_n if ctx_n else mean_tool_out) + recompute * (
            ctx_sum / ctx_n if ctx_n else 0.0
        )
        lag = int(prefill_lag / f)
        spread = max(1, 2 * lag + 1)
        entries = [0.0] * m_bins
        for m in range(min(spread, m_bins)):
            entries[m] += prefilling / spread
        # P(a new decode lasts k fine bins): the learned duration distribution (average group)
        d_exit = _returns(
            dhist,
            dhist.survival_table() if dhist.total > 0 else None,
            0.0,
            f,
            m_bins,
            dt,
            fallback_mean=max(tpot * exp(mu_all), f),
        )
        k0 = tool_returns(0.0)
        exits = leave[:m_bins]
        seqs_fine = [0.0] * m_bins
        kv_per_seq = kv_now / decoding if decoding else first_prompt
        cur_seqs = decoding
        for m in range(m_bins):
            if m >= lag:
                entries[m] += submit_count[m - lag]
            e_m = entries[m]
            if e_m:
                for k in range(m_bins - m):
                    exits[m + k] += e_m * d_exit[k]
            cur_seqs += e_m - exits[m]
            seqs_fine[m] = cur_seqs if cur_seqs > 0 else 0.0
            back = exits[m] * p_cont
            if back:  # same-bin returns count as demand now and enter decode next bin
                for r in range(m_bins - m):
                    w = back * k0[r]
                    j = m + 1 if r == 0 and lag == 0 and m + 1 < m_bins else m + r
                    submit_count[j] += w
                    submit_tokens[m + r] += w * chain_tokens

        prefill = [sum(submit_tokens[h * sub : (h + 1) * sub]) / dt for h in range(n)]
        seqs = [seqs_fine[(h + 1) * sub - 1] for h in range(n)]
        kv = [x * kv_per_seq for x in seqs]
        gain_p, gain_d = self._calibrate(table, now, horizon, prefill, seqs)
        # Successive forecasts overlap: blend with the previous one for the same future steps,
        # which damps the noise of counting individual trajectories.
        if self._prev_prefill is not None and len(self._prev_prefill) == n and self.smoothing > 0:
            w = self.smoothing
            old = self._prev_prefill[1:] + self._prev_prefill[-1:]
            prefill = [(1 - w) * x + w * y for x, y in zip(prefill, old, strict=True)]
        self._prev_prefill = prefill
        prefill = [x * g for x, g in zip(prefill, gain_p, strict=True)]
        seqs = [x * g for x, g in zip(seqs, gain_d, strict=True)]
        kv = [x * g for x, g in zip(kv, gain_d, strict=True)]
        return Forecast(dt, prefill, seqs, kv, **_common(table))

    def _calibrate(
        self,
        table: LifecycleTable,
        now: float,
        horizon: Horizon,
        prefill: list[float],
        seqs: list[float],
    ) -> tuple[list[float], list[float]]:
        """Online calibration per lead time: once step h of an earlier forecast has happened,
        compare it with what did, and scale today's step h by the running ratio. It removes
        the systematic error the model misses (an unseen phase change, a cache regime)."""
        n, dt = horizon.steps, horizon.step_s
        if len(self._gain_p) != n:
            self._gain_p, self._gain_d = [1.0] * n, [1.0] * n
            self._past = []
        self._seen.append((now, table.submitted_tokens_total, table.count(State.DECODE)))
        self._seen = [x for x in self._seen if x[0] >= now - horizon.seconds - 2 * dt]
        keep = []
        a = self.calibration
        for t0, fp, fs in self._past:
            h = round((now - t0) / dt) - 1  # step h of that forecast ended now
            if 0 <= h < n:
                start = min(self._seen, key=lambda x: abs(x[0] - (now - dt)))
                if abs(start[0] - (now - dt)) < dt / 2:
                    rate = (table.submitted_tokens_total - start[1]) / (now - start[0])
                    if fp[h] > 0 and rate > 0:
                        r = min(max(rate / fp[h], 0.5), 2.0)
                        self._gain_p[h] += a * (r - self._gain_p[h])
                    decoding = table.count(State.DECODE)
                    if fs[h] > 0 and decoding > 0:
                        r = min(max(decoding / fs[h], 0.5), 2.0)
                        self._gain_d[h] += a * (r - self._gain_d[h])
            if h < n - 1:
                keep.append((t0, fp, fs))
        keep.append((now, prefill, seqs))
        self._past = keep
        return self._gain_p, self._gain_d

    def _arrivals(self, table: LifecycleTable, now: float) -> float:
        prev, self._prev_started = self._prev_started, (now, table.started_total)
        if self.mode == "sync" or prev is None or now <= prev[0]:
            return 0.0
        rate = (table.started_total - prev[1]) / (now - prev[0])
        self._arrival_rate += 0.3 * (rate - self._arrival_rate)
        return self._arrival_rate


_GF_REP = (0.5, 1.0, 2.0)  # representative length factor of short / average / long groups


def _bin_mid(hist: LogHistogram, b: int) -> float:
    return hist.lo * 0.5 if b == 0 else hist.edge(b - 1) * math.sqrt(hist.ratio)


def _returns(
    hist: LogHistogram,
    surv: list[float] | None,
    elapsed: float,
    f: float,
    m_bins: int,
    dt: float,
    fallback_mean: float = 0.0,
) -> list[float]:
    """P(the duration ends in fine bin m of width `f` | it has lasted `elapsed`)."""
    out = [0.0] * m_bins
    s0 = hist.survival(elapsed, surv) if surv is not None else 0.0
    if surv is not None and s0 > 1e-4:
        prev = 1.0
        for m in range(m_bins):
            cur = hist.survival(elapsed + (m + 1) * f, surv) / s0
            out[m] = max(prev - cur, 0.0)
            prev = cur
    else:  # beyond anything seen (or nothing seen yet): memoryless
        mean = max(elapsed, fallback_mean, dt)
        for m in range(m_bins):
            out[m] = math.exp(-m * f / mean) - math.exp(-(m + 1) * f / mean)
    return out


FORECASTERS = {
    "last": LastValueForecaster,
    "ewma": EwmaForecaster,
    "lifecycle": LifecycleForecaster,
}


def make_forecaster(name: str, mode: RolloutMode = "sync") -> Forecaster:
    if name == "lifecycle":
        return LifecycleForecaster(mode)
    if name == "last":
        return LastValueForecaster()
    if name == "ewma":
        return EwmaForecaster()
    raise ValueError(f"unknown forecaster {name!r}; choose one of {sorted(FORECASTERS)}")


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
        return {
            k: (100.0 * self.abs_err[k] / self.actual_sum[k]) if self.actual_sum[k] else 0.0
            for k in self.abs_err
        }
