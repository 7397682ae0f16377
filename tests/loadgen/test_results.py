"""Summaries, goodput against SLOs, the terminal table and the progress line (pure)."""

from __future__ import annotations

import io

import pytest

from loadgen.client import RequestResult
from loadgen.progress import Progress
from loadgen.results import SloError, format_summary, meets_slos, parse_slo, summarize


def result(
    i: int,
    *,
    ttft: float | None,
    tpot: float | None,
    error: str | None = None,
    category: str = "chat",
    warmup: bool = False,
) -> RequestResult:
    return RequestResult(
        index=i, record_index=i, warmup=warmup, category=category,
        status=200 if error is None else 500, outcome="completed" if error is None else "upstream_status",
        error=error, error_type=None if error is None else "upstream_status",
        scheduled_offset_s=None, sent_offset_s=0.0, send_delay_s=0.0,
        ttft_s=ttft, tpot_s=tpot, e2e_s=None if ttft is None else ttft + 1.0,
        chunk_gap_p50_s=tpot, chunk_gap_p99_s=tpot, chunk_gap_max_s=tpot,
        output_tokens=None if ttft is None else 10, tokens_source="usage", output_events=5,
        tokens_per_event=2.0, prompt_tokens=3, response_model="m",
    )  # fmt: skip


def test_slos_parse_and_reject_unknown_names_and_bad_limits():
    assert parse_slo("ttft_s=0.5") == ("ttft_s", 0.5)
    for bad in ("ttft=0.5", "ttft_s", "ttft_s=abc", "tpot_s=-1", "e2e_s=inf"):
        with pytest.raises(SloError):
            parse_slo(bad)


def test_goodput_counts_successes_meeting_every_defined_slo():
    slos = {"ttft_s": 0.5, "tpot_s": 0.05}
    assert meets_slos({"error": None, "ttft_s": 0.4, "tpot_s": 0.04}, slos)
    assert not meets_slos({"error": None, "ttft_s": 0.6, "tpot_s": 0.04}, slos)
    assert meets_slos({"error": None, "ttft_s": 0.4, "tpot_s": None}, slos)  # undefined: no fail
    assert not meets_slos({"error": "HTTP 500", "ttft_s": 0.1}, slos)


def test_the_summary_excludes_warmups_and_reports_percentiles_per_category():
    results = [
        result(0, ttft=9.0, tpot=9.0, warmup=True),
        *(result(i, ttft=0.1 * i, tpot=0.01) for i in range(1, 11)),
        result(11, ttft=None, tpot=None, error="HTTP 500", category="code"),
    ]
    s = summarize(results, slos={"ttft_s": 0.55}, wall_s=2.0, run={"mode": "concurrency"})
    o = s["overall"]
    assert s["warmup_requests"] == 1 and o["requests"] == 11 and o["failed"] == 1
    assert o["errors"] == {"upstream_status": 1}
    assert o["metrics"]["ttft_s"]["p50"] == pytest.approx(0.55)
    assert o["metrics"]["ttft_s"]["max"] == pytest.approx(1.0)
    assert o["good"] == 5 and o["goodput_share"] == pytest.approx(5 / 11)
    assert s["goodput_requests_per_s"] == pytest.approx(2.5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(50.0)
    assert set(s["categories"]) == {"chat", "code"}
    table = format_summary(s)
    assert "goodput (ttft_s ≤ 0.55): 5/11" in table and "ttft (ms)" in table and "code" in table


def test_progress_prints_a_line_per_tenth_when_not_a_terminal():
    out = io.StringIO()
    bar = Progress(20, stream=out)
    for i in range(20):
        bar(result(i, ttft=0.1, tpot=0.01, error="x" if i == 3 else None))
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("[" + "#" * 30 + "] 20/20  failed 1")
