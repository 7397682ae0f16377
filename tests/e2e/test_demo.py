"""The README's first command, shortened: the demo runs the whole story and leaves its evidence."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_replays_through_the_gateway_and_writes_records_and_a_report(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specshadow",
            "--log-level",
            "WARNING",
            "demo",
            "--requests",
            "16",
            "--concurrency",
            "4",
            "--ratio",
            "1.0",
            "--out",
            str(out),
        ],
        capture_output=True,
        timeout=180,
    )
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert "mirrored 16 of 16 requests" in stdout
    assert "errors 0" in stdout
    html = (out / "report" / "report.html").read_text()
    assert "<img" in html and "Bottom line" in html
    with sqlite3.connect(out / "records.sqlite") as db:
        (count,) = db.execute("select count(*) from records").fetchone()
    assert count == 16
    # the demo never prints prompt or output text (some trace rows are profane)
    assert "Komentar" not in stdout
