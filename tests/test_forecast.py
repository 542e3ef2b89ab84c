from __future__ import annotations

import numpy as np
import pytest

from conftest import fill_windows, turn
from prorsa.policy.calibrate import LeadCalibration
from prorsa.policy.events import Event, EventType
from prorsa.policy.forecast import Forecast, ForecastScorer, Horizon
from prorsa.policy.forecasters import EwmaForecaster, LastValueForecaster, make_forecaster
from prorsa.policy.lifecycle import LifecycleTable, State
from prorsa.policy.lifecycle_forecast import LifecycleForecaster, TrainerAdmission

H = Horizon(step_s=5.0, steps=12)


def submit(traj: str, ts: float, tokens: int) -> Event:
    return Event(EventType.TURN_SUBMIT, traj, ts, prompt_tokens=tokens, uncached_tokens=tokens)


def test_last_value_is_the_last_intervals_rate() -> None:
    tab = LifecycleTable()
    f = LastValueForecaster()
    f.forecast(tab, 0.0, H)
    tab.ingest([submit(f"t{i}", 1.0, 1000) for i in range(10)])
    fc = f.forecast(tab, 5.0, H)
    assert fc.prefill_tokens_per_s == [2000.0] * 12


def test_ewma_smooths_a_spike() -> None:
    tab = LifecycleTable()
    f = EwmaForecaster(alpha=0.5)
    f.forecast(tab, 0.0, H)
    f.forecast(tab, 5.0, H)  # rate 0
    tab.ingest([submit(f"t{i}", 6.0, 1000) for i in range(10)])
    fc = f.forecast(tab, 10.0, H)
    assert fc.prefill_tokens_per_s[0] == pytest.approx(1000.0)


def _teach(tab: LifecycleTable, n: int, out: int, tool_s: float) -> None:
    """Finished trajectories that teach: outputs of `out` tokens at 10 ms/token, tools of
    `tool_s` seconds, two turns then the end."""
    for i in range(n):
        tid = f"hist{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, 0.0, group=f"hg{i}"))
        tab.ingest(turn(tid, 0.0, 500, 500, out, decode_s=out * 0.01))
        t1 = 0.1 + out * 0.01
        tab.apply(Event(EventType.TOOL_START, tid, t1))
        tab.apply(Event(EventType.TOOL_END, tid, t1 + tool_s))
        tab.ingest(turn(tid, t1 + tool_s, 1500, 500, out, decode_s=out * 0.01))
        tab.apply(Event(EventType.TRAJ_END, tid, t1 + tool_s + 1 + out * 0.01))


def test_lifecycle_sees_decodes_finishing() -> None:
    tab = LifecycleTable()
    _teach(tab, 200, out=1000, tool_s=20.0)  # decodes last ~10 s, tools 20 s
    now = 100.0
    for i in range(100):  # 100 second turns of fresh trajectories, just started decoding
        tid = f"live{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, now - 1, group=f"lg{i}"))
        tab.apply(submit(tid, now - 1, 500))
        tab.apply(Event(EventType.PREFILL_DONE, tid, now, tokens=500, seconds=1.0))
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    last = LastValueForecaster().forecast(tab, now, H)
    assert last.decode_seqs[-1] == 100  # the naive forecast keeps them decoding
    assert fc.decode_seqs[0] > 80  # still decoding 5 s from now
    assert fc.decode_seqs[2] < 20  # gone after ~10 s, in their tools at 15 s...
    assert max(fc.decode_seqs[6:]) > 60  # ...until the second turns come back (~30 s)


def test_contexts_grow_over_the_horizon_as_turns_come_back() -> None:
    """A decoding sequence's KV is its context: the second turns that come back ~30 s from
    now carry the first turn's 1,000 output tokens, so the KV per sequence grows with them
    (a constant KV per sequence prices a smaller decode pool as if contexts stayed short)."""
    tab = LifecycleTable()
    _teach(tab, 200, out=1000, tool_s=20.0)
    now = 100.0
    for i in range(100):
        tid = f"live{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, now - 1, group=f"lg{i}"))
        tab.apply(submit(tid, now - 1, 500))
        tab.apply(Event(EventType.PREFILL_DONE, tid, now, tokens=500, seconds=1.0))
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    assert fc.decode_seqs[0] > 80 and fc.decode_seqs[5] > 60  # first turns, then second
    per_seq = [kv / s for kv, s in zip(fc.decode_kv_tokens, fc.decode_seqs, strict=True) if s]
    assert per_seq[0] < 1000  # 500 prompt tokens and a second of output
    assert fc.decode_kv_tokens[5] / fc.decode_seqs[5] > per_seq[0] + 700  # and 1,000 more


