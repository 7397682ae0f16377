"""The /metrics scraper: parsing vLLM's exposition, window arithmetic, and a backend that goes
down and comes back on the same port."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from core.tasks import TaskSet
from evidence.scrape import MetricsSample, MetricsScraper, parse_sample, window_stats
from simulator.acceptance import Step
from simulator.app import run_simulator
from simulator.config import SimConfig
from simulator.metrics import SimMetrics
from tests.evidence.legs import some


def sample_of(metrics: SimMetrics, t_s: float) -> MetricsSample:
    return parse_sample(metrics.render().decode(), t_ns=int(t_s * 1e9), unix_ns=0)


def test_counters_from_vllm_exposition_give_rates_over_a_window():
    m = SimMetrics(SimConfig(mode="speculative", num_speculative_tokens=3))
    first = sample_of(m, 0)
    assert first.drafts == 0 and first.per_position == (0.0, 0.0, 0.0)
    for step in (Step(3, 3), Step(3, 1), Step(3, 0), Step(2, 2)):
        m.step(step, first=False, elapsed_s=0.001)
    stats = some(window_stats([first, sample_of(m, 2)]))
    assert stats.window_s == 2.0 and stats.drafts == 4 and stats.draft_tokens == 11
    assert stats.draft_acceptance_rate == pytest.approx(6 / 11)
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.per_position == pytest.approx((3 / 4, 2 / 4, 1 / 4))


def test_a_plain_backend_has_no_spec_decode_rates():
    m = SimMetrics(SimConfig())
    s = sample_of(m, 0)
    assert s.drafts is None and s.kv_cache_usage_perc == 0.0 and s.num_requests_running == 0
    stats = some(window_stats([s, sample_of(m, 1)]))
    assert stats.draft_acceptance_rate is None and stats.mean_acceptance_length is None
    assert window_stats([s]) is None


def test_a_counter_that_drops_is_a_restart_and_counts_from_zero():
    def s(t: float, drafts: float, tokens: float, acc: float) -> MetricsSample:
        return MetricsSample(int(t * 1e9), 0, drafts, tokens, acc, (), None, None)

    stats = some(window_stats([s(0, 10, 40, 20), s(1, 20, 80, 40), s(2, 5, 20, 5)]))
    assert stats.drafts == 15 and stats.draft_tokens == 60 and stats.accepted == 25


async def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def drive(base_url: str, n: int) -> None:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32,
    }
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body["messages"][0]["content"] = f"hi {i}"
            async with session.post(f"{base_url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()


async def test_the_scraper_survives_a_backend_that_goes_down_and_comes_back():
    config = SimConfig(mode="speculative", acceptance=0.6, step_s=0, prefill_base_s=0)
    tasks = TaskSet()
    async with run_simulator(config) as sim:
        port = sim.port
        scraper = MetricsScraper(
            {"cand": f"{sim.base_url}/metrics"},
            interval_s=0.05,
            attempts=2,
            retry_initial_s=0.01,
            retry_max_s=0.02,
            timeout_s=1.0,
        )
        task = tasks.spawn(scraper.run(), name="scraper")
        await wait_until(lambda: scraper.snapshot().get("cand") and scraper.snapshot()["cand"].up)
        await drive(sim.base_url, 10)
        truth = sim.state.requests.values()
        drafted = sum(r.num_draft_tokens for r in truth)
        accepted = sum(r.num_accepted_tokens for r in truth)
        await wait_until(
            lambda: (
                (w := scraper.snapshot()["cand"].window) is not None and w.draft_tokens == drafted
            )
        )
        assert some(scraper.snapshot()["cand"].window).draft_acceptance_rate == pytest.approx(
            accepted / drafted
        )
    # down: polls fail, the loop keeps going
    await wait_until(lambda: not scraper.snapshot()["cand"].up)
    failures = scraper.snapshot()["cand"].failures
    await wait_until(lambda: scraper.snapshot()["cand"].failures > failures)
    assert not task.done()
    assert scraper.snapshot()["cand"].last_error is not None
    # back on the same port, counters restarted from zero
    async with run_simulator(config, port=port) as sim2:
        await wait_until(lambda: scraper.snapshot()["cand"].up)
        await drive(sim2.base_url, 5)
        truth2 = sim2.state.requests.values()
        total = drafted + sum(r.num_draft_tokens for r in truth2)
        await wait_until(lambda: some(scraper.snapshot()["cand"].window).draft_tokens == total)
    task.cancel()
    await tasks.drain(1.0)


SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 7.0
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 3.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0"} 0.42
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="1"} 0.61
"""


