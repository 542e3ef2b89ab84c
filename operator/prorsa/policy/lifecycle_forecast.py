"""Prorsa's forecaster: every live trajectory's lifecycle played forward over the horizon."""

from __future__ import annotations

import math

import numpy as np

from prorsa.policy.calibrate import LeadCalibration
from prorsa.policy.events import State
from prorsa.policy.forecast import (
    MIN_EVIDENCE,
    Forecast,
    Horizon,
    RolloutMode,
    table_facts,
)
from prorsa.policy.learned import context_bins, depth_class, length_class, length_classes
from prorsa.policy.lifecycle import LifecycleTable, Rows
from prorsa.policy.stats import LogHistogram

_TURN_TABLE = 256  # continuation probabilities looked up per turn index up to this depth
_DEPTHS = np.arange(_TURN_TABLE)


class TrainerAdmission:
    """How an async trainer admits trajectories, learned from the starts and ends it causes.

    An async RL trainer keeps a window of trajectories in flight: it starts one when another
    ends, and fills its window in a burst when it begins (or grows it). Per interval this
    reports the share of ended trajectories it replaces (the smoothed ratio of starts to
    ends, at most 1, so a trainer that has stopped admitting is followed) and, while starts
    outnumber ends, the excess start rate with the seconds it is expected to go on: as long
    again as it has lasted (a burst's length is unknown; half-way is the even guess), never
    the whole horizon, which the window's limit rules out.
    """

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing  # EWMA weight of the last interval's rates
        self._prev: tuple[float, int, int] | None = None  # (time, started, ended)
        self._start_rate = 0.0
        self._end_rate = 0.0
        self._burst_since: float | None = None

    def observe(self, now: float, started: int, ended: int) -> tuple[float, float, float]:
        """(share of ends replaced, excess start rate per second, seconds it goes on)."""
        prev, self._prev = self._prev, (now, started, ended)
        if prev is None or now <= prev[0]:
            return 0.0, 0.0, 0.0
        span = now - prev[0]
        starts, ends = started - prev[1], ended - prev[2]
        a = self.smoothing
        self._start_rate += a * (starts / span - self._start_rate)
        self._end_rate += a * (ends / span - self._end_rate)
        replaced = min(1.0, self._start_rate / self._end_rate) if self._end_rate > 0 else 1.0
        if starts <= ends:
            self._burst_since = None
            return replaced, 0.0, 0.0
        if self._burst_since is None:
            self._burst_since = prev[0]
        return replaced, (starts - ends) / span, now - self._burst_since