def test_those_prefilling_decode_once_their_prefill_latency_has_passed() -> None:
    """Prefills take ~20 s here (a queue), decodes a minute: trajectories submitted 19 s
    ago decode from the next step on, those just submitted only after ~20 s."""
    tab = LifecycleTable()
    for i in range(200):
        tid = f"hist{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, 0.0))
        tab.apply(submit(tid, 0.0, 500))
        tab.apply(Event(EventType.PREFILL_DONE, tid, 20.0, tokens=500, seconds=20.0))
        tab.apply(Event(EventType.DECODE_DONE, tid, 80.0, output_tokens=6000, seconds=60.0))
        tab.apply(Event(EventType.TRAJ_END, tid, 80.5))
    now = 100.0

    def seqs(submitted_ago: float) -> list[float]:
        t = LifecycleTable()
        t.stats = tab.stats
        for i in range(50):
            t.apply(Event(EventType.TRAJ_START, f"q{i}", now - submitted_ago))
            t.apply(submit(f"q{i}", now - submitted_ago, 500))
        f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0)
        return f.forecast(t, now, H).decode_seqs

    assert seqs(19.0)[0] > 40  # decoding within the next step
    late = seqs(0.5)
    assert late[1] < 5 and max(late[3:6]) > 40  # not before ~20 s


def test_lifecycle_uses_tool_hints() -> None:
    tab = LifecycleTable()
    _teach(tab, 50, out=100, tool_s=1.0)
    now = 100.0
    for i in range(10):
        tid = f"h{i}"
        tab.ingest([Event(EventType.TRAJ_START, tid, 50.0), *turn(tid, 50.0, 2000, 2000, 100)])
        tab.apply(Event(EventType.TOOL_START, tid, now, expected_seconds=22.0))
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    busiest = max(range(12), key=lambda h: fc.prefill_tokens_per_s[h])
    assert busiest == 4  # 22 s from now is in the step [20, 25)


def test_sync_mode_expects_no_new_trajectories_async_does() -> None:
    tab = LifecycleTable()
    # the model's own forecasts, trusted without evidence (min_evidence 0)
    sync = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    asy = LifecycleForecaster("async", calibration=0.0, smoothing=0.0, min_evidence=0)
    sync.forecast(tab, 0.0, H)
    asy.forecast(tab, 0.0, H)
    for i in range(50):
        tab.apply(Event(EventType.TRAJ_START, f"n{i}", 1.0))
        tab.apply(submit(f"n{i}", 1.0, 1000))
        tab.apply(Event(EventType.PREFILL_DONE, f"n{i}", 2.0, tokens=1000, seconds=1.0))
    # 50 starts in 5 s and no end: a trainer filling its window, 10 a second for 5 s more;
    # then it keeps its window full: whatever ends is replaced by a new first prompt
    gap = [
        a - s
        for a, s in zip(
            asy.forecast(tab, 5.0, H).prefill_tokens_per_s,
            sync.forecast(tab, 5.0, H).prefill_tokens_per_s,
            strict=True,
        )
    ]
    assert gap[0] >= 10 * 1000.0  # the burst goes on through the next step...
    assert gap[1] <= gap[0] - 5 * 1000.0  # ...and not beyond it
    assert min(gap[1:]) > 0  # the ended are replaced all along


def test_an_async_trainer_replaces_what_ends_while_it_admits() -> None:
    adm = TrainerAdmission(smoothing=1.0)  # no smoothing: each interval as it was
    assert adm.observe(0.0, 0, 0) == (0.0, 0.0, 0.0)  # nothing to compare with yet
    assert adm.observe(5.0, 100, 0) == (1.0, 20.0, 5.0)  # a burst, 5 s old: 5 s more
    assert adm.observe(10.0, 200, 0) == (1.0, 20.0, 10.0)  # still filling: 10 s more
    assert adm.observe(15.0, 230, 30) == (1.0, 0.0, 0.0)  # full: one start per end
    assert adm.observe(20.0, 240, 70) == (0.25, 0.0, 0.0)  # it admits a quarter of them
    assert adm.observe(25.0, 240, 90) == (0.0, 0.0, 0.0)  # it has stopped admitting
    assert adm.observe(30.0, 300, 90) == (1.0, 12.0, 5.0)  # a new burst (a larger window)


def test_calibration_learns_the_error_at_each_lead_time() -> None:
    cal = LeadCalibration(steps=2, step_s=5.0, gain_rate=0.5)
    flat = [100.0, 100.0], [10.0, 10.0]

    def step(now: float, submitted: int, decoding: int = 10) -> None:
        last = cal.observe(now, submitted, decoding)
        cal.combine(now, *flat, *flat, last)

    step(0.0, 0)
    step(5.0, 1000)  # 200 tok/s happened where 100 were forecast
    assert cal.gain_p[0] == pytest.approx(2**0.5)  # halfway to 2x (log scale) at lead 0
    assert cal.gain_p[1] == 1.0  # lead 1 not yet known
    assert cal.gain_d == [1.0, 1.0]  # 10 decoding, as forecast
    step(10.0, 1250, decoding=0)  # 50 tok/s in the next step, and nothing decoding
    assert cal.gain_p[1] == pytest.approx(0.5**0.5)  # the first forecast's lead 1: half the rate
    assert cal.gain_d[1] == pytest.approx(0.5)  # none where 10: counted as a quarter


