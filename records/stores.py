"""Record stores named by URL: what ``serve --store``, ``records``, ``report`` and
``records copy`` accept.

- ``PATH`` (or ``sqlite:///PATH``): the embedded SQLite store (:mod:`records.sqlite_store`), the
  default for one machine;
- ``chdb:///DIR``: chDB, ClickHouse embedded in the process, its data in ``DIR``;
- ``clickhouse://[USER[:PASSWORD]@]HOST[:PORT]/DB``: a ClickHouse server's HTTP interface (port
  8123 by default); the password may instead come from ``SPECSHADOW_CLICKHOUSE_PASSWORD``, and
  no log line or record ever carries it.

The URL itself is parsed by :mod:`records.urls`, the one parser ``--state`` shares.

Query parameters tune the writer: ``batch`` (records per insert, 1000), ``queue`` (batches
waiting, 64), ``retention_days`` (TTL; 30). :func:`open_writer` builds the evidence consumer,
:func:`read_store` streams a store's records back, :func:`copy_records` moves them between any
two stores.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from core import jsonx
from records.clickhouse import (
    ChdbEngine,
    ClickHouseError,
    ClickHouseStore,
    ClickHouseWriter,
    HttpEngine,
)
from records.sqlite_store import RecordStore, RecordWriter, query_records
from records.urls import StoreURL, StoreURLError, parse_url

__all__ = [
    "StoreURL",
    "StoreURLError",
    "check_store",
    "copy_records",
    "is_url",
    "open_column_store",
    "open_writer",
    "parse_store",
    "read_store",
]

SCHEMES = ("sqlite", "chdb", "clickhouse")
PASSWORD_ENV = "SPECSHADOW_CLICKHOUSE_PASSWORD"


def is_url(text: str) -> bool:
    return text.split("://", 1)[0] in SCHEMES and "://" in text


def parse_store(text: str) -> StoreURL:
    """Parse a store name (:func:`records.urls.parse_url`); a plain path is SQLite. The
    password may come from ``SPECSHADOW_CLICKHOUSE_PASSWORD`` instead of the URL."""
    if not is_url(text):
        return StoreURL("sqlite", path=text)
    url = parse_url(
        text, schemes=SCHEMES, options=("batch", "queue", "retention_days"),
        sqlite_example="records.sqlite",
    )  # fmt: skip
    if url.kind == "clickhouse" and url.password is None:
        return replace(url, password=os.environ.get(PASSWORD_ENV))
    return url


def _column_store(
    url: StoreURL, *, max_age_s: float | None, create: bool = True
) -> ClickHouseStore:
    engine: ChdbEngine | HttpEngine
    if url.kind == "chdb":
        Path(url.path).mkdir(parents=True, exist_ok=True)
        engine = ChdbEngine(url.path)
    else:
        engine = HttpEngine(
            url.host, url.port, database=url.database, user=url.user, password=url.password
        )
    try:
        return ClickHouseStore(engine, max_age_s=max_age_s, create=create)
    except BaseException:
        engine.close()
        raise


def open_column_store(text: str, *, migrate: bool = True) -> ClickHouseStore:
    """A ``chdb:///`` or ``clickhouse://`` store to query (migrated to this release's columns);
    FileNotFoundError for a chDB folder that does not exist, StoreURLError for an engine that
    cannot be reached or holds no records table."""
    url = parse_store(text)
    if url.kind == "sqlite":
        raise StoreURLError(f"{url.label()}: not a column store")
    if url.kind == "chdb" and not Path(url.path).is_dir():
        raise FileNotFoundError(url.path)
    try:
        store = _column_store(url, max_age_s=None, create=False)
    except ClickHouseError as exc:
        raise StoreURLError(f"{url.label()}: {exc}") from exc
    if not migrate:
        return store
    try:
        store.migrate()
    except ClickHouseError as exc:
        store.close()
        raise StoreURLError(f"{url.label()}: {exc}") from exc
    return store


def open_writer(text: str) -> RecordWriter | ClickHouseWriter:
    """The evidence consumer for ``serve --store``: opened now, so a bad store fails at start."""
    url = parse_store(text)
    max_age_s = url.option("retention_days", 30.0) * 86400
    if url.kind == "sqlite":
        return RecordWriter(url.path, max_age_s=max_age_s)
    try:
        store = _column_store(url, max_age_s=max_age_s)
    except ClickHouseError as exc:
        raise StoreURLError(f"{url.label()}: {exc}") from exc
    return ClickHouseWriter(
        store,
        label=url.label(),
        batch_size=int(url.option("batch", 1000)),
        max_batches=int(url.option("queue", 64)),
    )


def check_store(text: str) -> None:
    """Open ``serve --store``'s store and close it again, so that one that cannot be used fails
    the start once, in the parent, before ``--workers`` fork (N workers would each fail alike).
    A chDB folder is checked by path only: chDB serves one folder per process."""
    url = parse_store(text)
    if url.kind == "sqlite":
        RecordStore(url.path).close()
    elif url.kind == "chdb":
        if Path(url.path).exists() and not Path(url.path).is_dir():
            raise StoreURLError(f"{url.label()}: is a file; chdb:/// names a folder")
    else:
        try:
            _column_store(url, max_age_s=None).close()
        except ClickHouseError as exc:
            raise StoreURLError(f"{url.label()}: {exc}") from exc


def read_store(
    text: str,
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    category: str | None = None,
) -> Iterator[dict[str, Any]]:
    """A store's records in the window, oldest first (streamed; raises FileNotFoundError for a
    SQLite path that does not exist, StoreURLError for an engine that cannot be reached)."""
    url = parse_store(text)
    if url.kind == "sqlite":
        yield from query_records(
            url.path, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, category=category
        )
        return
    store = open_column_store(text, migrate=False)  # reading needs no new columns
    try:
        yield from store.records(
            since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, category=category
        )
    except ClickHouseError as exc:
        raise StoreURLError(f"{url.label()}: {exc}") from exc
    finally:
        store.close()


SQLITE_SUFFIXES = ("", ".sqlite", ".sqlite3", ".db")


def copy_records(
    source: str,
    target: str,
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    batch: int = 5000,
) -> int:
    """Copy ``source``'s records (a store, records JSONL or collector files) into ``target``;
    returns how many it added. Streams in batches: memory stays one batch.

    The target's name says its format: a URL, a SQLite path (``.sqlite``, ``.db``, no suffix)
    or a JSON Lines file (``.jsonl``, ``.ndjson``, ``.json``: one record per line, appended);
    any other suffix is refused (:class:`StoreURLError`). Copying the same records twice adds
    nothing: SQLite and JSON Lines targets skip exchange ids they hold (the count says so); the
    column stores keep one row per exchange id themselves (``ReplacingMergeTree``, read with
    ``FINAL``), so for them the count is the records sent.
    """
    from records.readback import JSON_SUFFIXES, records_in  # readback imports this module

    src, dst = parse_store(source) if is_url(source) else None, parse_store(target)
    if dst.kind == "sqlite":
        suffix = Path(dst.path).suffix.lower()
        if suffix in JSON_SUFFIXES and not is_url(target):
            return _copy_to_json_lines(
                records_in(source, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns),
                Path(dst.path),
            )
        if suffix not in SQLITE_SUFFIXES:
            raise StoreURLError(
                f"--to {target}: records copy writes a SQLite store (.sqlite, .db), JSON Lines "
                "(.jsonl) or a chdb:/// or clickhouse:// URL; name the destination by its format"
            )
    if src is not None and src.kind == dst.kind == "chdb" and src.path != dst.path:
        # chDB serves one folder per process: go through a temporary SQLite store.
        with tempfile.TemporaryDirectory() as tmp:
            middle = str(Path(tmp) / "copy.sqlite")
            copy_records(source, middle, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns)
            return copy_records(middle, target, batch=batch)
    records = records_in(source, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns)
    writer: RecordStore | ClickHouseStore
    if dst.kind == "sqlite":
        writer = RecordStore(dst.path)
    else:
        try:
            writer = _column_store(dst, max_age_s=None)
        except ClickHouseError as exc:
            raise StoreURLError(f"{dst.label()}: {exc}") from exc
    before = writer.count() if isinstance(writer, RecordStore) else 0
    n = 0
    pending: list[dict[str, Any]] = []
    try:
        for record in records:
            pending.append(record)
            if len(pending) >= batch:
                writer.append(pending)
                n += len(pending)
                pending = []
        writer.append(pending)
        n += len(pending)
        if isinstance(writer, RecordStore):
            n = writer.count() - before  # an exchange already there is not added again
    finally:
        writer.close()
    return n


def _copy_to_json_lines(records: Iterator[dict[str, Any]], path: Path) -> int:
    """Append ``records`` to a JSON Lines file, one per line, skipping the exchange ids it
    holds already; returns how many were added."""
    from records.readback import records_in

    if path.is_dir():
        raise StoreURLError(f"--to {path}: is a folder; name a .jsonl file")
    held = {str(r.get("exchange_id")) for r in records_in(path)} if path.exists() else set()
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        for record in records:
            exchange_id = str(record.get("exchange_id", ""))
            if exchange_id in held:
                continue
            held.add(exchange_id)
            f.write(jsonx.dumps(record) + b"\n")
            n += 1
    return n
