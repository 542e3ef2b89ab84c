from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import fill_windows, turn
from prorsa.policy.events import Event, EventType, State
from prorsa.policy.learned import context_bins, depth_class, turn_bin
from prorsa.policy.lifecycle import LifecycleTable


def start(traj: str, ts: float, group: str | None = None) -> Event:
    return Event(EventType.TRAJ_START, traj, ts, group=group)


def test_states_follow_a_trajectory_through_turns_and_tools() -> None:
    tab = LifecycleTable()
    tab.apply(start("a", 0.0))
    assert tab.trajs["a"].state == State.WAITING
    tab.apply(Event(EventType.TURN_SUBMIT, "a", 1.0, prompt_tokens=100, uncached_tokens=100))
    assert tab.trajs["a"].state == State.PREFILL
    assert tab.prefill_backlog_tokens == 100
    tab.apply(Event(EventType.PREFILL_DONE, "a", 1.5, worker="p", tokens=100, seconds=0.5))
    assert tab.trajs["a"].state == State.DECODE
    assert tab.prefill_backlog_tokens == 0
    assert tab.decode_context_tokens == 100
    tab.apply(Event(EventType.DECODE_DONE, "a", 3.0, worker="d", output_tokens=50, seconds=1.5))
    assert tab.trajs["a"].state == State.WAITING
    assert tab.trajs["a"].context_tokens == 150
    assert tab.decode_context_tokens == 0
    tab.apply(Event(EventType.TOOL_START, "a", 3.0, expected_seconds=4.0))
    assert tab.trajs["a"].state == State.TOOL
    assert tab.trajs["a"].tool_hint == 4.0
    tab.apply(Event(EventType.TOOL_END, "a", 7.0))
    assert tab.stats.tool_latency.n == 1
    tab.apply(Event(EventType.TURN_SUBMIT, "a", 7.0, prompt_tokens=400, uncached_tokens=250))
    assert tab.trajs["a"].turn == 2
    assert tab.trajs["a"].mean_tool_output == 250
    tab.apply(Event(EventType.TRAJ_END, "a", 9.0, reason="done"))
    assert "a" not in tab.trajs
    assert tab.count_by_state == [0, 0, 0, 0, 0]


def test_duplicates_are_ignored() -> None:
    tab = LifecycleTable()
    events = [start("a", 0.0), *turn("a", 1.0, 100, 100, 40)]
    for ev in events + events:
        tab.apply(ev)
    assert tab.duplicates_total == len(events)
    assert tab.trajs["a"].turn == 1
    assert tab.submitted_tokens_total == 100
    assert tab.stats.output_len.n == 1


def test_out_of_order_events_never_move_state_backwards() -> None:
    tab = LifecycleTable()
    submit, prefill, decode = turn("a", 1.0, 100, 100, 40)
    for ev in (start("a", 0.0), submit, decode, prefill):  # prefill_done arrives last
        tab.apply(ev)
    t = tab.trajs["a"]
    assert t.state == State.WAITING  # the decode already finished
    assert tab.late_total == 1
    assert tab.count_by_state[State.WAITING] == 1
    assert tab.decode_context_tokens == 0 and tab.prefill_backlog_tokens == 0
    # a late event still teaches the statistics it carries
    assert tab.stats.prefill_latency_s.value is not None


def test_shuffled_stream_keeps_aggregates_consistent() -> None:
    rng = random.Random(1)
    events: list[Event] = []
    for i in range(200):
        tid = f"t{i}"
        t0 = rng.uniform(0, 100)
        events += [
            start(tid, t0),
            *turn(tid, t0 + 1, 500, 500, 30),
            *turn(tid, t0 + 5, 900, 370, 20),
        ]
        if i % 2:
            events.append(Event(EventType.TRAJ_END, tid, t0 + 9))
    rng.shuffle(events)
    tab = LifecycleTable()
    tab.ingest(events)
    assert sum(tab.count_by_state) == len(tab.trajs) == 100
    assert tab.prefill_backlog_tokens == sum(
        t.pending_tokens for t in tab.trajs.values() if t.state == State.PREFILL
    )
    assert tab.decode_context_tokens == sum(
        t.context_tokens for t in tab.trajs.values() if t.state == State.DECODE
    )


def test_events_after_traj_end_do_not_resurrect_it() -> None:
    tab = LifecycleTable()
    tab.apply(start("a", 0.0))
    tab.apply(Event(EventType.TRAJ_END, "a", 1.0))
    tab.apply(Event(EventType.TURN_SUBMIT, "a", 0.5, prompt_tokens=10, uncached_tokens=10))
    assert "a" not in tab.trajs
    assert tab.late_total == 1