def _gains_over(cal: LeadCalibration, increments: list[int], cycles: int) -> list[float]:
    """Lead-0 prefill gains after each step of a forecast of 100 tok/s in every 5 s step,
    with `increments` tokens submitted in successive steps, repeated `cycles` times."""
    gains, submitted = [], 0
    for k, inc in enumerate(increments * cycles):
        submitted += inc
        last = cal.observe(5.0 * k, submitted, 0)
        cal.combine(5.0 * k, [100.0], [10.0], [100.0], [10.0], last)
        gains.append(cal.gain_p[0])
    return gains


def test_a_forecast_as_often_half_as_twice_the_demand_keeps_its_gain() -> None:
    """Prefill demand comes in bursts: a forecast of the typical step is half a burst and
    twice a lull. The gain follows actual over forecast on a log scale, so the two cancel;
    an average of the ratios (1.25 here) would raise every forecast by a quarter."""
    gains = _gains_over(LeadCalibration(steps=1, step_s=5.0), [1000, 250], 30)
    assert 0.95 < sum(gains[-10:]) / 10 < 1.05


def test_steps_without_demand_lower_the_gain() -> None:
    """A sparse stream (nothing, nothing, then a burst: 300 tok/s) averages 100 tok/s; its
    empty steps are evidence too. Learned from the bursts alone, the gain would double
    a forecast that already stands at the mean; with them it lowers it toward the typical
    step, which is what an absolute error rewards."""
    gains = _gains_over(LeadCalibration(steps=1, step_s=5.0), [0, 0, 1500], 20)
    assert max(gains[-9:]) < 1.0


def test_a_forecast_of_demand_that_has_stopped_falls_well_below_half() -> None:
    """Returns the model still expects that do not come (the agents have stopped): a step
    without demand counts at a floor of a quarter, so a dozen of them take the gain well
    below a half, where a floor of a half would have held it."""
    gains = _gains_over(LeadCalibration(steps=1, step_s=5.0), [0], 12)
    assert gains[-1] < 0.35


def test_forecasts_made_before_the_evidence_are_not_learned_from() -> None:
    """A cold start's forecast is far off at every lead; a gain learned from it would
    distort the first forecasts the policy trusts."""
    cal = LeadCalibration(steps=2, step_s=5.0, gain_rate=0.5)
    flat = [100.0, 100.0], [10.0, 10.0]
    for k, submitted in enumerate((0, 1000, 2000)):
        last = cal.observe(5.0 * k, submitted, 10)
        cal.combine(5.0 * k, *flat, *flat, last, score=False)
    assert cal.gain_p == cal.gain_d == [1.0, 1.0]
    tab = LifecycleTable()
    _teach(tab, 20, out=100, tool_s=1.0)
    for min_evidence, learned in ((1000, False), (10, True)):
        f = LifecycleForecaster("sync", min_evidence=min_evidence)
        for k in range(4):
            tab.ingest([submit(f"n{min_evidence}-{k}", 100.0 + 5 * k, 50_000)])
            f.forecast(tab, 100.0 + 5 * k, H)
        assert f._cal is not None and (f._cal.gain_p[0] != 1.0) == learned


def test_before_the_evidence_the_forecast_leans_on_persistence() -> None:
    """With no decode ended, the turns that come back are priced by the priors alone
    (continuation, tool output, decode length), and so is when the running decodes end: the
    forecast is the rate just seen and the sequences decoding now; the model takes over as
    decodes end, wholly at `min_evidence`."""

    def forecast(taught: int) -> tuple[list[float], list[float]]:
        tab = LifecycleTable()
        _teach(tab, taught, out=100, tool_s=1.0)  # two decodes each
        f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=100)
        f.forecast(tab, 100.0, H)
        for i in range(100):  # 500 tokens each in (100 s, 105 s]: 10,000 tok/s
            tab.apply(Event(EventType.TRAJ_START, f"live{i}", 101.0))
            tab.apply(submit(f"live{i}", 101.0, 500))
            tab.apply(Event(EventType.PREFILL_DONE, f"live{i}", 104.5, tokens=500, seconds=3.5))
        fc = f.forecast(tab, 105.0, H)
        return fc.prefill_tokens_per_s, fc.decode_seqs

    prefill, seqs = forecast(0)
    assert prefill == pytest.approx([10_000.0] * 12)
    assert seqs == pytest.approx([100.0] * 12)  # the 100 decoding now
    prefill, seqs = forecast(50)  # 100 decodes ended: the model's own forecast
    assert max(abs(x - 10_000.0) for x in prefill) > 2_000.0
    assert min(seqs) < 50.0  # 1 s answers, begun 0.5 s ago, end within the horizon


