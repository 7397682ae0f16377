"""The embedded record store: one SQLite file (stdlib ``sqlite3``), synchronous, one writer.

Why SQLite rather than rotated JSONL files: a crash mid-write can leave a torn JSONL line and
rotation needs its own bookkeeping, while SQLite's journal makes every committed batch atomic and
durable against a killed process (WAL mode, ``synchronous=NORMAL``: a power loss may lose the
last commits but never corrupts the file), readers never block the writer, and time/category
filters use indexes instead of scanning files. It ships with Python: no server to run.

Layout: one table ``records`` with indexed columns ``time_unix_ns``, ``category`` and
``exchange_id`` and the record as JSON text. Retention: ``max_rows`` (oldest deleted first) and
``max_age_s``, enforced by :meth:`RecordStore.prune`, which the writer calls periodically.

A :class:`RecordStore` is used by one thread at a time (:class:`RecordWriter`: the evidence worker's);
:func:`query_records` opens its own read-only connection and may run in any process.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from core import jsonx
from core.evidence import Evidence
from core.faults import BadInput
from core.sqlite_wal import enable_wal

log = logging.getLogger(__name__)

_DDL = (
    "CREATE TABLE IF NOT EXISTS records ("
    " id INTEGER PRIMARY KEY AUTOINCREMENT,"
    " time_unix_ns INTEGER NOT NULL,"
    " category TEXT,"
    " exchange_id TEXT NOT NULL,"
    " schema TEXT NOT NULL,"
    " record TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS records_time ON records (time_unix_ns)",
    "CREATE INDEX IF NOT EXISTS records_category ON records (category, time_unix_ns)",
    "CREATE INDEX IF NOT EXISTS records_exchange ON records (exchange_id)",
)
# Idempotent on the exchange id (through its index): the same exchange written twice — a copy
# run again, a resend — is kept once, the first time, as the column stores' ReplacingMergeTree
# keeps one row per exchange.
_INSERT = (
    "INSERT INTO records (time_unix_ns, category, exchange_id, schema, record)"
    " SELECT ?, ?, ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM records WHERE exchange_id = ?)"
)


class StoreFileError(BadInput):
    """A SQLite store path that cannot be used: a folder, a file that is not SQLite, a file
    that cannot be opened (the message names it and what to give instead)."""


def store_file_error(path: Path, exc: sqlite3.Error | None = None) -> StoreFileError:
    """The one line for a SQLite store ``path`` that cannot be used."""
    if path.is_dir():
        return StoreFileError(
            f"{path}: is a folder, not a SQLite record store file "
            f"(give a file path, or chdb://{path.resolve()} for a chDB store)"
        )
    why = str(exc) if exc is not None else "cannot be opened"
    return StoreFileError(
        f"{path}: not a SQLite record store ({why}); give a new path or the store serve wrote"
    )


def _row(record: Mapping[str, Any]) -> tuple[int, str | None, str, str, str, str]:
    exchange_id = str(record["exchange_id"])
    return (
        int(record["started_unix_ns"]),
        record.get("category"),
        exchange_id,
        str(record["schema"]),
        jsonx.dumps(record).decode(),
        exchange_id,
    )


class RecordStore:
    """Appends records in transactions and enforces retention."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_rows: int | None = None,
        max_age_s: float | None = None,
        threaded: bool = False,
    ) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        if self.path.is_dir():
            raise store_file_error(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where a folder of the path should be, no permission
            raise StoreFileError(
                f"{self.path}: cannot make its folder {self.path.parent} ({exc.strerror}); "
                "give a path in a folder you can write"
            ) from exc
        # threaded: opened on one thread, used (only) by another — the evidence worker's.
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, timeout=30.0, check_same_thread=not threaded
            )
        except sqlite3.Error as exc:
            raise store_file_error(self.path, exc) from exc
        try:
            # Workers started together race to switch a fresh file to WAL (core.sqlite_wal).
            enable_wal(self._db, timeout_s=30.0)
            self._db.execute("PRAGMA synchronous=NORMAL")
            for statement in _DDL:
                self._db.execute(statement)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise store_file_error(self.path, exc) from exc

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Write ``records`` in one transaction: after return they survive a killed process."""
        if not records:
            return
        rows = [_row(r) for r in records]
        with self._transaction():
            self._db.executemany(_INSERT, rows)

    def prune(self, now_unix_ns: int | None = None) -> int:
        """Apply retention; returns how many rows were deleted."""
        deleted = 0
        with self._transaction():
            if self.max_age_s is not None:
                now = time.time_ns() if now_unix_ns is None else now_unix_ns
                cutoff = now - int(self.max_age_s * 1e9)
                deleted += self._db.execute(
                    "DELETE FROM records WHERE time_unix_ns < ?", (cutoff,)
                ).rowcount
            if self.max_rows is not None:
                deleted += self._db.execute(
                    "DELETE FROM records WHERE id <= (SELECT id FROM records"
                    " ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (self.max_rows,),
                ).rowcount
        return deleted

    def count(self) -> int:
        row = self._db.execute("SELECT count(*) FROM records").fetchone()
        return int(row[0])

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> _Tx:
        return _Tx(self._db)


class _Tx:
    """BEGIN IMMEDIATE … COMMIT, ROLLBACK on error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def query_records(
    path: str | Path,
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    category: str | None = None,
    limit: int | None = None,
    exchange_ids: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Records matching the filters, oldest first; ``limit`` keeps the newest ``limit`` of them;
    ``exchange_ids`` keeps only those exchanges (looked up through the id index).

    Raises FileNotFoundError when ``path`` does not exist (a read never creates a store),
    :class:`StoreFileError` when it is a folder or not a SQLite store.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(str(p))
    if p.is_dir():
        raise store_file_error(p)
    where: list[str] = []
    args: list[Any] = []
    if since_unix_ns is not None:
        where.append("time_unix_ns >= ?")
        args.append(since_unix_ns)
    if until_unix_ns is not None:
        where.append("time_unix_ns < ?")
        args.append(until_unix_ns)
    if category is not None:
        where.append("category = ?")
        args.append(category)
    if exchange_ids is not None:
        where.append("exchange_id IN (SELECT id FROM temp.wanted)")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    if limit is not None:
        sql = (
            "SELECT record FROM (SELECT record, time_unix_ns, id FROM records"
            f"{clause} ORDER BY time_unix_ns DESC, id DESC LIMIT ?) ORDER BY time_unix_ns, id"
        )
        args.append(limit)
    else:
        sql = f"SELECT record FROM records{clause} ORDER BY time_unix_ns, id"
    # Not ``mode=ro``: a read-only connection cannot create the WAL index of a store whose
    # writer has exited; queries here never write.
    with closing(sqlite3.connect(p, timeout=30.0)) as db:
        try:
            if exchange_ids is not None:
                # A temporary table, not one ``?`` per id: any number of ids, one ordered scan.
                db.execute("CREATE TEMP TABLE wanted (id TEXT PRIMARY KEY)")
                db.executemany(
                    "INSERT OR IGNORE INTO temp.wanted VALUES (?)", ((i,) for i in exchange_ids)
                )
            rows = db.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            raise store_file_error(p, exc) from exc
        for (text,) in rows:
            yield jsonx.loads(text)


class RecordWriter:
    """The record store as an evidence consumer: one record per exchange, committed in batches.

    ``handle`` appends the exchange's record to the open batch; the batch is committed when it
    holds ``batch_size`` records and whenever the worker's queue has run empty (``flush``), so a
    killed process loses at most the batch in flight and the store stays consistent. Retention runs
    every ``prune_interval_s``. A failed commit (disk full, locked file) counts the batch in
    ``failed`` and keeps serving. The store is opened at construction (a bad path fails fast, at
    startup) and used only from the evidence worker's thread afterwards.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        batch_size: int = 256,
        max_rows: int | None = 1_000_000,
        max_age_s: float | None = 30 * 86_400.0,
        prune_interval_s: float = 60.0,
    ) -> None:
        self.path = Path(path)
        self.batch_size = max(1, batch_size)
        self.prune_interval_s = prune_interval_s
        self.written = 0
        self.failed = 0
        self._store = RecordStore(self.path, max_rows=max_rows, max_age_s=max_age_s, threaded=True)
        self._batch: list[Mapping[str, Any]] = []
        self._next_prune = time.monotonic() + prune_interval_s

    def handle(self, evidence: Evidence) -> None:
        self._batch.append(evidence.record)
        if len(self._batch) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            try:
                self._store.append(batch)
            except Exception:  # disk full, locked file…: count, keep serving
                self.failed += len(batch)
                log.exception("could not write %d records to %s", len(batch), self.path)
            else:
                self.written += len(batch)
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self.prune_interval_s
            try:
                self._store.prune()
            except Exception:  # retention is retried at the next interval
                log.warning("record retention on %s failed", self.path, exc_info=True)

    def close(self) -> None:
        self.flush()
        self._store.close()