def test_silent_trajectories_are_evicted() -> None:
    tab = LifecycleTable(evict_after_s=60.0)
    tab.apply(start("old", 0.0))
    tab.apply(start("new", 100.0))
    assert tab.evict_idle(now=100.0) == 1
    assert list(tab.trajs) == ["new"]
    assert tab.evicted_total == 1
    assert sum(tab.count_by_state) == 1


def test_ingest_sweeps_silent_trajectories_by_itself() -> None:
    tab = LifecycleTable(evict_after_s=100.0)
    tab.ingest([start("quiet", 0.0), start("busy", 0.0)])
    for ts in range(10, 300, 10):
        tab.ingest(
            [
                Event(EventType.TOOL_START, "busy", float(ts)),
                Event(EventType.TOOL_END, "busy", ts + 5.0),
            ]
        )
    assert "quiet" not in tab.trajs and "busy" in tab.trajs


def test_memory_stays_bounded() -> None:
    tab = LifecycleTable(max_trajectories=1000, max_ended=500)
    for i in range(5000):
        tab.apply(start(f"t{i}", float(i), group=f"g{i}"))
        tab.apply(Event(EventType.DECODE_DONE, f"t{i}", float(i), output_tokens=5, seconds=0.1))
        if i % 2:
            tab.apply(Event(EventType.TRAJ_END, f"t{i}", float(i)))
    assert len(tab.trajs) <= 1000
    assert len(tab.ended) <= 500
    assert len(tab.groups) <= 1000 + 1
    assert tab.evicted_total > 0


def test_group_estimate_moves_toward_the_groups_lengths() -> None:
    tab = LifecycleTable()
    for i in range(50):  # background: outputs around 100 tokens
        tab.apply(start(f"b{i}", 0.0, group="bg"))
        tab.apply(Event(EventType.DECODE_DONE, f"b{i}", 1.0, output_tokens=100, seconds=1))
    prior = tab.group_log_mean("unseen")
    for i in range(6):  # one hard prompt: its samples write 3000 tokens
        tab.apply(start(f"h{i}", 0.0, group="hard"))
        tab.apply(Event(EventType.DECODE_DONE, f"h{i}", 1.0, output_tokens=3000, seconds=1))
    assert tab.group_log_mean("hard") > prior + 2.0
    assert abs(tab.group_log_mean("unseen") - prior) < 0.5


def test_continuation_is_learned_per_turn_depth() -> None:
    tab = LifecycleTable()
    for i in range(100):  # every trajectory: exactly two turns
        tid = f"t{i}"
        tab.ingest([start(tid, 0.0), *turn(tid, 1.0, 100, 100, 10), *turn(tid, 4.0, 300, 190, 10)])
        tab.apply(Event(EventType.TRAJ_END, tid, 9.0))
    after_first, after_second = tab.stats.p_continue_after(np.array([1, 2]))
    assert after_first > 0.9
    assert after_second < 0.1
    assert turn_bin(1) != turn_bin(2)


def test_tool_latency_is_learned_per_depth_of_the_turn_it_precedes() -> None:
    """Every trajectory: a 2 s tool call before its second turn, 40 s (timed from its last
    decode where no call was reported) before its third and fourth."""
    tab = LifecycleTable()
    for i in range(50):
        tid = f"t{i}"
        tab.ingest([start(tid, 0.0), *turn(tid, 0.0, 100, 100, 10)])
        tab.apply(Event(EventType.TOOL_START, tid, 1.2))
        tab.apply(Event(EventType.TOOL_END, tid, 3.2))
        tab.ingest(turn(tid, 3.2, 300, 190, 10))
        tab.ingest(turn(tid, 44.3, 500, 190, 10))  # no call reported: a 40 s gap
        tab.apply(Event(EventType.TOOL_START, tid, 45.4))
        tab.apply(Event(EventType.TOOL_END, tid, 85.4))
        tab.ingest(turn(tid, 85.4, 700, 190, 10))
    assert depth_class(np.array([0, 1, 2, 3, 4, 7, 8, 16, 100])).tolist() == [
        0, 1, 2, 2, 3, 3, 4, 5, 5,
    ]  # fmt: skip
    second, later = tab.stats.tool_by_depth[1], tab.stats.tool_by_depth[2]  # turns 1; 2-3
    assert second.n == 50 and later.n == 100
    s2, s40 = second.survival_table(), later.survival_table()
    assert second.survival(1.5, s2) > 0.9 and second.survival(3.0, s2) < 0.1
    assert later.survival(25.0, s40) > 0.9 and later.survival(60.0, s40) < 0.1
    assert tab.stats.tool_latency.n == 150  # and all of them together