def test_blend_turns_to_persistence_where_the_model_keeps_missing() -> None:
    cal = LeadCalibration(steps=3, step_s=5.0, gain_rate=0.0)
    wrong = [300.0] * 3, [30.0] * 3  # steady demand is 100 tok/s and 10 decoding
    got = []
    for k in range(12):
        last = cal.observe(5.0 * k, 500 * k, 10)
        got.append(cal.combine(5.0 * k, *wrong, *wrong, last))
    assert got[1] == wrong  # no evidence yet: the model alone
    assert got[-1] == ([100.0] * 3, [10.0] * 3)  # persistence has been exact


def test_blend_keeps_the_model_where_it_foresees_what_persistence_cannot() -> None:
    cal = LeadCalibration(steps=2, step_s=5.0, gain_rate=0.0)
    rates = [100.0 if k % 2 else 500.0 for k in range(40)]  # alternating demand
    submitted = [0.0]
    for r in rates:
        submitted.append(submitted[-1] + 5.0 * r)
    for k in range(39):
        last = cal.observe(5.0 * k, int(submitted[k]), 10)
        model = [rates[k], rates[k + 1]], [10.0, 10.0]  # exactly what the next steps do
        out = cal.combine(5.0 * k, *model, *model, last)
    assert out == model


def test_the_blended_lifecycle_forecast_is_its_own_forecaster() -> None:
    """The policy's forecaster is the model alone; the blend is scored beside it by name."""
    plain, blended = make_forecaster("lifecycle"), make_forecaster("lifecycle-blend")
    assert isinstance(plain, LifecycleForecaster) and isinstance(blended, LifecycleForecaster)
    assert (plain.name, plain.blend) == ("lifecycle", False)
    assert (blended.name, blended.blend) == ("lifecycle-blend", True)


def test_unknown_forecaster_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown forecaster 'magic'"):
        make_forecaster("magic")


def test_scorer_weighted_mape() -> None:
    sc = ForecastScorer(Horizon(step_s=1.0, steps=2))
    sc.record_actual(0.0, 0, 10)
    sc.record_forecast(0.0, Forecast(1.0, [100.0, 100.0], [10.0, 10.0], [0.0, 0.0]))
    sc.record_actual(1.0, 100, 10)  # exactly as forecast
    sc.record_actual(2.0, 150, 5)  # half the prefill, half the decodes
    m = sc.mape()
    assert m["prefill"] == pytest.approx(100 * 50 / 150)
    assert m["decode"] == pytest.approx(100 * 5 / 15)


def test_every_forecast_reports_the_share_of_prefill_that_recomputes_evicted_contexts() -> None:
    """The allocator needs it to price the KV a prefill pool takes from decode."""

    def table(evicted: bool) -> LifecycleTable:
        tab = LifecycleTable()
        for i in range(50):
            tid = f"t{i}"
            tab.apply(Event(EventType.TRAJ_START, tid, 0.0, group=f"g{i}"))
            tab.ingest(turn(tid, 0.0, 4000, 4000, 1000))
            # the tool appended 500 tokens to a 5000-token context: prefill 500, or all of it
            tab.ingest(turn(tid, 10.0, 5500, 5500 if evicted else 500, 1000))
        return tab

    for f in (LastValueForecaster(), EwmaForecaster(), LifecycleForecaster("sync")):
        thrashing = f.forecast(table(evicted=True), 20.0, H)
        warm = f.forecast(table(evicted=False), 20.0, H)
        assert thrashing.recompute_fraction > 0.8
        assert warm.recompute_fraction < 0.05
        assert thrashing.resident_kv_tokens == warm.resident_kv_tokens == 50 * 6500


@pytest.mark.parametrize(("first_prompt", "expected"), [(20_000, 512.0), (70, 70.0)])
def test_before_any_tool_output_a_returning_turn_is_sized_as_an_observation(
    first_prompt: int, expected: float
) -> None:
    """The opening of a rollout: every trajectory has sent its first prompt and none has
    returned from a tool. A returning turn appends a tool observation, no larger than a
    typical one (512 tokens) nor than the task's own prompt: a 20K-token task does not come
    back with 20K tokens per turn (it did: 380x the real prefill on a sampled workload)."""
    tab = LifecycleTable()
    for i in range(100):
        tab.ingest([Event(EventType.TRAJ_START, f"t{i}", 0.0), submit(f"t{i}", 0.0, first_prompt)])
    assert tab.stats.mean_tool_output() == expected
    assert tab.stats.tool_output_after(np.array([1, 2, 8])).tolist() == [expected] * 3
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, 1.0, H)
    # at most every trajectory returns once within the horizon, each with one observation
    assert sum(fc.prefill_tokens_per_s) * H.step_s <= 100 * expected * 1.01
    tab.ingest(turn("t0", 30.0, first_prompt + 5000, 5000, 10))  # an observation is seen
    assert tab.stats.mean_tool_output() > expected or (expected == 512.0 and first_prompt > 5000)