class LifecycleForecaster:
    """Prorsa's forecaster: plays every trajectory's lifecycle forward over the horizon.

    - In a tool call (or between turns) for `e` seconds: its next prefill arrives with the
      learned tool-latency distribution conditioned on having lasted `e`, times the
      probability that another turn follows (lowered as its context nears the window agents
      stop at, `LearnedStats.window_factor`); its size is the trajectory's mean tool output.
    - Decoding for `e` seconds: it leaves decode with the learned decode-duration
      distribution (Kaplan-Meier, the running decodes censored), stretched by its GRPO
      group's length factor and conditioned on having lasted `e`; it goes on with the
      continuation learned for its turn depth and the length class of its own recent
      answers (a task's phase of long answers may be the last one), lowered as its context
      with this answer nears the window.
    - Then the cycle repeats inside the horizon: prefills enter decode after the observed
      prefill latency, stay for a duration drawn from the same distribution (continued
      memorylessly past the longest that ended) mixed over the live trajectories' groups'
      length classes, go to a tool, come back with their context grown by their output and the
      tool's, and go on as likely as contexts grown that much do (near the window, less).
    - Arrivals: none in `sync` mode (the batch is known). In `async` mode the trainer keeps
      a number of trajectories in flight: each one that ends is replaced (at the recent
      ratio of starts to ends, so a trainer that has stopped admitting is followed), and a
      burst that is filling the trainer's window (more starts than ends in the last
      interval) goes on for as long again as it has lasted so far, not for the horizon.

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
        blend: bool = False,
        min_evidence: int = MIN_EVIDENCE,
    ) -> None:
        self.mode = mode
        # Forecasts made before this many decodes ended are not scored: their errors come
        # from the evidence they lacked, and gains learned from them (a cold start's forecast
        # is far off at every lead) would distort the first trusted forecasts.
        self.min_evidence = min_evidence
        self.name = "lifecycle-blend" if blend else "lifecycle"
        self.substeps = substeps
        self.calibration = calibration  # EWMA weight of the online gains (0: off)
        # Mix in persistence at the leads where it has been the better forecast. Off for the
        # policy: it lowers the error averaged over a run, but persistence is picked in steady
        # stretches and then misses the change the allocator must see coming (README).
        self.blend = blend
        self._cal: LeadCalibration | None = None
        self.smoothing = smoothing  # weight of the previous forecast for the same steps
        self._prev_prefill: list[float] | None = None
        self._admission = TrainerAdmission()

    def forecast(self, table: LifecycleTable, now: float, horizon: Horizon) -> Forecast:
        st = table.stats
        hist, dhist = st.tool_latency, st.decode_duration
        dt, n = horizon.step_s, horizon.steps
        sub = self.substeps
        f = dt / sub
        m_bins = n * sub
        tpot = st.tpot(0.02)
        first_prompt = st.first_prompt_tokens.get(512.0)
        first_demand = st.first_prompt_demand.get(first_prompt)
        mean_tool_out = st.mean_tool_output()
        prefill_lag = st.prefill_latency_s.get(0.0)
        mu_all = st.output_len.mean if st.output_len.n > 0 else math.log(256.0)
        recompute = st.recompute_share.get(0.0)
        has_len = st.output_len.n > 0
        out_by_turn = st.tool_output_after(_DEPTHS)

        # ---- current state, one pass over the trajectories' columns ------------------------
        rows = table.live_rows()
        depth = np.minimum(rows.turn, _TURN_TABLE - 1)
        elapsed = now - rows.state_since
        idle = (rows.state == State.WAITING) | (rows.state == State.TOOL)
        decoding_now = rows.state == State.DECODE
        between = idle & (rows.turn > 0)  # in a tool call or an inferred gap
        submit_tokens = np.zeros(m_bins)  # prefill tokens submitted in fine bin m
        submit_count = np.zeros(m_bins)
        first_turns = float(np.count_nonzero(idle & (rows.turn == 0)))  # first turn not sent
        submit_tokens[0] += first_turns * first_demand
        submit_count[0] += first_turns
        prefilling_since = elapsed[rows.state == State.PREFILL]

        # Decoding: bucket by (length class, elapsed time in units of that class).
        d_depth, d_elapsed = depth[decoding_now], elapsed[decoding_now]
        d_ctx = rows.context[decoding_now].astype(np.float64)
        decoding = float(d_depth.size)
        log_len = _length_levels(table, rows, mu_all)  # each live trajectory's, log tokens
        gf = np.exp(log_len[decoding_now] - mu_all) if has_len else np.ones(d_depth.size)
        gb = length_class(gf)
        d_bin = dhist.index_array(np.maximum(d_elapsed, 0.0) / _GF_REP[gb])
        nd = dhist.bins
        dec_cells = np.bincount(gb * nd + d_bin, minlength=3 * nd).astype(np.float64)
        # the running decodes as censored durations, weighted as of their start (as learned)
        in_decode = np.bincount(d_bin, dhist.start_weights(d_elapsed), minlength=nd)
        kv_now = float(np.sum(d_ctx + d_elapsed / tpot))

        # Between turns: their next prefill, with the tool-latency distribution or a hint.
        w_depth, w_elapsed = depth[between], elapsed[between]
        own = rows.tool_out_est[between]
        w_ctx = rows.context[between].astype(np.float64)
        # after a reported tool call the trajectory has chosen to go on; otherwise it may end
        # continuation by turn depth and by the class of the trajectory's recent answers,
        # lowered near the context window agents stop at
        own_class = length_classes(rows.out_log_est, mu_all if has_len else math.nan)
        window = st.window_factors()  # per context bin
        base_after = st.p_continue_after(w_depth, own_class[between])
        p_after = base_after * window[context_bins(w_ctx)]
        p_next = np.where(rows.tool_seen[between], st.p_continue_after_tool, p_after)
        out = np.where(own < 0, out_by_turn[w_depth], 0.5 * (own + out_by_turn[w_depth]))
        hint = rows.tool_hint[between]
        hinted = ~np.isnan(hint) & (w_elapsed < np.nan_to_num(hint, nan=0.0))
        # What comes back: the tool's output, and the share of its context evicted while the
        # trajectory was away. An LRU cache keeps the contexts used most recently: what comes
        # back is whole if the tokens used since it was fit beside it. Those are read off the
        # live contexts' last uses now, by how long it will have been idle when it comes back
        # (since its last decode, which a tool call's start follows).
        idle_before = np.maximum(rows.state_since[between] - rows.idle_since[between], 0.0)
        recency, by_tokens_since = table.recency(), st.recompute_by_tokens_since.at

        def evicted(idle: np.ndarray, default: float) -> np.ndarray:
            return by_tokens_since(recency.tokens_after(now - idle), default)

        back_hinted = evicted(idle_before + np.nan_to_num(hint, nan=0.0), recompute)
        tokens = (out + back_hinted * w_ctx) * p_next
        k = ((hint[hinted] - w_elapsed[hinted]) / f).astype(np.int64)
        soon = k < m_bins
        submit_tokens += np.bincount(k[soon], tokens[hinted][soon], minlength=m_bins)
        submit_count += np.bincount(k[soon], p_next[hinted][soon], minlength=m_bins)
        nb = hist.bins
        rest = ~hinted
        t_bin = hist.index_array(np.maximum(w_elapsed[rest], 0.0))
        # the calls in flight as censored durations, weighted as of their start (as learned)
        in_tool = np.bincount(t_bin, hist.start_weights(w_elapsed[rest]), minlength=nb)

        # Today's decodes leaving in fine bin m (index m_bins: after the horizon). Past where
        # the learned durations say anything (the longest that ended, or few left at risk),
        # decodes, running or new in the chain below, end on the heavy tail: as likely as not
        # within three times as long again. (Memoryless, as long again, ended the running
        # ones sooner: a lower decode error, but the MoE search async policy lost 5-6%.)
        leave = np.zeros(m_bins + 1)
        dsurv = (
            dhist.with_heavy_tail(dhist.survival_table(in_decode.tolist(), now))
            if dhist.total > 0
            else None
        )
        if dsurv is not None:
            cells = np.flatnonzero(dec_cells)
            c_gb, c_bin = np.divmod(cells, nd)
            probs = _returns(dhist, dsurv, dhist.mid(c_bin), f / _GF_REP[c_gb], m_bins, dt)
            counts = dec_cells[cells]
            leave[:m_bins] += counts @ probs
            leave[m_bins] += float(np.sum(counts * np.maximum(0.0, 1.0 - probs.sum(axis=1))))
        elif decoding:  # nothing finished yet: assume they leave within the horizon, evenly
            leave[:m_bins] += decoding / m_bins

        # Averages for the chain below, over the trajectories it will play: those between
        # turns, and those decoding as likely as each is to leave decode within the horizon.
        # (By head count, long decodes that stay put, a task's planning phase, priced the
        # turns that cycle through the horizon, its acting phase, at their contexts.)
        w_dec = np.ones(d_depth.size)
        if dsurv is not None:
            p_cell = np.zeros(3 * nd)
            p_cell[cells] = probs.sum(axis=1)
            w_dec = p_cell[gb * nd + d_bin]
        # (its context once this answer is in: the window it may fill)
        after_answer = d_ctx + np.exp(log_len[decoding_now])
        base_decoding = st.p_continue_after(d_depth, own_class[decoding_now])
        p_decoding = base_decoding * window[context_bins(after_answer)]
        pop_n = float(w_dec.sum()) + float(w_depth.size)
        pop_cont = float((p_decoding * w_dec).sum() + p_after.sum())  # after a decode
        # Later in the horizon the same trajectories come back with more context, nearer the
        # window agents stop at: the chain's continuation as the contexts grow by `shift`.
        chain_ctx = np.concatenate((after_answer, w_ctx))
        chain_w = np.concatenate((base_decoding * w_dec, base_after))

        def chain_continue(shift: float) -> float:
            return float(chain_w @ window[context_bins(chain_ctx + shift)]) / pop_n

        chain_out = float((out_by_turn[d_depth] * w_dec).sum() + out_by_turn[w_depth].sum())
        ctx_sum = float((d_ctx * w_dec).sum() + w_ctx.sum())
        surv = hist.survival_table(in_tool.tolist(), now) if hist.total > 0 else None
        # The calls in flight that outlasted every call that ended: Kaplan-Meier is flat past
        # the longest, so they would never come back (early in a rollout, all but the first
        # to return); the heavy tail brings them back slowly. The chain's new calls keep the
        # curve: its tail there cost decode accuracy and the dense search async policy 1.7%.
        surv_in_flight = hist.with_heavy_tail(surv) if surv is not None else None
        # Before any call has ended, the calls in flight are all the evidence: none ended in
        # their total time on test, so a call is expected to last at least that long (one
        # pseudo-event over the exposure), not just as long again as it has lasted so far.
        tool_mean = float(w_elapsed[rest].sum()) if surv is None else 0.0
        # They come back with the latencies learned for the turn they precede: agents call
        # other tools as a task moves on (a first phase's quick lookups say nothing of the
        # next phase's test runs). A depth no call has returned at yet takes every depth's.
        w_class = depth_class(w_depth[rest])
        r_out, r_p, r_el = (out * p_next)[rest], p_next[rest], w_elapsed[rest]
        r_ctx, r_idle = (w_ctx * p_next)[rest], (w_ctx * p_next * idle_before)[rest]
        for c in np.unique(w_class).tolist():
            sel = w_class == c
            t_c = t_bin[sel]
            count = np.bincount(t_c, r_p[sel], minlength=nb)
            bins = np.flatnonzero(count)
            if not bins.size:
                continue
            h_c = st.tool_by_depth[c]
            if h_c.total > 0:
                in_c = np.bincount(t_c, h_c.start_weights(r_el[sel]), minlength=nb)
                h, s = h_c, h_c.with_heavy_tail(h_c.survival_table(in_c.tolist(), now))
            else:
                h, s = hist, surv_in_flight
            probs = _returns(
                h, s, h.mid(bins), np.full(bins.size, f), m_bins, dt, fallback_mean=tool_mean
            )
            submit_count += count[bins] @ probs
            submit_tokens += np.bincount(t_c, r_out[sel], minlength=nb)[bins] @ probs
            # their contexts, by how long each will have been idle when it comes back
            ctx_w = np.bincount(t_c, r_ctx[sel], minlength=nb)[bins]
            idle_w = np.bincount(t_c, r_idle[sel], minlength=nb)[bins]
            idle_now = h.mid(bins) + idle_w / np.maximum(ctx_w, 1e-9)
            back_at = idle_now[:, None] + (np.arange(m_bins) + 0.5)[None, :] * f
            submit_tokens += ctx_w @ (probs * evicted(back_at, recompute))
        replaced, burst_rate, burst_s = (
            self._admission.observe(now, table.started_total, table.ended_total)
            if self.mode == "async"
            else (0.0, 0.0, 0.0)
        )
        if burst_rate:
            k = min(m_bins, max(1, math.ceil(burst_s / f)))
            submit_count[:k] += burst_rate * f
            submit_tokens[:k] += burst_rate * f * first_demand

        # ---- the chain: submit -> (prefill lag) -> decode -> tool -> submit ... -------------
        # Continuation in the chain: the current population's average at its turn depth.
        p_cont = pop_cont / pop_n if pop_n else st.p_continue
        # A returning trajectory's prefill: its tool output plus the evicted share of its context.
        # (the evicted share by the fine bins it is away: its decode ended, its tool began)
        chain_tokens = (chain_out / pop_n if pop_n else mean_tool_out) + evicted(
            (np.arange(m_bins) + 0.5) * f, recompute
        ) * (ctx_sum / pop_n if pop_n else 0.0)
        lag = int(prefill_lag / f)
        # Those prefilling now decode once their prefill latency has passed (first come,
        # first served: the longest waiting first), as new submissions do after `lag`.
        entries = np.bincount(
            np.clip(((prefill_lag - prefilling_since) / f).astype(np.int64), 0, m_bins - 1),
            minlength=m_bins,
        ).astype(np.float64)
        # P(a new decode lasts k fine bins): the learned duration distribution (average group)
        # with the running decodes censored and the heavy tail past where it was read: the
        # first decodes to end are the short ones, and their distribution alone sends new
        # decodes back to prefill too soon.
        # The learned durations count every decode that ended, so fast cycles weigh more than
        # the trajectories living them; the chain's decodes are the live trajectories' next
        # ones: a mix of their length classes.
        if has_len and log_len.size:
            all_gb = length_class(np.exp(log_len - mu_all))
            chain_mix = np.bincount(all_gb, minlength=3) / all_gb.size
        else:
            chain_mix = np.array([0.0, 1.0, 0.0])
        # A decode entering during fine bin m starts anywhere in it, so it is still running
        # at the end of bin m+k as likely as its survival averaged over bin k (a uniform
        # start): read off the survival at eighths of a bin. (Half a bin for every decode
        # counted one far shorter than a bin, a short answer, as running at its bin's end
        # half the time, where it is so about its length over the bin's.)
        q = 8
        done_by = (
            _returns(
                dhist,
                dsurv,
                np.zeros(3),
                f / q / _GF_REP,
                m_bins * q,
                dt,
                fallback_mean=max(tpot * math.exp(mu_all), f),
            ).T
            @ chain_mix
        ).cumsum()
        s_end = 1.0 - done_by  # survival at the end of each eighth
        s_mid = 0.5 * (s_end + np.concatenate(([1.0], s_end[:-1])))
        s_bar = s_mid.reshape(m_bins, q).mean(axis=1)
        d_exit = np.maximum(np.concatenate(([1.0], s_bar[:-1])) - s_bar, 0.0)
        k0 = _returns(hist, surv, np.zeros(1), np.full(1, f), m_bins, dt, tool_mean)[0]
        exits = leave[:m_bins].copy()
        seqs_fine = np.zeros(m_bins)
        kv_per_seq = kv_now / decoding if decoding else first_prompt
        cur_seqs = decoding
        # Contexts grow as the horizon unfolds: each decode that ends adds its output, each
        # return its tool output; ended trajectories leave and (async) fresh ones start small.
        # The decoding sequences' KV follows the live population's mean context.
        out_tokens = st.decode_tokens.get(math.exp(mu_all))
        tool_tokens = chain_out / pop_n if pop_n else mean_tool_out
        pop_live = float(rows.state.size)
        pop_ctx = float(rows.context.sum())
        mean_ctx0 = pop_ctx / pop_live if pop_live else 0.0
        ctx_shift = np.zeros(m_bins)
        next_bin = lag == 0  # same-bin returns count as demand now and enter decode next bin
        for m in range(m_bins):
            if m >= lag:
                entries[m] += submit_count[m - lag]
            e_m = float(entries[m])
            if e_m:
                exits[m:] += e_m * d_exit[: m_bins - m]
            cur_seqs += e_m - float(exits[m])
            seqs_fine[m] = cur_seqs if cur_seqs > 0 else 0.0
            if pop_n and m and m % sub == 0:  # once a step, as the contexts have grown
                p_cont = chain_continue(float(ctx_shift[m - 1]))
            back = float(exits[m]) * p_cont
            new = float(exits[m]) * (1.0 - p_cont) * replaced  # async: the ended, replaced
            if pop_live > 1.0:
                ended = min(float(exits[m]) * (1.0 - p_cont), pop_live - 1.0)
                pop_ctx += float(exits[m]) * out_tokens + back * tool_tokens
                pop_ctx -= ended * pop_ctx / pop_live
                pop_live += new - ended
                pop_ctx += new * first_prompt
                ctx_shift[m] = pop_ctx / pop_live - mean_ctx0
            if new and m + 1 < m_bins:
                submit_count[m + 1] += new
                submit_tokens[m + 1] += new * first_demand
            if back:
                w = back * k0[: m_bins - m]
                submit_tokens[m:] += w * chain_tokens[: m_bins - m]
                if next_bin and m + 1 < m_bins:
                    submit_count[m + 1] += w[0]
                    submit_count[m + 1 :] += w[1:]
                else:
                    submit_count[m:] += w

        prefill = (submit_tokens.reshape(n, sub).sum(axis=1) / dt).tolist()
        seqs = seqs_fine[sub - 1 :: sub].tolist()
        kv_seq = np.maximum(kv_per_seq + ctx_shift[sub - 1 :: sub], 1.0)
        cal = self._calibration(horizon)
        last = cal.observe(now, table.submitted_tokens_total, table.count(State.DECODE))
        raw_p, raw_s = prefill, seqs
        # Successive forecasts overlap: blend with the previous one for the same future steps,
        # which damps the noise of counting individual trajectories.
        if self._prev_prefill is not None and len(self._prev_prefill) == n and self.smoothing > 0:
            w_prev = self.smoothing
            old = self._prev_prefill[1:] + self._prev_prefill[-1:]
            prefill = [(1 - w_prev) * x + w_prev * y for x, y in zip(prefill, old, strict=True)]
        self._prev_prefill = prefill
        prefill = [x * g for x, g in zip(prefill, cal.gain_p, strict=True)]
        seqs = [x * g for x, g in zip(seqs, cal.gain_d, strict=True)]
        prefill, seqs = cal.combine(
            now, raw_p, raw_s, prefill, seqs, last, mix=self.blend,
            score=st.decode_duration.n >= self.min_evidence,
        )  # fmt: skip
        # Before the statistics rest on evidence, the returning turns' prefill is the priors'
        # (continuation, tool output, decode length) more than anything measured, and so is
        # when the running decodes end (the first to end are the short ones): until
        # `min_evidence` decodes have ended, shrink both toward persistence in proportion.
        need = self.min_evidence
        trust = min(1.0, st.decode_duration.n / need) if need > 0 else 1.0
        if trust < 1.0:
            prefill = [trust * x + (1.0 - trust) * last[0] for x in prefill]
            seqs = [trust * x + (1.0 - trust) * last[1] for x in seqs]
        kv = [x * k for x, k in zip(seqs, kv_seq.tolist(), strict=True)]
        return Forecast(dt, prefill, seqs, kv, **table_facts(table))

    def _calibration(self, horizon: Horizon) -> LeadCalibration:
        cal = self._cal
        if cal is None or cal.steps != horizon.steps or cal.step_s != horizon.step_s:
            cal = LeadCalibration(horizon.steps, horizon.step_s, gain_rate=self.calibration)
            self._cal = cal
        return cal


def _length_levels(table: LifecycleTable, rows: Rows, mu_all: float) -> np.ndarray:
    """Each live trajectory's expected log answer length: its GRPO group's mean (shrunk to
    the overall mean). Its own recent answers are left out here: stretching a running
    decode by them cost the policy (MoE search async 1.287x to 1.221x colocated)."""
    log_means = table.group_log_means()
    g = rows.group
    out: np.ndarray = np.where(
        g >= 0, log_means[np.maximum(g, 0)] if log_means.size else mu_all, mu_all
    )
    return out


_GF_REP = np.array([0.5, 1.0, 2.0])  # representative length factor of short / average / long groups


def _returns(
    hist: LogHistogram,
    surv: list[float] | None,
    elapsed: np.ndarray,
    width: np.ndarray,
    m_bins: int,
    dt: float,
    fallback_mean: float = 0.0,
) -> np.ndarray:
    """Row r, column m: P(a duration ends in fine bin m of width `width[r]` | it has lasted
    `elapsed[r]`)."""
    steps = np.arange(m_bins + 1)
    out = np.empty((elapsed.size, m_bins))
    s0 = hist.survival_array(elapsed, surv) if surv is not None else np.zeros(elapsed.size)
    seen = s0 > 1e-4
    if seen.any():
        assert surv is not None
        t = elapsed[seen, None] + width[seen, None] * steps[None, 1:]
        cur = hist.survival_array(t, surv) / s0[seen, None]
        prev = np.concatenate([np.ones((cur.shape[0], 1)), cur[:, :-1]], axis=1)
        out[seen] = np.maximum(prev - cur, 0.0)
    if not seen.all():  # beyond anything seen (or nothing seen yet): memoryless
        mean = np.maximum(np.maximum(elapsed[~seen], fallback_mean), dt)
        tail = np.exp(-steps[None, :] * width[~seen, None] / mean[:, None])
        out[~seen] = tail[:, :-1] - tail[:, 1:]
    return out
