"""Benchmark matrix: strict files, pairing and the stable region (pure), and a sweep that starts
simulator backends from command templates (e2e)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import pytest

from loadgen.matrix import MatrixError, load_matrix, mark_stable, stable_regions


def cell(backend: str, conc: int, low: float | None, bucket: str = "short") -> dict:
    return {"backend": backend, "bucket": bucket, "concurrency": conc, "reference": "plain",
            "speedup_e2e_ci_low": low}  # fmt: skip


def test_stable_cells_need_their_neighbouring_concurrencies_above_one_too():
    rows = [
        cell("plain", 1, None), cell("plain", 2, None),
        cell("ngram", 1, 1.2), cell("ngram", 2, 1.1), cell("ngram", 4, 1.05),
        cell("ngram", 8, 0.9), cell("ngram", 16, 1.3),
    ]  # fmt: skip
    mark_stable(rows)
    assert [r["stable"] for r in rows] == [None, None, True, True, False, False, False]
    assert stable_regions(rows) == ["ngram × short: speedup CI > 1 at concurrency 1–2"]


def test_a_single_concurrency_cell_is_stable_on_its_own():
    rows = [cell("eagle", 4, 1.4, bucket="long")]
    mark_stable(rows)
    assert rows[0]["stable"] is True
    assert stable_regions(rows) == ["eagle × long: speedup CI > 1 at concurrency 4"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("buckets: {s: 8}\nconcurrency: [1]\nbackends: []\n", "backends"),
        (
            "buckets: {s: 8}\nconcurrency: [1]\nbogus: 1\nbackends: [{name: a, base_url: u}]\n",
            "bogus",
        ),
        ("buckets: {s: 8}\nconcurrency: [0]\nbackends: [{name: a, base_url: u}]\n", "concurrency"),
        (
            "buckets: {s: 8}\nconcurrency: [1]\nreference: b\nbackends: [{name: a, base_url: u}]\n",
            "reference",
        ),
        (
            "buckets: {s: 8}\nconcurrency: [1]\nbackends: [{name: a, base_url: u, proposer: magic}]\n",
            "backends.0.proposer",
        ),
        (
            "buckets: {s: 8}\nconcurrency: [1]\nbackends: [{name: a, base_url: u, ready_url: r}]\n",
            "ready_url needs a command",
        ),
        ("buckets: [\n", "while parsing"),
    ],
)
def test_matrix_files_are_strict_and_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(MatrixError, match=message):
        load_matrix(path)


@pytest.mark.e2e
async def test_a_matrix_sweep_starts_backends_and_pairs_every_cell_with_the_reference(tmp_path):
    """The sweep end to end: backends started from their commands, every cell measured, each
    speculative cell paired request by request with the plain one, and the stable region printed
    as the rows say. How large the speed-up is, is the wall clock's (bench/); here the counts,
    the pairing and the rows' own consistency."""
    sim = "specshadow simulate --port {port} --prefill-ms 1 --step-ms 2 --min-output-tokens 64"
    (tmp_path / "matrix.yaml").write_text(
        textwrap.dedent(f"""
        requests: 6
        warmup: 1
        model: sim-model
        buckets: {{short: 8, long: 24}}
        concurrency: [1, 2]
        slo: {{ttft_s: 1.0}}
        backends:
          - name: plain
            command: "{sim} --mode plain"
            ready_url: "http://127.0.0.1:{{port}}/health"
            base_url: "http://127.0.0.1:{{port}}/v1"
            metrics_url: "http://127.0.0.1:{{port}}/metrics"
          - name: ngram-k4
            proposer: ngram
            depth: 4
            command: "{sim} --mode speculative --k 4 --acceptance 0.9"
            ready_url: "http://127.0.0.1:{{port}}/health"
            base_url: "http://127.0.0.1:{{port}}/v1"
    """)
    )
    out = tmp_path / "results.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specshadow", "matrix", str(tmp_path / "matrix.yaml"), "--out", str(out),
        "--no-progress", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2
    assert {(r["backend"], r["bucket"], r["concurrency"]) for r in rows} == {
        (b, k, c) for b in ("plain", "ngram-k4") for k in ("short", "long") for c in (1, 2)
    }
    assert all(r["schema"] == "specshadow.matrix/1" and r["succeeded"] == 6 for r in rows)
    plain = [r for r in rows if r["backend"] == "plain"]
    spec = [r for r in rows if r["backend"] == "ngram-k4"]
    assert all(r["speedup_e2e"] is None and r["stable"] is None for r in plain)
    assert all(r["kv_cache_usage_peak"] is not None for r in plain)
    for r in spec:  # every measured request paired with the plain one on the same trace row
        assert r["paired_n"] == r["succeeded"] == 6 and r["reference"] == "plain"
        for m in ("e2e", "tpot", "ttft"):
            assert r[f"speedup_{m}_ci_low"] <= r[f"speedup_{m}"] <= r[f"speedup_{m}_ci_high"]
        # Stable: this cell's CI above 1 and its neighbours' (here, both of the bucket's cells).
        same = [q["speedup_e2e_ci_low"] for q in spec if q["bucket"] == r["bucket"]]
        assert r["stable"] is all(low > 1 for low in same)
    assert all(r["tokens_per_event_mean"] > 2 for r in spec)  # acceptance 0.9, k = 4: about 4
    regions = stable_regions(rows)
    assert all(f"  {line}\n" in stdout.decode() for line in regions), stdout.decode()