def _in_tools(tab: LifecycleTable, n: int, now: float, since: list[float], turns: int = 1) -> None:
    """`n` live trajectories that have run `turns` turns and are in a tool call begun at
    `since[i]`."""
    for i in range(n):
        tid = f"live{i}"
        t0 = since[i] - 1.2
        tab.ingest([Event(EventType.TRAJ_START, tid, t0), *turn(tid, t0, 500, 500, 100)])
        tab.apply(Event(EventType.TOOL_START, tid, since[i]))
    tab.ingest([])
    assert tab.count(State.TOOL) == n and tab.now <= now


def test_decodes_shorter_than_a_grid_bin_are_counted_while_they_run() -> None:
    """Answers of 50 tokens decode for 0.5 s, less than the chain's 1.25 s grid. 200 tool
    calls of 10 s begun evenly over the last 10 s come back at 20 per second, so about
    20 x 0.5 = 10 sequences decode at any moment; counted only at grid ends, a decode that
    starts and ends inside one bin was never counted, and the forecast said ~0."""
    tab = LifecycleTable()
    _teach(tab, 300, out=50, tool_s=10.0)
    now = 200.0
    _in_tools(tab, 200, now, [now - 10.0 + 0.05 * i for i in range(200)])
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    assert 5.0 < fc.decode_seqs[0] < 20.0, fc.decode_seqs


def test_a_reported_tool_call_is_followed_by_a_turn() -> None:
    """Half the trajectories end after their first answer, the other half call a tool and
    always send its result back. A trajectory seen in a tool call has made its choice: it
    comes back with certainty, not with the 50% of all first turns."""
    tab = LifecycleTable()
    for i in range(200):
        tid = f"hist{i}"
        tab.ingest([Event(EventType.TRAJ_START, tid, 0.0), *turn(tid, 0.0, 500, 500, 100)])
        if i % 2:
            tab.apply(Event(EventType.TRAJ_END, tid, 1.2))
            continue
        tab.apply(Event(EventType.TOOL_START, tid, 1.2))
        tab.apply(Event(EventType.TOOL_END, tid, 11.2))
        tab.ingest(turn(tid, 11.2, 1500, 900, 100))
        tab.apply(Event(EventType.TRAJ_END, tid, 12.5))
    st = tab.stats
    assert st.p_continue_after(np.array([1]))[0] == pytest.approx(0.5, abs=0.05)
    assert st.p_continue_after_tool > 0.98
    now = 100.0
    _in_tools(tab, 100, now, [now - 5.0] * 100)  # the tools end 5 s from now
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    fc = f.forecast(tab, now, H)
    returned = sum(fc.prefill_tokens_per_s[:2]) * H.step_s
    per_turn = float(st.tool_output_after(np.array([1]))[0])
    assert returned == pytest.approx(100 * per_turn, rel=0.15)


def test_before_any_tool_call_ended_the_calls_in_flight_are_expected_to_last() -> None:
    """80 calls in flight for 10-30 s and none ended: together 1,600 s without an end, so
    few end in the next minute. Taken each alone (as long again as it has lasted), nearly
    all would have come back within the horizon."""
    tab = LifecycleTable()
    now = 100.0
    _in_tools(tab, 80, now, [now - 10.0 - 0.25 * i for i in range(80)])
    assert tab.stats.tool_latency.total == 0
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    fc = f.forecast(tab, now, H)
    per_turn = tab.stats.tool_output_after(np.array([1]))[0] * tab.stats.p_continue_after_tool
    returned = sum(fc.prefill_tokens_per_s) * H.step_s / per_turn
    assert 0.5 < returned < 0.15 * 80, returned


def test_the_chains_next_decodes_are_as_long_as_the_live_trajectories_groups_answer() -> None:
    """Two tables that learned the same answers (groups answering 3,000 tokens and groups
    answering 30), where the 50 trajectories in a tool call now belong to the long groups
    (a) or the short ones (b): their next turns, which the chain plays, decode as long as
    their groups' answers, not as long as the average answer ended so far."""
    now, fcs = 300.0, []
    for live_groups in ("L", "S"):
        tab = LifecycleTable()
        for i in range(200):  # finished: two turns, 1 s tools
            tid, long_ = f"h{i}", i % 2 == 0
            out = 3000 if long_ else 30
            tab.apply(Event(EventType.TRAJ_START, tid, 0.0, group=f"{'LS'[i % 2]}{i % 10}"))
            tab.ingest(turn(tid, 0.0, 500, 500, out, decode_s=out * 0.01))
            t1 = 0.1 + out * 0.01
            tab.apply(Event(EventType.TOOL_START, tid, t1))
            tab.apply(Event(EventType.TOOL_END, tid, t1 + 1.0))
            tab.ingest(turn(tid, t1 + 1.0, 1500, 500, out, decode_s=out * 0.01))
            tab.apply(Event(EventType.TRAJ_END, tid, t1 + 2.0 + out * 0.01))
        for i in range(50):  # live: one answer as long as their group's, in a tool call now
            tid = f"live{i}"
            out = 3000 if live_groups == "L" else 30
            tab.apply(Event(EventType.TRAJ_START, tid, now - 40.0, group=f"{live_groups}{i % 10}"))
            tab.ingest(turn(tid, now - 40.0, 500, 500, out, decode_s=out * 0.01))
            tab.apply(Event(EventType.TOOL_START, tid, now - 0.5))
        f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0)
        fcs.append(f.forecast(tab, now, H))
    long_, short = fcs
    # (played at the average answer's length, as before the mix: 34.7 against 32.9)
    assert long_.decode_seqs[0] > short.decode_seqs[0] + 10


