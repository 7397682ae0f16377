"""Smoke: each benchmark script runs end to end against real processes with a tiny N.

Proves the harness works (processes start and stop, every arm is measured, counters are read);
it judges no performance target — exit status 1 (a target missed on a busy machine) is fine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TINY = [
    "--requests",
    "2",
    "--warmup",
    "1",
    "--max-tokens",
    "3",
    "--step-ms",
    "2",
    "--prefill-ms",
    "1",
]
ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", module, *TINY, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode in (0, 1), out.stdout + out.stderr
    return out


def test_proxy_overhead_measures_direct_gateway_and_relay_at_every_concurrency(tmp_path):
    report = tmp_path / "po.json"
    out = run_bench("bench.proxy_overhead", "--concurrency", "1,2", "--json", str(report))
    data = json.loads(report.read_text())
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert list(level["arms"]) == ["direct", "gateway", "relay"]
        for arm in ("direct", "gateway", "relay"):
            s = level["arms"][arm]
            assert s["requests"] == 2 and s["errors"] == 0
            assert s["ttft"]["n"] == 2 and s["ttft"]["p50_ms"] > 0
            # every event carried a send stamp, and none arrived before it was sent
            assert s["delivery"]["n"] == 2 * 5 and s["delivery"]["p50_ms"] >= 0
    assert [c["name"] for c in data["levels"][0]["checks"]][:2] == [
        "added TTFT p50",
        "added TTFT p99",
    ]
    assert data["levels"][1]["checks"] == []
    assert "Added by each proxy, concurrency 1" in out.stdout
    assert "raw relay's added TTFT" in out.stdout
    assert "load average at start" in out.stdout and "load average at end" in out.stdout


def test_shadow_isolation_keeps_the_primary_whole_and_reads_each_gateways_counters(tmp_path):
    report = tmp_path / "si.json"
    arms = "off,shadow-hung,shadow-refusing"
    out = run_bench("bench.shadow_isolation", "--arms", arms, "--json", str(report))
    data = json.loads(report.read_text())
    assert list(data["arms"]) == arms.split(",")
    for arm in data["arms"].values():
        s = arm["summary"]
        assert s["requests"] == 2 and s["errors"] == 0 and arm["text_mismatches"] == 0
    counts = {
        name: {(c["event"], c["reason"]): c["count"] for c in arm["admin"]["counts"]}
        for name, arm in data["arms"].items()
    }
    assert counts["off"] == {}
    assert counts["shadow-hung"][("sampled", None)] == 3  # warm-up included
    assert data["arms"]["shadow-hung"]["admin"]["in_flight"] >= 1  # still hanging, not cut
    refused = counts["shadow-refusing"]
    assert sum(n for (event, _), n in refused.items() if event in ("failed", "dropped")) == 3
    assert "Gateway /admin/shadow at the end" in out.stdout
