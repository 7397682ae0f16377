"""vLLM's own benchmark client through the gateway agrees with what the gateway recorded.

``vllm bench serve`` (from vLLM's environment, concurrency 1, greedy, 24 prompts of the bundled
trace, 48 output tokens) runs through an in-process gateway in front of the session's plain and
n-gram servers; its per-request TTFT / TPOT / ITL are paired by ``x-request-id`` with the
gateway's primary-leg recordings (:mod:`specshadow.agreement`). Tolerances, from measurements on
a 2-core machine (docs/vllm.md):

- TTFT: the bench's clock contains the gateway's, so its TTFT is larger by the gateway's own path
  plus loopback and the bench client's processing. Measured per-request offset p50 2.3–2.9 ms, of
  which the gateway's share (request in → upstream out, chunk in → out) was ~0.2 ms; on a later
  machine (kernel 6.18, where a raw 60-line aiohttp relay adds 20–28 ms of TTFT in
  bench/proxy_overhead.py early that day, 1.4–1.5 ms later on the idle machine) the offset read 9.9–22.7 ms and the gateway's share 1.0–1.7 ms.
  Asserted: offset p50 > 0 and the gateway's share < 5 ms. The offset's size is the bench client's
  and the machine's (a process hop), not the gateway's: it is reported, like the unpaired medians.
- TPOT and ITL: the constant offsets cancel; measured |Δ median| ≤ 0.07 ms (ITL also sees the
  bench's extra ~0 gap after vLLM's role-only first chunk, −0.25 ms once). Asserted:
  |Δ median| ≤ max(1.0 ms, 10 %); ITL's mean gap too; the median of the step gaps (≥ 0.5 ms) only
  where the bench client read the chunks as they were sent (a starved client reads a burst at
  once) and most gaps are steps on both sides; ITL's median also only where it is well posed, at
  most 35 % of gaps ≈ 0 on either side (where events arrive in bursts the gaps are two modes, ≈ 0
  inside a burst and about one engine step between bursts, and with about half of them ≈ 0 the
  median falls anywhere between the modes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.server import VllmServer
from backends.setup import VllmEnv
from loadgen.trace import bundled_trace
from specshadow.agreement import Agreement, dataset_prompts, format_agreement, run_agreement

# Offsets and gaps in milliseconds on the wall clock: timing claims. They run in the vllm tier
# (they need its servers), after its functional tests, once and never retried.
pytestmark = [pytest.mark.vllm, pytest.mark.timing, pytest.mark.timeout(1800)]

REQUESTS = 24
# The gateway's own share of the TTFT offset (request in → upstream out, chunk in → out), in ms:
# measured 0.13–0.17 ms on one machine and 1.0–1.7 ms on a later one (docs/vllm.md).
GATEWAY_SHARE_MAX_MS = 5.0
STEADY_ABS_TOL_MS = 1.0  # one CI run on the shared 2-core machine saw 0.9 ms on ITL
STEADY_REL_TOL = 0.10
BURST_SLACK = 0.25  # the bench's share of ≈ 0 gaps beyond the gateway's before its median is moot
# The most ≈ 0 gaps on either side for which ITL's median is held: it is then the
# (0.5 − s)/(1 − s) quantile of the step gaps, at most their 23rd percentile, and a few points of
# difference in s between the sides moves it within the step mode, not out of it.
MEDIAN_WELL_POSED = 0.35
STEP_WELL_POSED = 0.5  # the most ≈ 0 gaps on either side for which the step gaps' median is held


@pytest.fixture(scope="module", params=["plain", "ngram"])
def agreement(
    request: pytest.FixtureRequest,
    vllm_env: VllmEnv,
    vllm_servers: dict[str, VllmServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Agreement:
    server = vllm_servers[request.param]
    prompts = dataset_prompts([row.body for row in bundled_trace()], REQUESTS)
    work_dir: Path = tmp_path_factory.mktemp(f"agreement-{request.param}")
    result = asyncio.run(run_agreement(vllm_env, server.base_url, work_dir, prompts=prompts))
    print(format_agreement(result, request.param))  # shown with -s
    return result


def test_every_bench_request_is_paired_with_the_gateways_record_of_it(
    agreement: Agreement,
) -> None:
    assert agreement.requests == REQUESTS
    assert agreement.paired == REQUESTS
    assert agreement.texts_equal == REQUESTS  # the bench saw exactly the primary's text


def test_bench_ttft_contains_the_gateways_and_the_gateways_own_share_is_small(
    agreement: Agreement,
) -> None:
    assert agreement.ttft_offset_p50_ms > 0  # the bench's interval contains the gateway's
    own = agreement.gateway_pre_upstream_p50_ms + (agreement.gateway_overhead_p50_ms or 0.0)
    print(
        f"\nTTFT offset p50 {agreement.ttft_offset_p50_ms:.2f} ms, the gateway's share {own:.2f} ms"
    )
    assert own < GATEWAY_SHARE_MAX_MS
    # The rest of the offset is the bench client's processing and the hop between two processes:
    # 2.3–2.9 ms on one machine, 9.9–22.7 ms on a later one (same code), so not held. What would
    # show a mispairing (a wrong request's timings) is held exactly: every text equal, by id.
    # The two samples' medians, unpaired, are reported (format_agreement), not held: under the
    # flake gate's two busy loops they were 10.4 and 32.7 ms apart (medians 231-258 ms) in two runs
    # whose paired per-request offset stayed within (0, 10] ms on that machine. The median of
    # two samples picks different requests when TTFT spreads; the pairing is what removes that.


def test_bench_tpot_median_matches_the_gateways(agreement: Agreement) -> None:
    m = agreement.metric("tpot")
    assert abs(m.offset_ms) <= max(STEADY_ABS_TOL_MS, STEADY_REL_TOL * m.gateway_median_ms), m


def test_bench_itl_matches_the_gateways(agreement: Agreement) -> None:
    # The mean gap always agrees (a request's gaps add up to its decode time on both sides; the
    # bench's one extra ≈ 0 gap per request lowers its mean by 1/gaps, a few %).
    (b_mean, g_mean), (b_burst, g_burst) = agreement.itl_mean_ms, agreement.itl_burst_share
    assert abs(b_mean - g_mean) <= max(STEADY_ABS_TOL_MS, STEADY_REL_TOL * g_mean), agreement
    # The median only where the bench read the chunks as the gateway sent them: a starved bench
    # client reads a burst at once, and more than half its gaps become ≈ 0 (one clean CI run:
    # n-gram ITL median 0.05 ms against the gateway's 4.59, TPOT agreeing within 1 ms) — the
    # client's processing, not the server's (docs/vllm.md). Its share of gaps under 0.5 ms says so.
    if b_burst > g_burst + BURST_SLACK:
        print(f"ITL medians not compared: the bench read {b_burst:.0%} of gaps in bursts")
        return
    # The step gaps only where they are most gaps on both sides: where most are ≈ 0 the events came
    # in bursts (two busy loops on the 2 cores: 74-99 % ≈ 0, TPOT median 0), and
    # the few gaps left are stalls whose reading holds each reader's processing of the burst
    # before them (bench 121.7 / gateway 110.8 ms, as its TTFT offset grew to 12 ms).
    shares = f"{b_burst:.0%} / {g_burst:.0%} of gaps ≈ 0"
    if max(b_burst, g_burst) > STEP_WELL_POSED:
        print(f"ITL medians not compared: {shares}, the events came in bursts")
        return
    # One engine step between events: both sides see the same steps.
    step = agreement.metric("itl_step")
    assert abs(step.offset_ms) <= max(STEADY_ABS_TOL_MS, STEADY_REL_TOL * step.gateway_median_ms), (
        step
    )
    # The whole median only where it lies inside the step mode on both sides (one CI run's n-gram
    # primary: 49 % and 47 % of gaps ≈ 0, medians 1.18 and 4.89 ms, means 3.89 and 4.08 ms).
    if max(b_burst, g_burst) > MEDIAN_WELL_POSED:
        print(f"ITL median not compared: {shares}, two modes")
        return
    m = agreement.metric("itl")
    assert abs(m.offset_ms) <= max(STEADY_ABS_TOL_MS, STEADY_REL_TOL * m.gateway_median_ms), m