def _fillers(tab: LifecycleTable, name: str, n: int, t: float) -> list[str]:
    """`n` new trajectories that prefill a 60,000-token prompt at `t`, answer and wait."""
    tids = [f"{name}-{k}" for k in range(n)]
    for tid in tids:
        tab.ingest([Event(EventType.TRAJ_START, tid, t), *turn(tid, t, 60000, 60000, 100, 0.5)])
    return tids


def test_a_returning_turn_recomputes_what_the_lru_cache_evicted_while_it_was_away() -> None:
    """Learned: every context came back after 5 s, whole if 5 contexts of 60,000 tokens were
    used in the meantime, evicted if 20 were (an LRU cache of between 300K and 1.2M tokens).
    Of 40 trajectories in tool calls now, half come back within the first step, with only
    their own 244K tokens used since, and half after 39 s, after 20 more such contexts: the
    recompute is the late ones'. By time away alone it was half of every return's."""
    tab = LifecycleTable()
    for j in range(100):
        tid, t0, held = f"h{j}", 10.0 + 20.0 * j, j % 2 == 0
        tab.ingest([Event(EventType.TRAJ_START, tid, t0), *turn(tid, t0, 5000, 5000, 100)])
        tab.apply(Event(EventType.TOOL_START, tid, t0 + 1.2))
        fillers = _fillers(tab, tid, 5 if held else 20, t0 + 2.0)
        tab.apply(Event(EventType.TOOL_END, tid, t0 + 6.1))
        tab.ingest(turn(tid, t0 + 6.1, 5600, 500 if held else 5600, 100))
        tab.ingest([Event(EventType.TRAJ_END, x, t0 + 7.5) for x in [tid, *fillers]])
    by_tokens = tab.stats.recompute_by_tokens_since.at(np.array([2.5e5, 1.5e6]), 0.5)
    assert by_tokens.tolist() == [0.0, 1.0]
    now = 2100.0
    _fillers(tab, "late", 20, now - 20.6)
    for i in range(40):
        tid, hint = f"live{i}", (2.0 if i % 2 else 40.0)
        tab.apply(Event(EventType.TRAJ_START, tid, now - 2.1))
        tab.ingest(turn(tid, now - 2.1, 6000, 6000, 100))  # its decode ends at now - 1
        tab.apply(Event(EventType.TOOL_START, tid, now - 1.0, expected_seconds=hint))
    tab.ingest([])
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    soon, late = fc.prefill_tokens_per_s[0] * H.step_s, fc.prefill_tokens_per_s[7] * H.step_s
    out = tab.stats.tool_output_after(np.array([1]))[0]
    # their contexts are still cached: their outputs (and the chain's quick returns), where
    # half of each context added 20 x 0.5 x 6,100 = 61,000 tokens
    assert soon < 2.5 * 20 * out
    assert late > 20 * 6100 * 0.8  # theirs were evicted


def test_calls_in_flight_past_the_longest_that_ended_come_back_slowly() -> None:
    """Early in a rollout: five calls ended after 1 s, 80 have run for 10-30 s. Kaplan-Meier
    (flat past 1 s) says they never come back; as likely as not within another three times
    as long is about half of them within the minute."""
    tab = LifecycleTable()
    now = 100.0
    for i in range(5):
        tid = f"done{i}"
        tab.ingest([Event(EventType.TRAJ_START, tid, 50.0), *turn(tid, 50.0, 500, 500, 100)])
        tab.apply(Event(EventType.TOOL_START, tid, 51.2))
        tab.apply(Event(EventType.TOOL_END, tid, 52.2))
        tab.apply(Event(EventType.TRAJ_END, tid, 52.2))
    _in_tools(tab, 80, now, [now - 10.0 - 0.25 * i for i in range(80)])
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    fc = f.forecast(tab, now, H)
    per_turn = tab.stats.tool_output_after(np.array([1]))[0] * tab.stats.p_continue_after_tool
    returned = sum(fc.prefill_tokens_per_s) * H.step_s / per_turn
    assert 0.3 * 80 < returned < 0.7 * 80, returned


