"""``specshadow demo --llamacpp`` runs the demo's shadow story on llama.cpp's own server.

The subprocess reuses the session's servers through ``--llamacpp-urls``: the plain server as
primary and as baseline, the draft-model server as candidate (starting three more would cover
nothing the session fixture does not). Everything else — the gateway, the policy, loadgen, the
records store, the report — runs as a user would run it.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from backends.llamacpp import LlamaServer
from core import jsonx

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e, pytest.mark.timeout(300)]


def test_demo_llamacpp_mirrors_every_request_and_finds_the_draft_model_lossless(
    llamacpp_servers: dict[str, LlamaServer], tmp_path: Path
) -> None:
    out = tmp_path / "demo"
    urls = ",".join(llamacpp_servers[name].base_url for name in ("plain", "draft", "plain"))
    args = ["--llamacpp-urls", urls, "--requests", "6", "--ratio", "1.0", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "specshadow", "--log-level", "WARNING", "demo", "--llamacpp", *args],
        capture_output=True,
        timeout=240,
    )
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert "mirrored 6 of 6 requests" in stdout
    assert "errors 0" in stdout
    assert "greedy exact match, primary vs candidate: 6/6" in stdout, stdout
    assert "candidate acceptance (llama.cpp per-request metrics, pooled)" in stdout
    html = (out / "report" / "report.html").read_text()
    assert "<img" in html and "Bottom line" in html
    with sqlite3.connect(out / "records.sqlite") as db:
        rows = [jsonx.loads(r) for (r,) in db.execute("select record from records")]
    assert len(rows) == 6
    for record in rows:
        candidate = next(leg for leg in record["legs"] if leg["role"] == "candidate")
        assert candidate["acceptance"]["source"] == "llamacpp_timings"
        assert candidate["acceptance"]["num_draft_tokens"] > 0
        assert candidate["engine"]["settings"]["engine"] == "llamacpp"


def test_vllm_and_llamacpp_together_is_one_clear_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specshadow",
            "demo",
            "--vllm",
            "--llamacpp",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.decode().strip().splitlines() == [
        "specshadow demo: --vllm and --llamacpp are two demos; give one"
    ]
    assert not proc.stdout
