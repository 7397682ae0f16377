"""The application's own spans give a run its true start and end: records and the Collector's
ClickHouse traces table in one chDB store, read by ``specshadow report``.

Each run opens with 2 s of retrieval and closes with a 1 s tool call the gateway never sees;
the application's root span covers them. The truth is the script's: that time is kept, like
the time between calls. The gateway's own spans in the same table (a shadow leg ending long
after the client had its answer) are not the application's time and must not stretch the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from records.clickhouse import ChdbEngine, ClickHouseStore
from specshadow.main import main
from tests.report.test_workflows import C, script

LEAD, TAIL = 2.0, 1.0
TRACES = """CREATE TABLE otel_traces (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)), TraceId String, SpanId String,
    ParentSpanId String, SpanName LowCardinality(String), ServiceName LowCardinality(String),
    Duration UInt64
) ENGINE = MergeTree ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))"""


def span(trace: str, name: str, service: str, start_ns: int, end_ns: int) -> str:
    """One row of the exporter's table (its trace id as the SDK writes it, any case)."""
    return (
        f"(fromUnixTimestamp64Nano(toInt64({start_ns})), '{trace.upper()}', '{start_ns:016x}', "
        f"'', '{name}', '{service}', {end_ns - start_ns})"
    )


def test_the_applications_spans_extend_a_run_to_its_true_start_and_end(tmp_path: Path) -> None:
    runs = [
        script(
            [([C(0.05, 0.6)], 0.2), ([C(0.05, 0.6)], 0.2), ([C(0.05, 0.6)], 0.0)],
            trace=f"{i:032x}", start=30.0 * i, kind="rag",
        )
        for i in range(1, 4)
    ]  # fmt: skip
    records = [r for recs, _, _ in runs for r in recs]
    rows = []
    for recs, prod, _ in runs:
        trace = recs[0]["workflow"]["trace_id"]
        first = recs[0]["started_unix_ns"]
        start, end = first - int(LEAD * 1e9), first + int((prod + TAIL) * 1e9)
        rows.append(span(trace, "agent run", "rag-app", start, end))
        # the gateway's shadow leg, ending 10 s after the run: not the application's time
        rows.append(span(trace, "chat spec", "specshadow", first, end + 10 * 10**9))
    folder = tmp_path / "chdb"
    store = ClickHouseStore(ChdbEngine(str(folder)))
    try:
        store.append(records)
        store.engine.execute(TRACES)
        store.engine.execute(f"INSERT INTO otel_traces VALUES {', '.join(rows)}")
    finally:
        store.close()

    out = tmp_path / "report"
    assert main(["report", "--store", f"chdb://{folder}", "--out", str(out)]) == 0
    got = json.loads((out / "report.json").read_text())["workflows"]["rag"]
    prod = sum(p + LEAD + TAIL for _, p, _ in runs)
    cand = sum(c + LEAD + TAIL for _, _, c in runs)
    assert got["wall_s"] == pytest.approx(prod / len(runs))
    assert got["projected_e2e_speedup"]["estimate"] == pytest.approx(prod / cand)
    # without the spans the gateway sees only the calls and the time between them
    seen = sum(p for _, p, _ in runs) / sum(c for _, _, c in runs)
    assert seen > 1.1 * got["projected_e2e_speedup"]["estimate"]
    assert (
        "3 with their true start and end from the application's own spans"
        in (out / "report.md").read_text()
    )