def test_decodes_running_short_of_a_few_long_ones_are_not_all_forecast_to_end() -> None:
    """Learned: 200 one-turn trajectories decoded for 1-30 s, and three for 60 s. Now 100
    have decoded for 40 s (a next phase's long answers). Read as they are, the three say that
    whatever reaches 60 s ends there, and the 100 were forecast gone within 50 s; too few
    remain at risk to say so, and past the durations read they end on the heavy tail."""
    tab = LifecycleTable()
    for i in range(203):
        tid, d = f"h{i}", (1.0 + 0.145 * i if i < 200 else 60.0)
        tab.apply(Event(EventType.TRAJ_START, tid, 100.0))
        tab.ingest(turn(tid, 100.0, 500, 500, 100, decode_s=d))
        tab.apply(Event(EventType.TRAJ_END, tid, 100.2 + d))
    now = 200.0
    for i in range(100):
        tid = f"live{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, now - 41.0))
        tab.ingest(turn(tid, now - 41.0, 500, 500, 100, decode_s=1000.0)[:2])  # decoding
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    seqs = f.forecast(tab, now, H).decode_seqs
    assert 40.0 < seqs[-1] < 90.0  # a minute from now some have ended, not all (before: 0)


def test_the_chains_returns_are_priced_as_the_trajectories_that_will_return() -> None:
    """Learned: half the decodes take 1 s and half 1,000 s (the last of them ended a
    minute and a half ago, recent enough to be read), tools 2 s, six turns, and a
    returning context is recomputed whole. Now 200 trajectories with 100,000-token contexts
    have decoded for 10 s (the long kind: none ends within the minute) and 20 with
    2,100-token contexts are in a 2 s tool call. The turns the chain plays after their
    returns are the 20's: each brings back a few thousand tokens, not the live
    trajectories' mean context (91,000): the chain's trajectories are weighted by the
    chance that they leave decode within the horizon."""
    tab = LifecycleTable()
    for i in range(300):
        tid, t, d = f"h{i}", 0.01 * i, (1.0, 1000.0)[i % 2]
        tab.apply(Event(EventType.TRAJ_START, tid, t))
        for k in range(6):
            prompt = 2000 + 600 * k
            tab.ingest(turn(tid, t, prompt, prompt, 100, d))
            tab.apply(Event(EventType.TOOL_START, tid, t + d + 0.2))
            tab.apply(Event(EventType.TOOL_END, tid, t + d + 2.2))
            t += d + 2.2
        tab.apply(Event(EventType.TRAJ_END, tid, t))
    now = 6100.0
    for i in range(200):
        tid = f"long{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, now - 10.2))
        tab.ingest(turn(tid, now - 10.2, 100000, 100000, 100, 1000.0)[:2])  # decoding
    for i in range(20):
        tid = f"cycler{i}"
        tab.apply(Event(EventType.TRAJ_START, tid, now - 3.1))
        tab.ingest(turn(tid, now - 3.1, 2000, 2000, 100))
        tab.apply(Event(EventType.TOOL_START, tid, now - 1.0))
    tab.ingest([])
    fc = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0).forecast(tab, now, H)
    tokens = sum(fc.prefill_tokens_per_s) * H.step_s
    # the 20 come back recomputing their 2,100 tokens with ~600 more, and some go round again
    # (priced at the mean live context, the chain's few returns added ~150,000)
    assert 20 * 2100 < tokens < 20 * 3500


def test_calls_in_flight_return_with_the_latencies_of_the_turn_they_precede() -> None:
    """Learned: the call before a trajectory's second turn takes 2 s, the calls before its
    third and fourth 40 s. Forty trajectories began the call before their third turn 1 s
    ago: they come back after about 40 s. With every depth's calls together, a third of
    them (the 2 s kind, conditioned on 1 s) came back within the first step."""
    tab = LifecycleTable()
    for i in range(50):
        tid = f"h{i}"
        tab.ingest([Event(EventType.TRAJ_START, tid, 0.0), *turn(tid, 0.0, 100, 100, 10)])
        tab.apply(Event(EventType.TOOL_START, tid, 1.2))
        tab.apply(Event(EventType.TOOL_END, tid, 3.2))
        tab.ingest(turn(tid, 3.2, 300, 190, 10))
        for t in (4.4, 45.6):
            tab.apply(Event(EventType.TOOL_START, tid, t))
            tab.apply(Event(EventType.TOOL_END, tid, t + 40.0))
            tab.ingest(turn(tid, t + 40.0, 310 + 200 * (t > 5), 190, 10))
        tab.apply(Event(EventType.TRAJ_END, tid, 90.0))
    now = 300.0
    for i in range(40):
        tid = f"live{i}"
        tab.ingest(
            [Event(EventType.TRAJ_START, tid, now - 10.0), *turn(tid, now - 10.0, 100, 100, 10)]
        )
        tab.apply(Event(EventType.TOOL_START, tid, now - 8.8))
        tab.apply(Event(EventType.TOOL_END, tid, now - 6.8))
        tab.ingest(turn(tid, now - 6.8, 300, 190, 10))
        tab.apply(Event(EventType.TOOL_START, tid, now - 1.0))
    tab.ingest([])
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    fc = f.forecast(tab, now, H)
    per_step = [x * H.step_s for x in fc.prefill_tokens_per_s]
    assert per_step[0] < 0.1 * 40 * 190
    assert sum(per_step[6:9]) > 0.5 * 40 * 190


