"""Smoke: bench/crossvocab_replay.py runs end to end with a tiny N (it judges no target)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_crossvocab_replay_bench_times_both_rules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.crossvocab_replay", "--records", "3", "--prompt", "10",
         "--output", "12", "--top", "5", "--depths", "1,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "3 records, prompt 10, output 12, top 5, depths [1, 2]"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["tli", "slem"]
