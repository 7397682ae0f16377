"""Smoke: ``bench.workers`` runs end to end (relay, one worker, two workers) with a tiny N.

It judges no performance target: the scaling figure is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_workers_benchmark_measures_every_arm(tmp_path: Path) -> None:
    report = tmp_path / "workers.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.workers",
            "--rounds",
            "1",
            "--segment-s",
            "0.5",
            "--concurrency",
            "4",
            "--json",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["arm"]: r for r in json.loads(report.read_text())}
    assert list(rows) == ["relay", "workers-1", "workers-2"]
    for row in rows.values():
        assert row["requests"] > 0 and row["errors"] == 0
    assert "2 workers ÷ 1 worker" in out.stdout