def test_a_batch_teaches_what_the_same_events_one_by_one_teach() -> None:
    """`ingest` learns a batch's statistics after its state machine pass; the result must
    not depend on how the stream was cut into batches (group length factors included)."""
    rng = random.Random(7)
    events: list[Event] = []
    for i in range(300):
        tid, t0 = f"t{i}", rng.uniform(0, 50)
        events.append(start(tid, t0, group=f"g{i % 40}"))
        ctx = 0
        for k in range(rng.randint(1, 5)):
            new = rng.randint(50, 3000)
            ctx += new
            events += turn(tid, t0 + 10 * k, ctx, new, rng.randint(5, 800), rng.uniform(0.1, 9))
            ctx += 800
            if rng.random() < 0.5:
                events.append(Event(EventType.TOOL_START, tid, t0 + 10 * k + 9.5))
                events.append(Event(EventType.TOOL_END, tid, t0 + 10 * k + 9.9))
        if rng.random() < 0.7:
            events.append(Event(EventType.TRAJ_END, tid, t0 + 60))
    events.sort(key=lambda e: e.ts + rng.uniform(0.0, 2.0))  # mostly in order
    events += rng.sample(events, 100)  # redelivered
    whole, single = LifecycleTable(), LifecycleTable()
    whole.ingest(events)
    for ev in events:
        single.apply(ev)
    a, b = whole.stats, single.stats
    assert whole.count_by_state == single.count_by_state
    assert whole.duplicates_total == single.duplicates_total > 0
    assert whole.prefill_backlog_tokens == single.prefill_backlog_tokens
    assert whole.decode_context_tokens == single.decode_context_tokens
    assert a.output_len.n == b.output_len.n
    assert a.output_len.mean == pytest.approx(b.output_len.mean)
    assert a.output_len.var == pytest.approx(b.output_len.var)
    assert a.decode_duration.counts == pytest.approx(b.decode_duration.counts)
    assert a.tool_latency.counts == pytest.approx(b.tool_latency.counts)
    for by_depth_a, by_depth_b in zip(a.tool_by_depth, b.tool_by_depth, strict=True):
        assert by_depth_a.counts == pytest.approx(by_depth_b.counts)
    assert a.remote_share.value == pytest.approx(b.remote_share.value)
    assert a.recompute_share.value == pytest.approx(b.recompute_share.value)
    assert a.tool_out_sum_by_turn == pytest.approx(b.tool_out_sum_by_turn)
    assert (a.continue_by_turn, a.stop_by_turn) == (b.continue_by_turn, b.stop_by_turn)
    assert a.continue_by_class.sum() > 0 and a.stop_by_class.sum() > 0
    assert (a.continue_by_class == b.continue_by_class).all()
    assert (a.stop_by_class == b.stop_by_class).all()
    assert a.window_continue.sum() > 0 and a.window_stop.sum() > 0
    assert (a.window_continue == b.window_continue).all()
    assert (a.window_stop == b.window_stop).all()
    for g in ("g0", "g7", "g39", "unseen"):
        assert whole.group_log_mean(g) == pytest.approx(single.group_log_mean(g))


def test_trajectories_of_a_forgotten_group_fall_back_to_the_prior() -> None:
    tab = LifecycleTable(max_trajectories=100)
    for i in range(20):  # background: short outputs
        tab.apply(start(f"bg{i}", 0.0, group="bg"))
        tab.apply(Event(EventType.DECODE_DONE, f"bg{i}", 0.5, output_tokens=50, seconds=1.0))
        tab.apply(Event(EventType.TRAJ_END, f"bg{i}", 0.6))
    tab.apply(start("old", 1.0, group="g-old"))
    tab.apply(Event(EventType.DECODE_DONE, "old", 1.0, output_tokens=5000, seconds=1.0))
    assert tab.group_factor("g-old") > 1.5
    for i in range(150):  # newer groups, of trajectories that end, push the first ones out
        tab.apply(start(f"t{i}", 2.0, group=f"g{i}"))
        tab.apply(Event(EventType.TRAJ_END, f"t{i}", 2.0))
    assert "g-old" not in tab.groups and len(tab.groups) <= 100
    assert tab.trajs["old"].group is None  # still live, no longer tied to a reused row
    assert tab.group_factor("g-old") == 1.0


def test_a_batch_sent_again_later_in_the_turn_is_still_a_repeat() -> None:
    tab = LifecycleTable()
    first = [start("a", 0.0), *turn("a", 1.0, 100, 100, 40)]
    tab.ingest(first)
    tab.ingest([Event(EventType.TOOL_START, "a", 3.0)])
    tab.ingest(first)  # the router's acknowledgement was lost: the whole batch comes again
    assert tab.duplicates_total == len(first)
    assert tab.trajs["a"].turn == 1 and tab.trajs["a"].state == State.TOOL
    assert tab.submitted_tokens_total == 100


