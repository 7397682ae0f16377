"""The suite's pure parts: pairing probe stamps with send stamps, targets in both directions."""

from __future__ import annotations

import os

from bench.client import Read, StreamResult
from bench.phases import stamp_errors_ns
from bench.procstat import cpu_s, rss_kib
from bench.tables import Check
from tests.bench.test_harness import ROLE, event, token

MS = 1_000_000


def stream(index: int, *events: bytes, warmup: bool = False) -> StreamResult:
    return StreamResult(
        "probe", index, warmup, 0, 9 * MS, 200, None, (Read(9 * MS, b"".join(events)),)
    )


def test_probe_stamps_pair_one_to_one_with_the_simulators_send_stamps_done_excluded():
    r = stream(0, event(1 * MS, ROLE), event(2 * MS, token("a")), event(3 * MS, "[DONE]"))
    errors = stamp_errors_ns([r], {"probe-0": [1 * MS + 50, 2 * MS + 70]})
    assert errors == [50, 70]


def test_streams_whose_events_cannot_be_paired_or_that_were_warm_up_are_left_out():
    r = stream(0, event(1 * MS, ROLE), event(2 * MS, token("a")))
    warm = stream(1, event(1 * MS, ROLE), warmup=True)
    assert stamp_errors_ns([r, warm], {"probe-0": [1 * MS], "probe-1": [1 * MS + 5]}) == []


def test_a_check_can_demand_at_least_a_value_and_an_unknown_value_never_passes():
    assert Check("x", 0.7, 0.6, "×", at_least=True).passed
    assert not Check("x", 0.5, 0.6, "×", at_least=True).passed
    assert Check("x", 0.5, 0.6, "×", at_least=True).limit_text == ">= 0.6 ×"
    assert not Check("x", None, 1.0).passed and Check("x", 1.0, 1.0).limit_text == "<= 1 ms"


def test_proc_readings_of_this_process_are_plausible():
    assert 5_000 < rss_kib(os.getpid()) < 2_000_000
    assert cpu_s(os.getpid()) > 0
