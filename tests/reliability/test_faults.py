"""Fault matrix: whatever a shadow, the primary, the collector or the policy file does, the client
gets the primary's bytes (or the primary's own failure), and every outcome is recorded.

"Primary bytes" are compared with a direct request to the same upstream, normalising only what
differs per send (``strip_stamps``: ids, ``created``, the simulator's ``: sent_ns=`` comments).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.settings import UpstreamSettings
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from simulator.config import parse_faults
from tests.gateway.test_shadow import strip_stamps
from tests.receivers.otlp import BlackHole
from tests.reliability.helpers import (
    NEVER_OPEN,
    chat,
    closed_url,
    fetch,
    get_json,
    shadow_policy,
    wait_for_exchanges,
    wait_until,
)

BODIES = [chat(stream=True), chat(stream=False), chat(stream=True, max_tokens=5)]

# fault → the shadow leg's recorded outcome
SHADOW_FAULTS = {
    "slow": "completed",  # 10 ms per decode step and a slow prefill: just slow
    "slow_headers=0.15": "completed",
    "hang_before_headers": "upstream_timeout",
    "hang_after=2": "upstream_timeout",
    "status=500": "upstream_status",
    "refused": "upstream_error",
    "drop_after=3": "upstream_error",
    "malformed": "completed",  # a broken event is a parse error in the recording, not a failure
}
SHADOW_IDLE_S = 0.6  # the shadow legs' idle timeout where a hang must meet it
LATE_IDLE_S = 8.0  # where a late shadow must not (a 0.15 s header wait, 10 ms steps)


@pytest.mark.parametrize("fault", list(SHADOW_FAULTS))
async def test_every_shadow_fault_leaves_every_primary_answer_byte_identical(
    sims, gateway, write_policy, fault
):
    primary = await sims()
    if fault == "refused":
        cand_url = closed_url()
    elif fault == "slow":
        cand_url = (await sims(mode="speculative", step_s=0.01, prefill_base_s=0.05)).base_url
    else:
        cand_url = (await sims(mode="speculative", faults=parse_faults(fault))).base_url
    # A hang must meet the idle timeout; a shadow that only answers late must not. Each gets its
    # own idle timeout, so which outcome a leg records never rests on how much the machine
    # delays a 0.15 s header wait (under two busy loops one crossed a 0.6 s timeout).
    idle_s = SHADOW_IDLE_S if SHADOW_FAULTS[fault] == "upstream_timeout" else LATE_IDLE_S
    text = shadow_policy(primary.base_url, cand_url, idle_s=idle_s, extra=NEVER_OPEN)
    gw = await gateway(None, policy_path=write_policy(text))
    async with aiohttp.ClientSession() as session:
        expected = [strip_stamps((await fetch(session, primary.base_url, b)).body) for b in BODIES]
        requests = [BODIES[i % len(BODIES)] for i in range(6)]
        replies = await asyncio.gather(*(fetch(session, gw.url, b) for b in requests))
    errors = [r for r in replies if r.status != 200 or r.error is not None]
    assert errors == []  # primary error rate: 0 of 6
    for i, reply in enumerate(replies):
        assert strip_stamps(reply.body) == expected[i % len(BODIES)]
    exchanges = await wait_for_exchanges(gw.sink, len(requests))
    assert {e.primary.outcome for e in exchanges} == {"completed"}
    assert [len(e.shadows) for e in exchanges] == [1] * len(requests)
    assert {e.shadows[0].outcome for e in exchanges} == {SHADOW_FAULTS[fault]}
    if fault.startswith("hang"):
        # The client had its whole answer before the hung shadow even timed out.
        last_reply_ns = max(r.done_ns for r in replies)
        assert all(last_reply_ns < e.shadows[0].end_ns for e in exchanges)
    if fault == "malformed":
        recordings = [e.shadows[0].recording for e in exchanges]
        assert any(r is not None and r.parse_error for r in recordings)


PRIMARY_FAULTS = [
    # (fault, stream, client status, client sees a cut stream, primary outcome)
    ("refused", True, 502, False, "upstream_error"),
    ("status=500", True, 500, False, "upstream_status"),
    ("status=500", False, 500, False, "upstream_status"),
    ("hang_before_headers", True, 504, False, "upstream_timeout"),
    ("drop_after=3", True, 200, True, "upstream_error"),
    ("hang_after=3", True, 200, True, "upstream_timeout"),
    ("drop_after=0", False, 200, True, "upstream_error"),
]


@pytest.mark.parametrize(
    ("fault", "stream", "status", "cut", "outcome"),
    PRIMARY_FAULTS,
    ids=[f"{f}-{'stream' if s else 'whole'}" for f, s, *_ in PRIMARY_FAULTS],
)
async def test_a_failing_primary_reaches_the_client_as_its_own_failure_and_is_recorded(
    sims, gateway, write_policy, fault, stream, status, cut, outcome
):
    if fault == "refused":
        primary_url = closed_url()
    else:
        primary_url = (await sims(faults=parse_faults(fault))).base_url
    candidate = await sims(mode="speculative")
    text = shadow_policy(primary_url, candidate.base_url, extra=NEVER_OPEN)
    # The idle timeout is what ends the hung cases; it is 1 s, not less, so that a healthy
    # primary's chunk gap on a loaded 2-core machine is never mistaken for a hang.
    gw = await gateway(
        None,
        policy_path=write_policy(text),
        upstream=UpstreamSettings(idle_timeout_s=1.0, retry_initial_s=0.01, retry_max_s=0.02),
    )
    body = chat(stream=stream)
    direct = None
    async with aiohttp.ClientSession() as session:
        if fault not in ("refused", "hang_before_headers", "hang_after=3"):
            direct = await fetch(session, primary_url, body)
        reply = await fetch(session, gw.url, body)
    assert reply.status == status
    assert (reply.error is not None) == cut
    if fault in ("status=500", "drop_after=3", "drop_after=0"):
        assert direct is not None
        assert strip_stamps(reply.body) == strip_stamps(direct.body)  # what a direct client got
    if status in (502, 504):
        assert b'"code":"upstream_' in reply.body
    assert b"[DONE]" not in reply.body or not cut
    (exchange,) = await wait_for_exchanges(gw.sink, 1)
    assert exchange.primary.outcome == outcome
    # The healthy shadow ran and is in the same exchange.
    assert [s.outcome for s in exchange.shadows] == ["completed"]


async def test_a_hung_shadow_cannot_hold_a_failed_exchange_past_its_deadline(
    sims, gateway, write_policy
):
    primary = await sims(faults=parse_faults("status=500"))
    hung = await sims(mode="speculative", faults=parse_faults("hang_before_headers"))
    text = shadow_policy(primary.base_url, hung.base_url, idle_s=60, total_s=0.5)
    gw = await gateway(None, policy_path=write_policy(text))
    async with aiohttp.ClientSession() as session:
        reply = await fetch(session, gw.url, chat(stream=True))
        assert reply.status == 500
    exchange = await gw.sink.wait_for(timeout_s=5)
    assert exchange.primary.outcome == "upstream_status"
    (shadow,) = exchange.shadows
    assert shadow.outcome == "deadline"
    # Order, on one clock (the gateway runs in this process): the client had its whole reply, and
    # the primary leg had ended, before the shadow was cut at its 0.5 s deadline — the client
    # never waited for the shadow; the outcome says the deadline, not the 60 s idle, ended it.
    assert exchange.primary.end_ns < shadow.end_ns and reply.done_ns < shadow.end_ns


# -- the collector ------------------------------------------------------------------------------


async def _median_e2e_s(url: str, n: int) -> float:
    samples = []
    async with aiohttp.ClientSession() as session:
        await fetch(session, url, chat(stream=True, max_tokens=4))  # warm the pools
        for _ in range(n):
            started = time.perf_counter()
            reply = await fetch(session, url, chat(stream=True, max_tokens=4))
            assert reply.status == 200 and reply.error is None
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


# A latency ratio on the wall clock (median e2e with the dead collector against without): the
# timing tier, run alone (docs/testing.md).
@pytest.mark.timing
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("collector", ["down", "black_hole"])
async def test_a_dead_or_black_holed_collector_costs_the_primary_nothing(
    sims, gateway, write_policy, collector, protocol, record_property
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    text = shadow_policy(primary.base_url, candidate.base_url, extra=NEVER_OPEN)
    off = await gateway(
        None,
        policy_path=write_policy(text),
        telemetry=build_telemetry(TelemetrySettings.from_env({"SPECSHADOW_TELEMETRY": "off"})),
    )
    with BlackHole() as hole:
        endpoint = hole.endpoint if collector == "black_hole" else closed_url()
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
            "OTEL_BSP_SCHEDULE_DELAY": "20",
            "OTEL_BSP_MAX_QUEUE_SIZE": "64",
            "OTEL_METRIC_EXPORT_INTERVAL": "100",
            "OTEL_METRIC_EXPORT_TIMEOUT": "500",
        }
        on = await gateway(
            None,
            policy_path=write_policy(text),
            telemetry=build_telemetry(TelemetrySettings.from_env(env)),
        )
        baseline_s = await _median_e2e_s(off.url, 20)
        with_dead_collector_s = await _median_e2e_s(on.url, 40)  # > the 64-span queue: drops
        record_property("median_e2e_ms", [baseline_s * 1e3, with_dead_collector_s * 1e3])
        # Generous: a noisy 2-core machine; a blocking export would cost ≥ 500 ms per request.
        assert with_dead_collector_s < 2 * baseline_s + 0.02, (baseline_s, with_dead_collector_s)
        exchanges = await wait_for_exchanges(on.sink, 41)
        assert {e.primary.outcome for e in exchanges} == {"completed"}
        await on.server.close()  # shutdown is bounded even while the collector hangs


# -- the policy file ----------------------------------------------------------------------------


def failed_more_than(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda status: bool(status["last_reload"]["failures"] > n)


def damage_file(path: str, how: str, good: str) -> None:
    if how == "delete":
        os.unlink(path)
    elif how == "truncate":  # a writer that is not atomic, caught halfway
        Path(path).write_text(good[: len(good) // 2])
    elif how == "empty":
        Path(path).write_bytes(b"")
    else:
        Path(path).write_bytes(b"\x00\xff\xfe{{{: [\n")


async def test_policy_file_deleted_truncated_or_invalid_mid_run_keeps_the_last_good_policy(
    sims, gateway, write_policy
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    good = shadow_policy(primary.base_url, candidate.base_url, extra=NEVER_OPEN)
    path = write_policy(good)
    gw = await gateway(None, policy_path=path, policy_poll_s=0.02)
    stop = asyncio.Event()
    statuses: list[int] = []

    async def traffic() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                reply = await fetch(session, gw.url, chat(stream=True, max_tokens=3))
                statuses.append(reply.status if reply.error is None else -1)

    async def admin() -> dict:
        result: dict = await get_json(gw.url, "/admin/policy")
        return result

    # A valid edit first: proves the watcher has taken its first fingerprint (a file deleted
    # before that moment goes unnoticed — see docs/reliability.md).
    write_policy(good.replace("ratio: 1.0", "ratio: 1"))
    await wait_until(admin, lambda s: s["generation"] == 2, timeout_s=5)
    load = asyncio.ensure_future(traffic())
    failures = 0
    try:
        for damage in ("delete", "truncate", "empty", "invalid", "garbage"):
            if damage == "invalid":
                write_policy(good.replace("ratio: 1.0", "ratio: 7"))
            else:
                damage_file(path, damage, good)
            status = await wait_until(admin, failed_more_than(failures), timeout_s=5)
            failures = status["last_reload"]["failures"]
            assert status["last_reload"]["ok"] is False, damage
            assert status["generation"] == 2, damage
            await asyncio.sleep(0.05)  # requests keep flowing meanwhile
        write_policy(good.replace("ratio: 1.0", "ratio: 0.0"))
        status = await wait_until(admin, lambda s: s["generation"] == 3, timeout_s=5)
        assert status["last_reload"]["ok"] is True
    finally:
        stop.set()
        await load
    assert len(statuses) >= 5
    assert set(statuses) == {200}  # no request failed while the file was broken
    mirrored = [e for e in gw.sink.exchanges if e.policy_generation == 2]
    assert mirrored and all(len(e.shadows) == 1 for e in mirrored)
