"""The agreement's pure core and the demo's URL parsing, without vLLM (fast)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.setup import VllmEnv
from core.exchange import Exchange, LegResult, ModelName, RequestId
from core.recorder import StreamRecorder
from specshadow.agreement import (
    MAX_PROMPT_CHARS,
    REQUEST_ID_PREFIX,
    bench_command,
    compare_runs,
    dataset_prompts,
)
from specshadow.demo import parse_vllm_urls

MS = 1_000_000  # ns


def sse(delta: dict[str, object] | None, usage: dict[str, int] | None = None) -> bytes:
    event: dict[str, object] = {"choices": [] if delta is None else [{"index": 0, "delta": delta}]}
    if usage is not None:
        event["usage"] = usage
    return f"data: {json.dumps(event)}\n\n".encode()


def exchange(
    request_id: str, *, ttft_ms: int, gap_ms: int, tokens: int, gaps_us: list[int] | None = None
) -> Exchange:
    """A primary leg whose i-th token event arrives at ttft + i·gap (ms after t0), or after the
    given gaps (µs) between token events."""
    rec = StreamRecorder(t0_ns=0)
    rec.feed(sse({"role": "assistant", "content": ""}), ttft_ms * MS)
    gaps_ns = [g * 1000 for g in gaps_us] if gaps_us is not None else [gap_ms * MS] * (tokens - 1)
    at = ttft_ms * MS
    for i in range(tokens):
        at += gaps_ns[i - 1] if i else 0
        rec.feed(sse({"content": "x"}), at)
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3}
    rec.feed(sse(None, usage), at + gap_ms * MS)
    rec.feed(b"data: [DONE]\n\n", at + gap_ms * MS)
    leg = LegResult(
        role="primary", backend="primary", server_address="127.0.0.1:1", upstream_model="m",
        status=200, outcome="completed", error_type=None,
        recording=rec.finish(outcome="completed", status=200),
        started_unix_ns=1_000_000_000 + 200_000, t0_ns=0, end_ns=0, inflight_at_dispatch=1,
    )  # fmt: skip
    return Exchange(
        exchange_id="e", request_id=RequestId(request_id), route="chat",
        requested_model=ModelName("m"), stream=True, started_unix_ns=1_000_000_000,
        temperature=0, seed=None, category=None, policy_generation=1, policy_rule=None,
        sampled=False, drop_reason=None, primary=leg, shadows=(),
    )  # fmt: skip


def bench_result(ttfts_s: list[float], gap_s: float, tokens: int) -> dict[str, object]:
    return {
        "ttfts": ttfts_s,
        # the bench also counts the ≈ 0 gap after vLLM's role-only chunk
        "itls": [[0.0] + [gap_s] * (tokens - 1) for _ in ttfts_s],
        "latencies": [t + gap_s * (tokens - 1) for t in ttfts_s],
        "output_lens": [tokens for _ in ttfts_s],
        "generated_texts": ["x" * tokens for _ in ttfts_s],
        "errors": ["" for _ in ttfts_s],
    }


def test_compare_runs_pairs_by_request_id_and_reports_the_ttft_offset_only() -> None:
    exchanges = [
        exchange(f"{REQUEST_ID_PREFIX}{i}", ttft_ms=20 + i, gap_ms=5, tokens=8) for i in range(3)
    ]
    exchanges.append(exchange("someone-else", ttft_ms=999, gap_ms=99, tokens=8))
    bench = bench_result([0.023, 0.024, 0.025], 0.005, 8)  # 3 ms later than the gateway
    result = compare_runs(bench, reversed(exchanges))
    assert (result.requests, result.paired, result.texts_equal) == (3, 3, 3)
    assert result.metric("ttft").offset_ms == pytest.approx(3.0)
    assert result.ttft_offset_p50_ms == pytest.approx(3.0)
    assert result.metric("tpot").offset_ms == pytest.approx(0.0, abs=1e-9)
    assert result.metric("itl").gateway_median_ms == pytest.approx(5.0)
    assert result.metric("itl").bench_median_ms == pytest.approx(5.0)
    # the mean gap: the bench's extra ≈ 0 gap after the role chunk is 1 of its 8 per request
    assert result.itl_mean_ms == pytest.approx((5.0 * 7 / 8, 5.0))
    assert result.itl_burst_share == pytest.approx((1 / 8, 0.0))
    assert result.gateway_pre_upstream_p50_ms == pytest.approx(0.2)
    assert result.to_json()["metrics"]["ttft"]["offset_ms"] == pytest.approx(3.0)


def test_the_step_median_is_one_engine_step_where_the_whole_median_falls_between_modes() -> None:
    # A speculating primary: ≈ 0 gaps inside an engine step, 8 ms between steps, about half each.
    # The gateway reads 8 of 17 gaps ≈ 0 (47 %); the bench, with its extra ≈ 0 gap after the role
    # chunk and one step read as two events, 10 of 19 (53 %): the whole medians are 8 ms and
    # 0.1 ms, a mode apart, while the median step gap is 8 ms on both sides.
    gateway_gaps = [100, 8000] * 8 + [8000]
    bench_gaps = [0, *gateway_gaps[:-1], 100, 7900]
    ids = [f"{REQUEST_ID_PREFIX}{i}" for i in range(2)]
    exchanges = [exchange(r, ttft_ms=20, gap_ms=8, tokens=18, gaps_us=gateway_gaps) for r in ids]
    bench = bench_result([0.023, 0.023], 0.008, 18)
    bench["itls"] = [[g / 1e6 for g in bench_gaps] for _ in ids]
    result = compare_runs(bench, exchanges)
    itl, step = result.metric("itl"), result.metric("itl_step")
    assert (itl.bench_median_ms, itl.gateway_median_ms) == pytest.approx((0.1, 8.0))
    assert (step.bench_median_ms, step.gateway_median_ms) == pytest.approx((8.0, 8.0))
    assert result.itl_burst_share == pytest.approx((10 / 19, 8 / 17))
    assert result.itl_mean_ms == pytest.approx(
        (sum(bench_gaps) / 19 / 1000, sum(gateway_gaps) / 17 / 1000)
    )


def test_compare_runs_skips_failed_bench_requests_and_unknown_ids() -> None:
    bench = bench_result([0.02, 0.02], 0.005, 4)
    bench["errors"] = ["boom", ""]
    result = compare_runs(bench, [exchange("other", ttft_ms=20, gap_ms=5, tokens=4)])
    assert (result.requests, result.paired) == (1, 0)


def test_dataset_prompts_keep_single_user_messages_that_fit() -> None:
    rows: list[dict[str, Any]] = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
        {"messages": [{"role": "user", "content": "b"}, {"role": "user", "content": "c"}]},
        {"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]},
        {"prompt": "completions rows are skipped"},
        {"messages": [{"role": "user", "content": "d"}]},
        {"messages": [{"role": "user", "content": "e"}]},
    ]
    assert dataset_prompts(rows, 2) == ["a", "d"]


def test_bench_command_is_greedy_sequential_detailed_and_tagged_with_request_ids(
    tmp_path: Path,
) -> None:
    env = VllmEnv(tmp_path / "venv", tmp_path / "stub", tmp_path / "target", tmp_path / "draft")
    cmd = bench_command(
        env, "http://127.0.0.1:9", tmp_path / "p.jsonl", tmp_path, num_prompts=5, output_len=7
    )
    joined = " ".join(cmd)
    assert cmd[:3] == [str(tmp_path / "venv/bin/vllm"), "bench", "serve"]
    for flag in (
        "--max-concurrency 1", "--temperature 0", "--skip-chat-template", "--save-detailed",
        f"--request-id-prefix {REQUEST_ID_PREFIX}", "--num-prompts 5", "--custom-output-len 7",
    ):  # fmt: skip
        assert flag in joined


def test_parse_vllm_urls_takes_three_base_urls_and_drops_v1() -> None:
    assert parse_vllm_urls("http://a:1/v1, http://b:2/,http://c:3") == (
        "http://a:1",
        "http://b:2",
        "http://c:3",
    )
    with pytest.raises(ValueError, match="PRIMARY,CANDIDATE,BASELINE"):
        parse_vllm_urls("http://a:1,http://b:2")