def test_load_gauges_are_read_under_vllms_and_sglangs_names():
    m = SimMetrics(SimConfig())
    m.queued()
    m.queued()
    m.started(0.01, prompt_tokens=100)
    vllm = sample_of(m, 0)
    assert (vllm.num_requests_running, vllm.num_requests_waiting) == (1.0, 1.0)
    assert vllm.kv_cache_usage_perc == pytest.approx(100 / 65_536)
    sglang = parse_sample(SGLANG, t_ns=0, unix_ns=0)
    # running and waiting add up over engines; KV usage is the fullest engine's
    assert (sglang.num_requests_running, sglang.num_requests_waiting) == (12.0, 3.0)
    assert sglang.kv_cache_usage_perc == 0.61
    old = parse_sample('vllm:gpu_cache_usage_perc{engine="0"} 0.3\n', t_ns=0, unix_ns=0)
    assert old.kv_cache_usage_perc == 0.3  # the gauge's name before vLLM renamed it


async def test_nearest_finds_the_scrape_closest_to_a_dispatch_time():
    async with run_simulator(SimConfig()) as sim:
        scraper = MetricsScraper({"sim": f"{sim.base_url}/metrics"}, 0.05)
        tasks = TaskSet()
        task = tasks.spawn(scraper.run(), name="scrape")
        samples = scraper._targets["sim"].samples

        async def sampled_after(unix_ns: int) -> None:  # polled state, not a wait on the clock
            for _ in range(2000):
                if samples and samples[-1].unix_ns > unix_ns:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"no sample after {unix_ns}")

        try:
            await sampled_after(time.time_ns() + 200_000_000)
            sim.metrics.queued()  # the backend's queue grows by one from here on
            marked = time.time_ns()
            await sampled_after(marked + 300_000_000)
        finally:
            task.cancel()
            await tasks.drain(1.0)
    before = scraper.nearest("sim", marked - 200_000_000)
    after = scraper.nearest("sim", marked + 200_000_000)
    assert before is not None and after is not None
    assert (before.num_requests_waiting, after.num_requests_waiting) == (0.0, 1.0)
    # The closest of every sample the poller took (how far apart they are is the machine's).
    target = marked + 200_000_000
    assert after.unix_ns == min((x.unix_ns for x in samples), key=lambda t: abs(t - target))
    assert scraper.nearest("sim", marked + 60 * 10**9) is None  # nothing that close
    assert scraper.nearest("other", marked) is None


async def test_recent_acceptance_is_each_scrape_intervals_mean_acceptance_length():
    """What the acceptance guard reads at ``live``: per interval between two scrapes that
    drafted, 1 + accepted ÷ drafts — against the steps the test itself fed the counters; an
    interval with no drafts gives nothing."""
    config = SimConfig(mode="speculative", num_speculative_tokens=3)
    async with run_simulator(config) as sim, aiohttp.ClientSession() as session:
        scraper = MetricsScraper({"sim": f"{sim.base_url}/metrics"}, 60.0)
        await scraper.poll_once(session)
        for step in (Step(3, 3), Step(3, 1)):  # 2 drafts, 4 accepted
            sim.metrics.step(step, first=False, elapsed_s=0.001)
        await scraper.poll_once(session)
        await scraper.poll_once(session)  # nothing drafted in between: no reading
        for step in (Step(3, 0), Step(3, 0), Step(2, 1)):  # 3 drafts, 1 accepted
            sim.metrics.step(step, first=False, elapsed_s=0.001)
        await scraper.poll_once(session)
    readings = scraper.recent_acceptance("sim")
    assert [a for _, a in readings] == pytest.approx([1 + 4 / 2, 1 + 1 / 3])
    assert readings[0][0] < readings[1][0]
    assert scraper.recent_acceptance("other") == []
