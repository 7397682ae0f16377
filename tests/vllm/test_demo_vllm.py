"""``specshadow demo --vllm`` runs the demo's whole story on real vLLM servers.

The subprocess reuses the session's servers through ``--vllm-urls`` (plain primary, n-gram
candidate, the second plain server as baseline): starting three more would cost about two minutes
on 2 cores, and starting servers is already covered by the session fixture. Everything else — the
gateway, the policy, loadgen, the records store, the report — runs as a user would run it.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from backends.server import VllmServer
from core import jsonx

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(600)]


def test_demo_vllm_mirrors_every_request_and_finds_the_candidate_lossless(
    vllm_servers: dict[str, VllmServer], tmp_path: Path
) -> None:
    out = tmp_path / "demo"
    urls = ",".join(vllm_servers[name].base_url for name in ("plain", "ngram", "baseline"))
    args = ["--vllm-urls", urls, "--requests", "6", "--ratio", "1.0", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "specshadow", "--log-level", "WARNING", "demo", "--vllm", *args],
        capture_output=True,
        timeout=300,
    )
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert "mirrored 6 of 6 requests" in stdout
    assert "errors 0" in stdout
    assert "greedy exact match, primary vs candidate: 6/6" in stdout
    assert "greedy exact match, primary vs baseline: 6/6" in stdout
    assert "candidate acceptance (vLLM per-request metrics, pooled)" in stdout
    html = (out / "report" / "report.html").read_text()
    assert "<img" in html and "Bottom line" in html
    with sqlite3.connect(out / "records.sqlite") as db:
        rows = [jsonx.loads(r) for (r,) in db.execute("select record from records")]
    assert len(rows) == 6
    for record in rows:
        candidate = next(leg for leg in record["legs"] if leg["role"] == "candidate")
        assert candidate["acceptance"]["source"] == "vllm_metrics"
        assert candidate["upstream_model"] == "tiny-llama"
