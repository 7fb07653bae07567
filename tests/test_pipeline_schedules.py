"""The pipeline simulator: torch.distributed.pipelining's own action orders, timed per stage, give the bubbles
the schedules are known for."""
from __future__ import annotations

import pytest

from autopar.cost.pipeline import (Action, ScheduleError, StageTimes, schedule_actions, simulate,
                                   simulate_schedule)

EQUAL = StageTimes(forward=1.0, backward_input=1.0, backward_weight=1.0)


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 64)])
def test_gpipe_and_1f1b_idle_over_busy_is_p_minus_1_over_m(schedule, p, m):
    tl = simulate_schedule(schedule, p, m, [EQUAL] * p)
    assert abs(tl.idle_ratio - (p - 1) / m) < 1e-9
    assert abs(tl.makespan - (m + p - 1) * 3.0) < 1e-9


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (8, 64, 2)])
def test_interleaved_1f1b_idle_over_busy_is_p_minus_1_over_v_m(p, m, v):
    # v virtual stages per rank, each with 1/v of a rank's layers.
    t = StageTimes(forward=1.0 / v, backward_input=1.0 / v, backward_weight=1.0 / v)
    tl = simulate_schedule("ScheduleInterleaved1F1B", p, m, [t] * (p * v), v)
    assert abs(tl.idle_ratio - (p - 1) / (v * m)) < 1e-9


@pytest.mark.parametrize("schedule", ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"])
def test_zero_bubble_schedules_idle_less_than_interleaved_1f1b(schedule):
    p, m, v = 4, 8, 2
    t = StageTimes(forward=0.5, backward_input=0.5, backward_weight=0.5)
    zb = simulate_schedule(schedule, p, m, [t] * (p * v), v)
    il = simulate_schedule("ScheduleInterleaved1F1B", p, m, [t] * (p * v), v)
    assert zb.idle_ratio < 0.5 * il.idle_ratio
    assert {a.kind for _, a, _, _ in zb.events} == {"F", "I", "W"}


def test_transfers_lengthen_gpipe_by_one_send_per_hop_each_way():
    p, m, c = 4, 8, 0.25
    tl = simulate_schedule("ScheduleGPipe", p, m, [StageTimes(1.0, 2.0, 0.0, send=c)] * p)
    assert abs(tl.makespan - ((m + p - 1) * 3.0 + 2 * (p - 1) * c)) < 1e-9


def test_unequal_stages_wait_on_the_slowest():
    times = [EQUAL, StageTimes(2.0, 2.0, 2.0), EQUAL]
    tl = simulate_schedule("Schedule1F1B", 3, 6, times)
    assert tl.busy == pytest.approx([18.0, 36.0, 18.0])
    # The slow stage runs back to back once fed: the step is its work plus the first stage's forward before
    # it and backward after it (and what waiting on its neighbours in 1F1B order adds).
    assert 36.0 + 1.0 + 2.0 <= tl.makespan <= 36.0 + 3 * 3.0


def test_orders_come_from_torch_and_run_each_microbatch_once_in_order():
    ranks = schedule_actions("Schedule1F1B", 4, 8)
    # Stage 0 runs p forwards before its first backward; the last stage alternates from the start.
    assert [str(a) for a in ranks[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert [str(a) for a in ranks[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    zbv = schedule_actions("ScheduleZBVZeroBubble", 2, 4)
    assert {a.stage for a in zbv[0]} == {0, 3} and {a.stage for a in zbv[1]} == {1, 2}  # the V
    for ranks in (schedule_actions("ScheduleInterleaved1F1B", 4, 8, 2), zbv):
        for r in ranks:
            for stage in {a.stage for a in r}:
                fwd = [a.microbatch for a in r if a.stage == stage and a.kind == "F"]
                assert fwd == sorted(fwd)


def test_activations_in_flight_follow_the_schedule():
    assert simulate_schedule("ScheduleGPipe", 4, 8, [EQUAL] * 4).in_flight == [8, 8, 8, 8]
    assert simulate_schedule("Schedule1F1B", 4, 8, [EQUAL] * 4).in_flight == [4, 3, 2, 1]


def test_gantt_lanes_are_pipeline_ranks():
    tl = simulate_schedule("Schedule1F1B", 2, 2, [EQUAL] * 2)
    g = tl.gantt()
    assert {lane for lane, *_ in g} == {"pp rank 0", "pp rank 1"}
    assert len(g) == 2 * 2 * 2


def test_bad_schedules_say_what_to_change():
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'PipeDream'.*ScheduleGPipe"):
        schedule_actions("PipeDream", 2, 2)
    with pytest.raises(ScheduleError, match="Schedule1F1B cannot run 2 microbatches on 4 ranks"):
        schedule_actions("Schedule1F1B", 4, 2)
    with pytest.raises(ScheduleError, match="at least 2 virtual stages"):
        schedule_actions("ScheduleInterleaved1F1B", 2, 4, 1)
    with pytest.raises(ScheduleError, match="deadlocks"):  # a backward ordered before its forward
        simulate([[Action(0, "B", 0), Action(0, "F", 0)]], [EQUAL])
