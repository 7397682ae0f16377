"""Every leg carries its backend's load at dispatch, and every record the exchange's load parity:
per-replica arrival rate of the candidate over the primary's — what load-matched mirroring makes 1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.headers import upstream_request_headers
from gateway.load import BackendLoad
from gateway.settings import Settings
from policies.shape import shape_shadow_body
from records.sqlite_store import query_records
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

REQUESTS = 200


def test_a_backends_rate_is_its_dispatches_over_the_window() -> None:
    load = BackendLoad(window_s=2.0)
    stamps = [load.dispatch(replicas=4, now_ns=int(i * 0.1e9)) for i in range(41)]  # 10/s for 4 s
    assert stamps[-1].in_flight == 41  # none finished
    assert stamps[-1].rate_rps == pytest.approx(10.5, abs=0.6)  # the last 2 s only
    assert stamps[-1].per_replica_rate_rps == pytest.approx(stamps[-1].rate_rps / 4)
    assert stamps[5].rate_rps == pytest.approx(6.0)  # before a window has passed: over 1 s
    load.done()
    assert load.dispatch(replicas=4, now_ns=int(4.1e9)).in_flight == 41


def policy(primary: str, candidate: str, *, ratio: Any, primary_replicas: int) -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim, replicas: {primary_replicas}}}\n"
        f"  cand: {{url: '{candidate}', kind: sim, replicas: 1}}\n"
        "primary: prim\n"
        f"default: {{ratio: {ratio}, legs: [{{backend: cand, role: candidate}}]}}\n"
        "budgets: {max_in_flight: 1000}\n"
    )


# Parity is measured from arrival rates on the wall clock, within a band: a timing claim (the
# timing tier, docs/testing.md). A CI run at load average 17 read 0.074 for a tenth.
@pytest.mark.timing
@pytest.mark.parametrize(
    ("ratio", "primary_replicas", "parity"),
    [("load_matched", 4, 1.0), ("0.1", 1, 0.1)],
)
async def test_load_matched_mirroring_gives_parity_one_and_a_ten_percent_mirror_a_tenth(
    sims: Any,
    servers: list[Any],
    write_policy: Callable[[str], str],
    tmp_path: Path,
    ratio: str,
    primary_replicas: int,
    parity: float,
) -> None:
    primary = await sims(batching="continuous", step_s=0.002, prefill_base_s=0.0)
    candidate = await sims(batching="continuous", step_s=0.002, prefill_base_s=0.0)
    settings = Settings(
        policy_path=write_policy(
            policy(
                primary.base_url, candidate.base_url, ratio=ratio, primary_replicas=primary_replicas
            )
        ),
        store_path=str(tmp_path / "r.sqlite"),
        scrape_interval_s=0.05,
        load_window_s=2.0,
        shutdown_timeout_s=2.0,
        upstream=FAST_UPSTREAM,
    )
    server = await start_server(build_app(settings))
    url = str(server.make_url("")).rstrip("/")
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            headers = {"x-request-id": f"q{i}"}
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()

        sent = []
        stamps = []  # when each request left: on a loaded machine the loop runs below 100/s
        for i in range(REQUESTS):  # a steady 100 requests/s, open loop
            stamps.append(time.monotonic())
            sent.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*sent)
        await asyncio.sleep(0.5)
    await server.close()
    records = list(query_records(tmp_path / "r.sqlite"))
    assert len(records) == REQUESTS
    late = [r for r in records[REQUESTS // 2 :] if r["load_parity"] is not None]  # a full window in
    parities = sorted(r["load_parity"] for r in late)
    median = parities[len(parities) // 2]
    assert median == pytest.approx(parity, rel=0.25), parities
    record = max(late, key=lambda r: int(r["request_id"][1:]))  # the last mirrored one sent
    sent_at = stamps[int(record["request_id"][1:])]
    primary_leg, candidate_leg = record["legs"]
    assert (
        primary_leg["load"]["replicas"] == primary_replicas
        and candidate_leg["load"]["replicas"] == 1
    )
    # The truth is the rate the client really sent at over the gateway's 2 s window.
    sent_rate = sum(1 for t in stamps if sent_at - 2.0 <= t <= sent_at) / 2.0
    assert primary_leg["load"]["rate_rps"] == pytest.approx(sent_rate, rel=0.2), sent_rate
    assert primary_leg["load"]["per_replica_rate_rps"] == pytest.approx(
        primary_leg["load"]["rate_rps"] / primary_replicas
    )
    assert candidate_leg["share"] == (0.25 if ratio == "load_matched" else 0.1)
    assert candidate_leg["load_parity"] == record["load_parity"]
    scraped = candidate_leg["load"]["scraped"]
    assert (
        scraped is not None and scraped["num_requests_running"] >= 0 and abs(scraped["age_s"]) < 1
    )


def test_the_batch_a_leg_decoded_in_is_the_books_in_flight_count_averaged_over_its_interval() -> (
    None
):
    """Ground truth by hand: legs enter and leave at known times; the mean over an interval is
    the area under the in-flight step function divided by its length."""
    s = int(1e9)
    load = BackendLoad(window_s=10.0)
    load.dispatch(1, now_ns=0)  # A: [0, 10 s)
    load.dispatch(1, now_ns=2 * s)  # B: [2 s, 4 s)
    load.done(now_ns=4 * s)
    load.dispatch(1, now_ns=6 * s)  # C: [6 s, ...)
    load.done(now_ns=10 * s)  # A ends
    # Over [1 s, 9 s]: 1 for 1 s, 2 for 2 s, 1 for 2 s, 2 for 3 s → 13 / 8.
    assert load.mean_in_flight(1 * s, 9 * s) == pytest.approx(13 / 8)
    # Past the last mark the current count (C alone) extends.
    assert load.mean_in_flight(10 * s, 12 * s) == pytest.approx(1.0)
    # The count at dispatch would have said 1 for A; it decoded in 1.5 on average over [1, 7].
    assert load.mean_in_flight(1 * s, 7 * s) == pytest.approx((1 + 4 + 2 + 2) / 6)
    assert load.mean_in_flight(5 * s, 5 * s) is None  # no decode interval
    assert load.mean_in_flight(-1, 5 * s) is None  # before the book's first mark


def test_the_books_marks_stay_bounded_and_an_interval_older_than_them_reads_none() -> None:
    load = BackendLoad(window_s=10.0, max_marks=64)
    for i in range(1000):
        load.dispatch(1, now_ns=i * 1000)
        load.done(now_ns=i * 1000 + 500)
    assert load.mean_in_flight(0, 400) is None  # dropped long ago
    # The last legs: in flight half of every microsecond.
    assert load.mean_in_flight(990_000, 999_000) == pytest.approx(0.5)


async def test_both_legs_of_an_exchange_meet_their_rates_at_the_instant_it_mirrored(
    sims: Any,
    servers: list[Any],
    write_policy: Callable[[str], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A starved event loop runs a shadow leg's task late; its load is still stamped with the
    instant the exchange mirrored it. Simulated on the gateway's clock, no wall-clock wait: the
    clock the gateway stamps loads with jumps 1.2 s during the first shadow leg's set-up. Stamped
    when its task ran, that leg's window would start 1.2 s after the primary's, and the second
    exchange (2 dispatches each) would read 2 / 1.0 s against 2 / 1.2 s: parity 1.2 (a CI run
    under two busy loops lost a verdict to such pairs). The primary leg, mirrored with it, is
    stamped with the same instant, not when its own set-up let it leave (50 ms later here)."""
    late_ns = 0

    class Clock:  # the time module, with perf_counter_ns late by late_ns
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def perf_counter_ns() -> int:
            return time.perf_counter_ns() + late_ns

    calls = 0

    def starved(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls, late_ns
        calls += 1
        if calls == 1:
            late_ns = int(1.2e9)  # the loop was busy elsewhere for 1.2 s
        return shape_shadow_body(*args, **kwargs)

    primaries = 0

    def slow_primary_headers(*args: Any, **kwargs: Any) -> Any:
        # The primary's own set-up, after the exchange mirrored and before it leaves: 50 ms on
        # the gateway's clock the second time (a loaded machine; 4.5 ms made parity 0.9966 in a
        # CI run when the primary was stamped when it left).
        nonlocal primaries, late_ns
        primaries += 1
        if primaries == 2:
            late_ns += int(0.05e9)
        return upstream_request_headers(*args, **kwargs)

    monkeypatch.setattr("gateway.shadow.shape_shadow_body", starved)
    monkeypatch.setattr("gateway.proxy.upstream_request_headers", slow_primary_headers)
    monkeypatch.setattr("gateway.load.time", Clock())
    monkeypatch.setattr("gateway.proxy.time", Clock())
    primary = await sims(batching="continuous", step_s=0.002, prefill_base_s=0.0)
    candidate = await sims(batching="continuous", step_s=0.002, prefill_base_s=0.0)
    settings = Settings(
        policy_path=write_policy(
            policy(primary.base_url, candidate.base_url, ratio=1.0, primary_replicas=1)
        ),
        store_path=str(tmp_path / "r.sqlite"),
        load_window_s=10.0,
        shutdown_timeout_s=2.0,
        upstream=FAST_UPSTREAM,
    )
    server = await start_server(build_app(settings))
    url = str(server.make_url("")).rstrip("/")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        for i in range(2):  # one after the other: the second leaves after the first's stall
            headers = {"x-request-id": f"q{i}"}
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
    await server.close()  # records flush
    records = sorted(query_records(tmp_path / "r.sqlite"), key=lambda r: r["request_id"])
    assert [r["request_id"] for r in records] == ["q0", "q1"] and calls == 2
    second = records[1]
    primary_leg, candidate_leg = second["legs"]
    assert primary_leg["load"]["rate_rps"] < 2.0  # over more than a second: the jump is in it
    # One instant for every leg of an exchange: the rates are the same number, not near it.
    assert candidate_leg["load"]["rate_rps"] == pytest.approx(
        primary_leg["load"]["rate_rps"], rel=1e-12
    )
    assert second["load_parity"] == pytest.approx(1.0, rel=1e-12)