def _forty_live_at(ctx: int) -> list[float]:
    """The prefill forecast for forty trajectories that have just answered their first turn
    with `ctx` tokens of context, in a table that learned agents stop at a 32K window."""
    tab = LifecycleTable()
    fill_windows(tab, 400)
    now = 100.0
    for i in range(40):
        tid = f"live{i}"
        tab.ingest(
            [Event(EventType.TRAJ_START, tid, now - 2.0), *turn(tid, now - 2.0, ctx, ctx, 100)]
        )
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    return f.forecast(tab, now, H).prefill_tokens_per_s


def test_trajectories_whose_context_window_is_full_are_expected_to_stop() -> None:
    """Learned: trajectories stop when their next observation would overflow a 32K window.
    Forty have just answered their first turn with 31K tokens of context, forty others with
    2K: by turn depth both go on, but the first forty are near their window. Without the
    window both forecast the same returning turns."""
    near, far = sum(_forty_live_at(31000)), sum(_forty_live_at(2000))
    assert far > 0
    assert near < 0.75 * far


def test_the_chain_stops_as_its_contexts_grow_into_the_window() -> None:
    """Learned as above. Forty with 20K of context, below the contexts where any stopped, and
    forty with 2K both go on now; but each turn that comes back adds ~5K, so the first forty
    reach the window within a step or two and their turns stop, while the second forty's go
    on until they have grown as much."""
    near, far = _forty_live_at(20000), _forty_live_at(2000)
    assert near[0] == pytest.approx(far[0])  # the turns coming back now
    assert sum(near[1:3]) < 0.5 * sum(far[1:3])


def test_answers_shorter_than_a_grid_bin_decode_for_their_length() -> None:
    """The chain's decodes start anywhere in a 1.25 s bin; one far shorter than the bin is
    decoding at the bin's end about its length over the bin's. Answers of 0.6 s are then
    counted far more often than answers of 0.2 s (up to three times), not both half the
    time."""
    seqs = {}
    for out in (20, 60):  # 0.2 s and 0.6 s at 10 ms a token
        tab = LifecycleTable()
        _teach(tab, 300, out=out, tool_s=1.0)
        now = 100.0
        for i in range(100):  # back from their tools within a second, then decoding
            tid = f"live{i}"
            tab.apply(Event(EventType.TRAJ_START, tid, now - 2.0, group=f"lg{i}"))
            tab.ingest(turn(tid, now - 2.0, 500, 500, out, decode_s=out * 0.01))
            tab.apply(Event(EventType.TOOL_START, tid, now - 0.1))
        tab.ingest([])
        f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
        seqs[out] = sum(f.forecast(tab, now, H).decode_seqs)
    assert seqs[20] > 0
    assert seqs[60] > 1.5 * seqs[20]


def test_the_chains_new_calls_last_as_long_as_the_calls_agents_make_now() -> None:
    """Fifty agents made twenty quick calls (50 ms) each in their first seconds, then nine
    calls of 30 s each over the next four and a half minutes; now each has just begun
    decoding a one-second answer. Its next call takes 30 s, so within the 60 s horizon each
    comes back about once. With the quick burst weighing as much as the calls of the last
    minutes, the chain sent most new calls back at once (nearly five returns each)."""
    tab = LifecycleTable()
    now = 300.0
    for i in range(50):
        tid, t, ctx = f"a{i}", 0.0, 500
        tab.apply(Event(EventType.TRAJ_START, tid, t))
        events: list[Event] = []
        for k, tool_s in enumerate([0.05] * 20 + [30.0] * 9):
            decode_s = 0.2 if tool_s < 1.0 else 1.0
            events += turn(tid, t, ctx, 100 if k else ctx, 10, decode_s=decode_s)
            t += 0.1 + decode_s
            events += [
                Event(EventType.TOOL_START, tid, t),
                Event(EventType.TOOL_END, tid, t + tool_s),
            ]
            t += tool_s
            ctx += 110
        events += turn(tid, now - 0.5, ctx, 100, 10)[:2]  # submitted and prefilled: decoding
        tab.ingest(events)
    assert tab.count(State.DECODE) == 50
    f = LifecycleForecaster("sync", calibration=0.0, smoothing=0.0, min_evidence=0)
    returns = sum(f.forecast(tab, now, H).prefill_tokens_per_s) * H.step_s / 100
    assert 0.8 * 50 < returns < 2.5 * 50
