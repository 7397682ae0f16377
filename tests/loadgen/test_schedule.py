"""Schedules are pure: closed loop, gamma/Poisson arrivals, trace timing, warm-up and limits."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from loadgen.schedule import (
    ScheduleError,
    ScheduleSpec,
    gamma_offsets,
    measured_slots,
    trace_offsets,
    warmup_slots,
)


def test_closed_loop_without_limits_is_one_pass_over_the_trace_after_the_warmup_rows():
    spec = ScheduleSpec(concurrency=4, warmup=2)
    warm = warmup_slots(spec, 5)
    slots = list(measured_slots(spec, 5))
    assert [s.record_index for s in warm] == [0, 1] and all(s.warmup for s in warm)
    assert [s.record_index for s in slots] == [2, 3, 4, 0, 1]
    assert [s.index for s in slots] == [0, 1, 2, 3, 4]
    assert all(s.offset_s is None and not s.warmup for s in slots)


def test_max_requests_beyond_the_trace_reuses_rows_round_robin():
    slots = list(measured_slots(ScheduleSpec(max_requests=7), 3))
    assert [s.record_index for s in slots] == [0, 1, 2, 0, 1, 2, 0]


def test_a_duration_only_closed_loop_schedule_is_unbounded_and_lazy():
    slots = measured_slots(ScheduleSpec(duration_s=1.0), 2)
    first = [next(slots) for _ in range(1000)]
    assert first[-1].index == 999


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_have_the_requested_mean_rate_whatever_the_burstiness(burstiness):
    spec = ScheduleSpec(
        mode="rate", rate_rps=20.0, burstiness=burstiness, max_requests=4000, seed=7
    )
    offsets = [s.offset_s or 0.0 for s in measured_slots(spec, 10)]
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.06)
    # Coefficient of variation of a gamma(shape k) is 1/sqrt(k): burstier below 1, smoother above.
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_arrivals_are_deterministic_for_a_seed_and_differ_across_seeds():
    a = [next(gamma_offsets(5.0, 1.0, seed=1)) for _ in range(1)]
    s1 = list(measured_slots(ScheduleSpec(mode="rate", rate_rps=5.0, max_requests=20, seed=1), 4))
    s2 = list(measured_slots(ScheduleSpec(mode="rate", rate_rps=5.0, max_requests=20, seed=1), 4))
    s3 = list(measured_slots(ScheduleSpec(mode="rate", rate_rps=5.0, max_requests=20, seed=2), 4))
    assert a == [0.0] and s1 == s2 and s1 != s3


def test_infinite_rate_sends_everything_at_once():
    spec = ScheduleSpec(mode="rate", rate_rps=math.inf, max_requests=5)
    assert {s.offset_s for s in measured_slots(spec, 3)} == {0.0}


def test_a_rate_schedule_stops_at_the_duration():
    spec = ScheduleSpec(mode="rate", rate_rps=100.0, duration_s=2.0, seed=3)
    offsets = [s.offset_s or 0.0 for s in measured_slots(spec, 10)]
    assert offsets and max(offsets) < 2.0
    assert 150 < len(offsets) < 250


def test_trace_timing_is_relative_to_the_first_row_and_scaled():
    stamps = [1000.0, 1000.5, 1002.0, 1002.0]
    assert trace_offsets(stamps, 1.0) == [0.0, 0.5, 2.0, 2.0]
    assert trace_offsets(stamps, 0.5) == [0.0, 0.25, 1.0, 1.0]
    spec = ScheduleSpec(mode="trace", time_scale=2.0, warmup=1)
    slots = list(measured_slots(spec, 4, stamps))
    assert [(s.record_index, s.offset_s) for s in slots] == [(1, 0.0), (2, 3.0), (3, 3.0)]


def test_trace_timing_honours_max_requests_and_duration():
    stamps = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(list(measured_slots(ScheduleSpec(mode="trace", max_requests=2), 5, stamps))) == 2
    assert len(list(measured_slots(ScheduleSpec(mode="trace", duration_s=2.5), 5, stamps))) == 3


@pytest.mark.parametrize(
    ("stamps", "message"),
    [([0.0, None, 1.0], "row 1 has no 'timestamp'"), ([0.0, 2.0, 1.0], "row 2 has an earlier")],
)
def test_unusable_trace_timing_is_refused_naming_the_row(stamps, message):
    with pytest.raises(ScheduleError, match=message):
        trace_offsets(stamps, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"mode": "rate"}, "rate"),
        ({"mode": "rate", "rate_rps": -1.0}, "rate"),
        ({"burstiness": 0.0}, "burstiness"),
        ({"time_scale": -1.0}, "time_scale"),
        ({"warmup": -1}, "warmup"),
        ({"max_requests": -1}, "max_requests"),
        ({"duration_s": 0.0}, "duration"),
        ({"mode": "poisson"}, "mode"),
    ],
)
def test_invalid_specs_name_the_option(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        ScheduleSpec(**kwargs)


def test_empty_traces_and_zero_requests_schedule_nothing():
    assert list(measured_slots(ScheduleSpec(), 0)) == []
    assert warmup_slots(ScheduleSpec(warmup=3), 0) == []
    assert list(measured_slots(ScheduleSpec(max_requests=0), 5)) == []
    assert trace_offsets([], 1.0) == []
    assert ScheduleSpec(mode="trace").open_loop and not ScheduleSpec().open_loop
