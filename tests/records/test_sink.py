"""The evidence worker with the record writer: O(1) submit that drops when full, records with the
promised fields, capture modes, consumers, and a store that survives a killed writer process."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from core.evidence import Evidence
from core.exchange import CaptureSpec
from evidence.worker import EvidenceWorker
from records.sqlite_store import RecordWriter, query_records
from records.writer import SCHEMA
from tests.evidence.legs import exchange, leg

LEG_FIELDS = {
    "role", "backend", "status", "outcome", "ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s",
    "chunk_gap_p99_s", "output_tokens", "tokens_source", "events", "tokens_per_event",
    "acceptance",
}  # fmt: skip
COMPARISON_FIELDS = {"a", "b", "exact_match", "first_divergence", "divergence_unit", "similarity"}
SECRET_TEXT = "mail bob@example.com with key sk-abcdefghijklmnop1234"


def pipeline(
    path: Path, *consumers: Any, queue_size: int = 10_000, batch_size: int = 256
) -> tuple[EvidenceWorker, RecordWriter]:
    writer = RecordWriter(path, batch_size=batch_size)
    return EvidenceWorker([writer, *consumers], maxsize=queue_size), writer


def assert_promised_fields(record: dict[str, Any]) -> None:
    assert record["schema"] == SCHEMA
    assert {"exchange_id", "request_id", "category", "legs", "comparisons"} <= record.keys()
    for leg_record in record["legs"]:
        assert leg_record.keys() >= LEG_FIELDS
        assert {"mean_acceptance_length", "draft_acceptance_rate", "source"} <= leg_record[
            "acceptance"
        ].keys()
    for comparison in record["comparisons"]:
        assert comparison.keys() >= COMPARISON_FIELDS


async def test_every_submitted_exchange_becomes_one_record_with_the_promised_fields(
    tmp_path: Path,
) -> None:
    seen: list[Evidence] = []
    sink, writer = pipeline(tmp_path / "r.db", seen.append)
    async with sink:
        base = leg("baseline")
        for i in range(50):
            sink.submit(exchange(i, shadows=[leg("candidate", ["Hi", " there"]), base]))
        assert await sink.flush()
    records = list(query_records(tmp_path / "r.db"))
    assert len(records) == 50 == writer.written == len(seen)
    for record in records:
        assert_promised_fields(record)
        pairs = [(c["a"], c["b"]) for c in record["comparisons"]]
        assert pairs == [("primary", "candidate"), ("primary", "baseline")]
        cand, base_cmp = record["comparisons"]
        assert cand["exact_match"] is False and cand["flag"] is True
        assert base_cmp["exact_match"] is True and base_cmp["first_divergence"] is None
    assert seen[0].comparisons[0].first_divergence == 1  # "Hello" vs "Hi"


async def test_submit_never_blocks_and_drops_when_the_queue_is_full(tmp_path: Path) -> None:
    sink, writer = pipeline(tmp_path / "r.db", queue_size=5)
    ex = exchange()
    for _ in range(1000):
        sink.submit(ex)  # not started: nothing drains the queue, so a blocking submit would hang
    assert sink.submitted == 5 and sink.dropped == 995
    await sink.start()
    assert await sink.flush()
    await sink.stop()
    assert writer.written == 5  # the five that were queued reached the store…
    # … which keeps the one exchange they all are once (the insert is idempotent on its id)
    assert len(list(query_records(tmp_path / "r.db"))) == 1


@pytest.mark.parametrize(
    ("mode", "text_kept", "redacted"),
    [
        ("off", False, False),
        ("hashes", False, False),
        ("redacted", True, True),
        ("full", True, False),
    ],
)
async def test_text_leaves_only_as_capture_allows(
    tmp_path: Path, mode: Any, text_kept: bool, redacted: bool
) -> None:
    body = {"messages": [{"role": "user", "content": SECRET_TEXT}]}
    primary = leg("primary", [SECRET_TEXT])
    sink, _writer = pipeline(tmp_path / "r.db")
    async with sink:
        sink.submit(
            exchange(
                primary=primary,
                request_json=body,
                capture=CaptureSpec(text=mode, redact=frozenset({"emails", "secrets"})),
            )
        )
        await sink.flush()
    (record,) = query_records(tmp_path / "r.db")
    dumped = repr(record)
    for part in (record["request"], record["legs"][0]["output"]):
        assert len(part["sha256"]) == 64 and part["chars"] == len(SECRET_TEXT)
        assert ("text" in part) is text_kept
    assert ("bob@example.com" in dumped) is (mode == "full")
    assert ("sk-abcdefghijklmnop1234" in dumped) is (mode == "full")
    if redacted:
        assert "[REDACTED_EMAIL]" in record["request"]["text"]
        assert "[REDACTED_SECRET]" in record["legs"][0]["output"]["text"]
    assert record["capture"] == mode


async def test_the_category_comes_from_the_classifier_when_no_header_was_sent(
    tmp_path: Path,
) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"},
    }
    sink, _writer = pipeline(tmp_path / "r.db")
    async with sink:
        sink.submit(exchange(category=None, request_json=body))
        sink.submit(exchange(1, category="rag", request_json=body))
        await sink.flush()
    first, second = query_records(tmp_path / "r.db")
    assert (first["category"], first["category_source"]) == ("structured_output", "classifier")
    assert (second["category"], second["category_source"]) == ("rag", "header")
    assert first["comparisons"][0]["json_expected"] is True


async def test_a_failing_consumer_is_counted_and_the_record_still_written(tmp_path: Path) -> None:
    def broken(_: Evidence) -> None:
        raise RuntimeError("boom")

    sink, writer = pipeline(tmp_path / "r.db", broken)
    async with sink:
        sink.submit(exchange())
        await sink.flush()
    assert sink.consumer_failures == 1 and writer.written == 1


WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from tests.records.test_sink import pipeline
    from tests.evidence.legs import exchange, leg

    async def main(path):
        sink, writer = pipeline(path, batch_size=8)
        await sink.start()
        shadows = [leg("candidate"), leg("baseline")]
        i = 0
        while True:
            for _ in range(10):
                sink.submit(exchange(i, shadows=shadows))
                i += 1
            await sink.flush()
            print(writer.written, flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


def test_a_killed_writer_loses_at_most_the_records_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        text=True,
    )
    assert proc.stdout is not None
    committed = 0
    try:
        deadline = time.monotonic() + 30
        while committed < 300 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            committed = int(line)
        proc.send_signal(signal.SIGKILL)  # mid-way: it keeps submitting and committing
    finally:
        proc.wait(10)
        proc.stdout.close()
    assert committed >= 300
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    records = list(query_records(path))
    assert len(records) >= committed  # everything reported committed survived
    assert [r["exchange_id"] for r in records] == [f"ex-{i:06d}" for i in range(len(records))]
    for record in records:
        assert_promised_fields(record)
