"""Smoke: bench/llamacpp_replay.py runs end to end with a tiny N (it judges no target)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_llamacpp_replay_bench_times_both_proposers_and_vllms_for_scale() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.llamacpp_replay", "--records", "4", "--prompt", "20",
         "--output", "20", "--depths", "2,4"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "4 records, prompt 20, output 20, depths [2, 4]"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "ngram-mod",
        "ngram-map-k",
        "vllm ngram",
    ]