def test_demand_is_what_a_decode_worker_computes_and_the_pool_is_priced_by_what_it_computes() -> (
    None
):
    """A turn appended to a context its decode worker holds: demand is the append, wherever
    it ran; the pool's extra work (the held context it recomputes) is learned as a ratio."""
    tab = LifecycleTable()
    tab.apply(Event(EventType.TRAJ_START, "a", 0.0))
    tab.apply(Event(EventType.TURN_SUBMIT, "a", 0.5, prompt_tokens=1000, uncached_tokens=1000,
                    held_tokens=0, pool_tokens=1000))  # fmt: skip
    tab.apply(Event(EventType.PREFILL_DONE, "a", 0.6, worker="p0", tokens=1000))
    tab.apply(Event(EventType.DECODE_DONE, "a", 1.0, worker="d0", output_tokens=200))
    # the pool prefilled the next turn: it recomputed the 1,200 held tokens and the 300 new
    tab.apply(Event(EventType.TURN_SUBMIT, "a", 2.0, prompt_tokens=1500, uncached_tokens=1500,
                    held_tokens=1200, pool_tokens=1500))  # fmt: skip
    assert tab.submitted_tokens_total == 1000 + 300
    assert tab.prefill_backlog_tokens == 300
    assert tab.stats.recompute_share.get(-1.0) == 0.0  # nothing evicted
    amp = tab.stats.pool_amplification()
    assert 1.0 < amp < 5.0  # between the first prompt's 1 and the append's 1500/300
    unreported = LifecycleTable()  # a router of an earlier version: the chosen worker's work
    unreported.apply(Event(EventType.TURN_SUBMIT, "b", 0.5, prompt_tokens=1500,
                           uncached_tokens=1500))  # fmt: skip
    assert unreported.submitted_tokens_total == 1500


def test_tool_calls_are_learned_as_of_their_start_like_the_calls_still_running() -> None:
    """Two calls end together, one of 300 s and one of 10 s: the long one began 290 s
    earlier and weighs that much less (the weight a call still running at that age gets as
    a censored duration); weighted by their end, long calls would come out longer still."""
    tab = LifecycleTable()
    for tid, began in (("long", 0.0), ("short", 290.0)):
        tab.apply(start(tid, began))
        tab.apply(Event(EventType.TOOL_START, tid, began))
    tab.ingest([Event(EventType.TOOL_END, t, 300.0) for t in ("long", "short")])
    h = tab.stats.tool_latency
    ratio = h.counts[h.index(300.0)] / h.counts[h.index(10.0)]
    assert ratio == pytest.approx(float(h.start_weights(np.array([290.0]))[0]), rel=1e-6)
    assert ratio < 0.8


def test_continuation_is_learned_per_answer_length_class() -> None:
    """Half the trajectories answer briefly and go on; the other half give one long answer
    at their second turn and end: by turn depth alone, a coin toss; by the length of the
    answers each has been giving, all but certain."""
    tab = LifecycleTable()
    for i in range(100):
        tid, long_ = f"t{i}", i % 2 == 1
        tab.ingest([start(tid, 0.0), *turn(tid, 1.0, 100, 100, 10)])
        tab.ingest(turn(tid, 4.0, 300, 190, 1000 if long_ else 10))
        if not long_:
            tab.ingest(turn(tid, 7.0, 500, 190, 10))
        tab.apply(Event(EventType.TRAJ_END, tid, 9.0))
    st = tab.stats
    by_turn = st.p_continue_after(np.array([2]))[0]
    short, long_after = st.p_continue_after(np.array([2, 2]), np.array([0, 2]))
    assert 0.3 < by_turn < 0.7
    assert short > 0.9 and long_after < 0.1
    assert st.p_continue_after(np.array([2]), np.array([-1]))[0] == by_turn  # no answer yet


def test_continuation_falls_as_the_context_window_fills() -> None:
    """Trajectories stop when their next observation would overflow a 32K window: by turn
    depth alone they stop anywhere from turn 4 to 8; by the context they hold, those near
    the window stop more often than their depth says, those far from it no less."""
    tab = LifecycleTable()
    fill_windows(tab, 400)
    st = tab.stats
    by_turn = st.p_continue_after(np.array([6, 8]))  # where most stop
    assert (by_turn > 0.3).all() and (by_turn < 0.85).all()
    small, mid, near = st.window_factor(np.array([2000.0, 20000.0, 31000.0]))
    assert small == mid == 1.0  # as often as their depth says
    assert near < 0.7  # (a bin of 27-32K: below 31.6K a 1K observation still fits)
    assert context_bins(np.array([500, 1024, 1300, 31000, 33000])).tolist() == [0, 1, 2, 20, 21]
