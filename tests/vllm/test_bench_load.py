"""Smoke: ``bench.vllm_load`` runs end to end on the session's real vLLM servers, at one rate
(2 requests/s, three-second phases: 8 arrivals of the fixed-seed schedule in each).

Proves the harness works — the direct A/B and both mirrors run, the gateway's records feed the
report, every row of the table is filled — and that the 10 % mirror is never called adopt. It
judges no speed-up: three seconds of a shared 2-core machine say nothing about one (the measured
table is in docs/vllm.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.server import VllmServer

# 1200 s: the first vLLM test of a run also waits for the session's servers to start (up to
# backends.server.READY_TIMEOUT_S) inside its timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_load_bench_fills_every_row_and_never_adopts_a_ten_percent_mirror(
    vllm_servers: dict[str, VllmServer], tmp_path: Path
) -> None:
    urls = f"{vllm_servers['plain'].base_url},{vllm_servers['ngram'].base_url}"
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vllm_load", "--urls", urls, "--rates", "2.0",
         "--duration", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    # One rate is enough for a smoke: a second one runs the same code again (the table's two
    # rates are docs/vllm.md's measured run).
    assert [(r["rate_rps"], r["mirror"]) for r in rows] == [(2.0, "load_matched"), (2.0, "0.1")]
    for r in rows:
        assert r["truth"] is not None and r["truth"] > 0 and r["truth_after"] is not None
        assert r["verdict"] in ("adopt", "do_not_adopt", "not_enough_data", "not_load_matched")
        if r["mirror"] == "0.1":
            assert r["verdict"] != "adopt"
        else:
            assert r["pairs"] >= 3  # every request mirrored (8 sent)
    assert "plain vs n-gram on vLLM's CPU build" in proc.stdout
