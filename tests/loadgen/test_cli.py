"""``specshadow loadgen`` as written in the issue, against a simulator subprocess."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from specshadow.main import main

FIELDS = {
    "category", "status", "error", "ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s",
    "chunk_gap_p99_s", "output_tokens", "tokens_per_event", "index", "scheduled_offset_s",
    "sent_offset_s", "tokens_source", "output_events",
}  # fmt: skip


@pytest.fixture
async def simulator_url() -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specshadow", "simulate", "--port", "0", "--mode", "speculative",
        "--prefill-ms", "5", "--step-ms", "2", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        yield line.rsplit(" ", 1)[-1].strip() + "/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)


@pytest.mark.e2e
async def test_loadgen_command_as_written_writes_one_result_line_per_request(
    simulator_url, tmp_path
):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"model": "sim-model", "max_tokens": 24, "category": c, "meta": {"i": i},
                    "messages": [{"role": "user", "content": f"prompt {i}"}]}) + "\n"
        for i, c in enumerate(["chat", "code", "chat"])
    ))  # fmt: skip
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specshadow", "loadgen", "--base-url", simulator_url,
        "--trace", str(trace), "--concurrency", "2", "--max-requests", "5", "--out", str(out),
        "--summary", str(summary), "--slo", "ttft_s=0.004", "--slo", "tpot_s=3600",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 5
    for line in lines:
        assert set(line) >= FIELDS
        assert line["status"] == 200 and line["error"] is None and line["ttft_s"] > 0
        assert line["tokens_source"] == "usage" and line["tokens_per_event"] >= 1.0
    assert [line["category"] for line in lines] == ["chat", "code", "chat", "chat", "code"]
    s = json.loads(summary.read_text())
    # Goodput without the wall clock: no TTFT can be under the simulator's 5 ms prefill (the first
    # token is sent after it), and the run's 60 s deadline bounds every TPOT far below 3600 s.
    # So every request misses the TTFT SLO and meets the TPOT one: exactly 0 of 5 are good.
    assert all(line["ttft_s"] > 0.004 for line in lines)
    assert s["overall"]["requests"] == 5 and s["overall"]["goodput_share"] == 0.0
    assert "goodput (ttft_s ≤ 0.004, tpot_s ≤ 3600): 0/5" in stdout.decode()
    assert "5/5" in stderr.decode()  # the progress line


def test_loadgen_rejects_a_missing_base_url_and_a_bad_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "m"}\n')
    assert main(["loadgen", "--trace", str(bad), "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert main(["loadgen"]) == 2
    err = capsys.readouterr().err
    assert "trace line 1: neither 'messages'" in err and "--base-url is required" in err
