"""Stores named by URL: two gateways writing into one real ClickHouse server (Debian's
``clickhouse-server``), chDB embedded, SQLite and JSON Lines — the same records, the same
reports, on every engine; a server that goes away costs counted records, never a client
request."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from gateway.settings import Settings
from records.clickhouse import (
    ChdbEngine,
    ClickHouseError,
    ClickHouseStore,
    ClickHouseWriter,
    HttpEngine,
)
from records.readback import SourceError, read_records
from records.sqlite_store import RecordWriter
from records.stores import StoreURLError, copy_records, open_writer, parse_store, read_store
from report.analysis import analyze
from specshadow.app import build_app
from specshadow.main import main as cli_main
from tests.conftest import FAST_UPSTREAM, start_server
from tests.gateway.test_shadow import policy_yaml
from tests.receivers.clickhouse import ClickHouseServer, requires_clickhouse
from tests.records.test_fleet import REQUESTS, alternate


@pytest.fixture(scope="module")
def clickhouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseServer]:
    with ClickHouseServer(tmp_path_factory.mktemp("clickhouse")) as server:
        yield server


def test_store_urls_parse_and_say_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_store("records.sqlite").kind == "sqlite"
    assert parse_store("sqlite:///var/lib/r.sqlite").path == "/var/lib/r.sqlite"
    assert parse_store("chdb:///data/records").path == "/data/records"
    url = parse_store("clickhouse://ops:s3cret@ch.internal:8124/evidence?batch=500")
    assert (url.host, url.port, url.database, url.user) == ("ch.internal", 8124, "evidence", "ops")
    assert url.option("batch", 1000) == 500
    assert "s3cret" not in url.label() and "s3cret" not in repr(url)  # never logged
    monkeypatch.setenv("SPECSHADOW_CLICKHOUSE_PASSWORD", "from-env")
    assert parse_store("clickhouse://ch:8123/db").password == "from-env"
    for bad, says in (
        ("clickhouse:///db", "no host"),
        ("clickhouse://ch:port/db", "port is not a number"),
        ("clickhouse://ch/db-1;drop", "not a plain identifier"),
        ("chdb://host/dir", "name a folder"),
        ("clickhouse://ch/db?batchsize=3", "unknown option(s) batchsize"),
    ):
        with pytest.raises(StoreURLError, match=re.escape(says)):
            parse_store(bad)
    with pytest.raises(StoreURLError, match=r"\?batch= must be a number"):
        parse_store("chdb:///x?batch=many").option("batch", 1)


def records_of(n: int, *, start_ns: int) -> list[dict[str, Any]]:
    from evidence.worker import build_evidence
    from tests.evidence.legs import exchange

    return [
        dict(build_evidence(exchange(i, started_unix_ns=start_ns + i)).record) for i in range(n)
    ]


def test_chdb_round_trip_window_and_copy_between_any_two_stores(tmp_path: Path) -> None:
    day_ns = 86_400 * 10**9
    now = time.time_ns()
    records = records_of(30, start_ns=now - 2 * day_ns)
    sqlite = tmp_path / "a.sqlite"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(b"".join(jsonx.dumps(r) + b"\n" for r in records))
    assert copy_records(str(jsonl), str(sqlite)) == 30
    assert copy_records(str(sqlite), f"chdb://{tmp_path}/c1") == 30
    assert copy_records(f"chdb://{tmp_path}/c1", f"chdb://{tmp_path}/c2") == 30  # via SQLite
    back = list(read_store(f"chdb://{tmp_path}/c2"))
    assert back == read_records([sqlite]) == read_records([jsonl])
    # A resent exchange collapses on its key: copying twice keeps one row per exchange.
    assert copy_records(str(sqlite), f"chdb://{tmp_path}/c2") == 30
    assert len(list(read_store(f"chdb://{tmp_path}/c2"))) == 30
    # --since/--until run in the engine, on the same half-open window as SQLite's.
    since, until = records[5]["started_unix_ns"], records[12]["started_unix_ns"]
    window = list(read_store(f"chdb://{tmp_path}/c2", since_unix_ns=since, until_unix_ns=until))
    assert [r["exchange_id"] for r in window] == [r["exchange_id"] for r in records[5:12]]
    assert read_records([f"chdb://{tmp_path}/c2"], since_unix_ns=since, until_unix_ns=until) == (
        read_records([sqlite], since_unix_ns=since, until_unix_ns=until)
    )
    # The typed columns hold what the record says.
    engine = ChdbEngine(f"{tmp_path}/c2")
    try:
        row = engine.execute(
            "SELECT exchange_id, category, legs_role, legs_ttft_s FROM records FINAL"
            f" WHERE exchange_id = '{records[3]['exchange_id']}' FORMAT JSONEachRow"
        )
        wide = jsonx.loads(row)
        assert wide["legs_role"] == [leg["role"] for leg in records[3]["legs"]]
        assert wide["legs_ttft_s"] == [leg["ttft_s"] for leg in records[3]["legs"]]
        assert wide["category"] == records[3]["category"]
    finally:
        engine.close()
    # The records CLI reads a URL, and copy reports what it did.
    assert (
        cli_main(["records", "copy", "--from", str(sqlite), "--to", f"chdb://{tmp_path}/c3"]) == 0
    )
    with pytest.raises(SourceError, match="no such store"):
        read_records([f"chdb://{tmp_path}/missing"])


def test_a_chdb_store_expires_old_days_by_ttl(tmp_path: Path) -> None:
    day_ns = 86_400 * 10**9
    now = time.time_ns()
    old, new = records_of(5, start_ns=now - 40 * day_ns), records_of(5, start_ns=now)
    for r in new:
        r["exchange_id"] += "-new"
    store = ClickHouseStore(ChdbEngine(str(tmp_path / "c")), max_age_s=30 * 86_400)
    try:
        store.append(old + new)
        assert b"TTL" in store.engine.execute("SHOW CREATE TABLE records")
        store.engine.execute("OPTIMIZE TABLE records FINAL")
        left = [r["exchange_id"] for r in store.records()]
        assert left == [r["exchange_id"] for r in new]
    finally:
        store.close()


@requires_clickhouse
def test_an_old_server_without_ttl_drops_whole_old_days(
    clickhouse: ClickHouseServer, tmp_path: Path
) -> None:
    day_ns = 86_400 * 10**9
    now = time.time_ns()
    old, new = records_of(5, start_ns=now - 40 * day_ns), records_of(5, start_ns=now)
    for r in new:
        r["exchange_id"] += "-new"
    writer = open_writer(clickhouse.url("retention") + "?retention_days=30&batch=4")
    assert isinstance(writer, ClickHouseWriter)
    store = writer.store
    store.append(old + new)
    assert not store.engine.server_ttl  # Debian's 18.16 predates TTL
    assert store.prune() == 1
    assert [r["exchange_id"] for r in store.records()] == [r["exchange_id"] for r in new]
    writer.close()


@requires_clickhouse
async def test_two_gateways_into_one_clickhouse_server_report_as_their_sqlite_stores(
    clickhouse: ClickHouseServer,
    sims: Any,
    write_policy: Callable[[str], str],
    servers: list[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    primary = await sims(step_s=0.0, prefill_base_s=0.0)
    candidate = await sims(mode="speculative", step_s=0.0, prefill_base_s=0.0)
    policy_path = write_policy(policy_yaml(primary.base_url, candidate.base_url))
    shared = clickhouse.url("fleet") + "?batch=7"  # several inserts per replica
    urls = []
    for name in ("a", "b"):
        settings = Settings(
            policy_path=policy_path,
            store_path=shared,
            shutdown_timeout_s=2.0,
            upstream=FAST_UPSTREAM,
        )
        # Each replica also keeps its own SQLite store: the union the server must equal.
        own = RecordWriter(tmp_path / f"{name}.sqlite")
        server = await start_server(build_app(settings, consumers=[own]))
        servers.append(server)
        urls.append(str(server.make_url("")).rstrip("/"))
    await alternate(urls, REQUESTS)
    for server in reversed(servers[-2:]):  # stop both: batches flushed, senders drained
        await server.close()
    servers[-2:] = []

    union = read_records([tmp_path / "a.sqlite", tmp_path / "b.sqlite"])
    assert len(union) == REQUESTS
    assert read_records([shared]) == union
    copy_records(str(tmp_path / "a.sqlite"), f"chdb://{tmp_path}/fleet")
    copy_records(str(tmp_path / "b.sqlite"), f"chdb://{tmp_path}/fleet")
    assert read_records([f"chdb://{tmp_path}/fleet"]) == union
    assert analyze(read_records([shared])) == analyze(union)

    def report(*stores: str) -> str:
        out = tmp_path / f"report-{abs(hash(stores))}"
        args = ["report", *[x for s in stores for x in ("--store", s)], "--out", str(out)]
        assert cli_main(args) == 0
        capsys.readouterr()
        text = (out / "report.md").read_text()
        return re.sub(r"(?m)^.*(Generated|from store).*$", "", text)  # when and from where

    assert (
        report(shared)
        == report(str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite"))
        == report(f"chdb://{tmp_path}/fleet")
    )


@requires_clickhouse
def test_a_server_that_goes_away_costs_counted_records_and_never_blocks(
    tmp_path: Path,
) -> None:
    from evidence.worker import build_evidence
    from tests.evidence.legs import exchange

    server = ClickHouseServer(tmp_path / "ch")
    url = server.url("gone")
    writer = open_writer(url)
    assert isinstance(writer, ClickHouseWriter)
    writer.close()
    store = ClickHouseStore(HttpEngine("127.0.0.1", server.port, database="gone"))
    lost: list[tuple[str, int]] = []
    writer = ClickHouseWriter(
        store, label=url, batch_size=5, max_batches=2, attempts=3, backoff_s=0.05
    )
    writer.on_loss = lambda reason, n: lost.append((reason, n))
    server.stop()  # from here every insert is refused
    for i in range(100):
        writer.handle(build_evidence(exchange(i, started_unix_ns=1_000 + i)))
    # handle() only appends and enqueues: the retries are still running on the sender thread.
    in_flight = 100 - writer.dropped - writer.failed
    writer.close()
    assert writer.written == 0
    assert writer.dropped + writer.failed == 100
    assert writer.dropped > 0 and writer.failed > 0
    assert sum(n for _, n in lost) == 100
    assert {reason for reason, _ in lost} == {"queue_full", "write_failed"}
    assert in_flight > 0
    with pytest.raises(StoreURLError, match="Connection refused"):
        open_writer(url)
    with pytest.raises(SourceError, match="Connection refused"):
        read_records([url])
    with pytest.raises(ClickHouseError):
        store.count()


def test_the_collectors_clickhouse_exporter_path_fills_the_wide_table_with_the_same_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records that reach ClickHouse as OTLP log records (the Collector's ClickHouse exporter
    keeps each body in its logs table) become the wide rows the gateway's own writer makes: the
    view is generated from the same column definitions, and this holds it to them, column by
    column, on chDB (ClickHouse 26; Debian's 18.16 server predates JSONExtract)."""
    from records import wide

    records = records_of(12, start_ns=time.time_ns())
    records[3]["legs"][0]["status"] = None  # nulls inside the arrays too
    records[4]["category"] = None
    engine = ChdbEngine(str(tmp_path / "c"))
    try:
        # The exporter's logs table, reduced to the columns it writes that the view reads or
        # that order it (names and types as the exporter's DDL has them).
        engine.execute(
            "CREATE TABLE otel_logs (Timestamp DateTime64(9), ServiceName LowCardinality(String),"
            " Body String, LogAttributes Map(LowCardinality(String), String), EventName String)"
            " ENGINE = MergeTree ORDER BY (ServiceName, Timestamp)"
        )
        assert cli_main(["records", "sql", "--table", "records", "--otel-logs", "otel_logs"]) == 0
        for statement in capsys.readouterr().out.split(";\n"):
            if statement.strip():
                engine.execute(statement)
        rows = [
            {
                "Timestamp": r["started_unix_ns"] / 1e9,
                "ServiceName": "gateway-a",
                "Body": jsonx.dumps(r).decode(),
                "LogAttributes": {"specshadow.exchange_id": r["exchange_id"]},
                "EventName": "specshadow.record" if i % 2 else "",  # older exporters: no name
            }
            for i, r in enumerate(records)
        ]
        other = {**rows[0], "Body": "GET /healthz 200", "EventName": "http.access"}
        body = b"".join(jsonx.dumps(row) + b"\n" for row in [*rows, other])
        engine.execute("INSERT INTO otel_logs FORMAT JSONEachRow", body)
        got = [
            jsonx.loads(line)
            for line in engine.execute(
                "SELECT * EXCEPT (day) FROM records ORDER BY time_unix_ns"
                " SETTINGS output_format_json_quote_64bit_integers = 0 FORMAT JSONEachRow"
            ).splitlines()
        ]
    finally:
        engine.close()
    assert len(got) == len(records)  # the access log line is not a record
    for row, record in zip(got, records, strict=True):
        expected = wide.wide_row(record)
        assert jsonx.loads(row.pop("record")) == record
        expected.pop("record")
        assert row == expected, {k: (row[k], v) for k, v in expected.items() if row[k] != v}
    assert read_records([f"chdb://{tmp_path}/c"]) == read_records_sorted(records)


def read_records_sorted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: (r["started_unix_ns"], r["exchange_id"]))
