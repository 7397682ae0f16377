"""Record stores in ClickHouse: a server over HTTP (``clickhouse://``) or chDB in-process
(``chdb:///dir``), both holding the wide table of :mod:`records.wide`.

- :class:`HttpEngine` speaks ClickHouse's HTTP interface with the standard library (no driver to
  pin: the interface has been stable since 2016; the Debian package's 18.16 server and current
  ones both answer it). Results stream line by line, so a reader's memory does not grow with
  the table.
- :class:`ChdbEngine` is the same engine embedded (chDB): nothing to run, for laptops and tests.
  chDB serves one data folder per process at a time; opening a second one while the first is
  open is refused with that explanation.
- :class:`ClickHouseStore` creates and migrates the table, appends rows (``JSONEachRow``),
  applies retention (``TTL`` where the engine has it; whole-day partition drops otherwise) and
  streams records back in the canonical order (time, then exchange id).
- :class:`ClickHouseWriter` is the evidence consumer for ``serve --store clickhouse://…``: the
  evidence worker's thread only appends to a batch; full batches go to a bounded queue that one
  sender thread drains, with retries (tenacity, exponential back-off). A full queue drops the
  batch and counts it (``dropped``) rather than block the worker; a batch that still fails after
  its retries is counted in ``failed``. Nothing here can slow the client's path.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from core import jsonx
from core.evidence import Evidence
from records import wide

log = logging.getLogger(__name__)

__all__ = [
    "ChdbEngine",
    "ClickHouseError",
    "ClickHouseStore",
    "ClickHouseWriter",
    "Engine",
    "HttpEngine",
]

TABLE = "records"


class ClickHouseError(RuntimeError):
    """The engine refused a statement (its message), or could not be reached."""


class Engine(Protocol):
    name: str
    server_ttl: bool

    def execute(self, sql: str, data: bytes | None = None) -> bytes: ...

    def lines(self, sql: str) -> Iterator[bytes]: ...

    def release(self) -> None:
        """Hand memory the engine keeps after a query back to the OS (in-process engines)."""

    def reading(self) -> None:
        """This process only reads (a report): an in-process engine stops merging parts."""

    def close(self) -> None: ...


@dataclass
class HttpEngine:
    """A ClickHouse server's HTTP interface (default port 8123)."""

    host: str
    port: int = 8123
    database: str = "default"
    user: str | None = None
    password: str | None = None
    timeout_s: float = 30.0
    name: str = "clickhouse"
    server_ttl: bool = True

    def __post_init__(self) -> None:
        version = self.execute("SELECT version()", database="default").decode().strip()
        major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
        self.version = version
        self.server_ttl = major_minor >= (19, 6)  # TTL clauses arrived in 19.6

    def create_database(self) -> None:
        self.execute(f"CREATE DATABASE IF NOT EXISTS {self.database}", database="default")

    def _request(
        self, sql: str, data: bytes | None, database: str | None = None
    ) -> urllib.request.Request:
        params = {"database": database or self.database}
        if data is None:
            body = sql.encode()
        else:
            params["query"] = sql
            body = data
        url = f"http://{self.host}:{self.port}/?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, data=body, method="POST")
        if self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        return request

    def execute(self, sql: str, data: bytes | None = None, *, database: str | None = None) -> bytes:
        request = self._request(sql, data, database)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as exc:
            raise ClickHouseError(_first_line(exc.read())) from None
        except OSError as exc:
            raise ClickHouseError(f"{self.host}:{self.port}: {exc}") from exc

    def lines(self, sql: str) -> Iterator[bytes]:
        try:
            response = urllib.request.urlopen(self._request(sql, None), timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise ClickHouseError(_first_line(exc.read())) from None
        except OSError as exc:
            raise ClickHouseError(f"{self.host}:{self.port}: {exc}") from exc
        with response:
            for line in response:
                if line.strip():
                    yield bytes(line)

    def release(self) -> None:
        pass  # the server's memory is not this process's

    def reading(self) -> None:
        pass  # the server merges its parts itself

    def close(self) -> None:
        pass


def _first_line(body: bytes) -> str:
    text = body.decode(errors="replace").strip()
    return text.splitlines()[0] if text else "ClickHouse error"


_chdb_lock = threading.Lock()
_chdb_open: dict[str, int] = {}  # path → open engines (chDB: one folder per process)


class ChdbEngine:
    """chDB: ClickHouse in-process, its data in ``path``."""

    name = "chdb"
    server_ttl = True

    def __init__(self, path: str) -> None:
        try:
            # optional: only chdb:// stores need it (untyped: held as Any)
            session: Any = importlib.import_module("chdb.session")
        except ImportError as exc:
            raise ClickHouseError(
                "chdb:// stores need the chdb package: pip install 'specshadow[fleet]'"
            ) from exc
        with _chdb_lock:
            other = next((p for p in _chdb_open if p != path), None)
            if other is not None:
                raise ClickHouseError(
                    f"chDB serves one data folder per process and {other} is open; "
                    f"close it before opening {path} (records copy goes through a temporary "
                    "SQLite store between two chDB folders)"
                )
            self._session: Any = session.Session(path)
            _chdb_open[path] = _chdb_open.get(path, 0) + 1
        self.path = path
        self._lock = threading.Lock()  # one statement at a time on the session

    def execute(self, sql: str, data: bytes | None = None) -> bytes:
        text = sql if data is None else f"{sql}\n{data.decode()}"
        try:
            with self._lock:
                result = self._session.query(text, "TabSeparated")
        except Exception as exc:  # chDB raises RuntimeError with the server's message
            raise ClickHouseError(_first_line(str(exc).encode())) from exc
        return bytes(result.bytes()) if result is not None else b""

    def lines(self, sql: str) -> Iterator[bytes]:
        try:
            with self._lock:
                stream: Any = self._session.send_query(sql, "JSONEachRow")
        except Exception as exc:
            raise ClickHouseError(_first_line(str(exc).encode())) from exc
        try:
            while True:
                with self._lock:
                    chunk = stream.fetch()
                if chunk is None:
                    break
                data = chunk.bytes()
                if not data:
                    break
                for line in data.splitlines():
                    if line.strip():
                        yield line
        finally:
            stream.close()

    def release(self) -> None:
        # chDB's allocator keeps freed pages for reuse; in the client's process they count as the
        # client's memory. A report runs a dozen aggregates one after another: purge between.
        with contextlib.suppress(ClickHouseError):  # a build without jemalloc: nothing to purge
            self.execute("SYSTEM JEMALLOC PURGE")

    def reading(self) -> None:
        # An embedded engine merges the parts a writer left in whatever process opens the folder:
        # a report would pay for a fleet's merges in its own CPU and memory (measured on 10 M
        # rows in 124 parts: 178 s and 3.0 GB with merges, 84 s and 1.0 GB without).
        self.execute("SYSTEM STOP MERGES")

    def close(self) -> None:
        with _chdb_lock:
            count = _chdb_open.get(self.path, 0) - 1
            if count <= 0:
                _chdb_open.pop(self.path, None)
                self._session.close()
            else:
                _chdb_open[self.path] = count


class ClickHouseStore:
    """The wide table on one engine: create/migrate, append, prune, count, stream back."""

    def __init__(
        self, engine: Engine, *, max_age_s: float | None = None, create: bool = True
    ) -> None:
        self.engine = engine
        self.max_age_s = max_age_s
        if not create:
            tables = engine.execute("SHOW TABLES").split()
            if TABLE.encode() not in tables:
                raise ClickHouseError(f"no {TABLE} table here: nothing has been written yet")
            return
        if isinstance(engine, HttpEngine):
            engine.create_database()
        ttl_days = None if max_age_s is None else max_age_s / 86400
        engine.execute(wide.create_table(TABLE, ttl_days=ttl_days, server_ttl=engine.server_ttl))
        self.migrate()

    def migrate(self) -> None:
        """Add the columns a table written by an older release lacks (its rows read them as
        empty arrays and NULLs)."""
        present = {
            line.split(b"\t")[0].decode()
            for line in self.engine.execute(f"DESCRIBE TABLE {TABLE}").splitlines()
            if line
        }
        for statement in wide.migrations(TABLE, present):
            self.engine.execute(statement)

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        if not records:
            return
        names = [name for name, _ in wide.columns()]
        body = b"".join(jsonx.dumps(wide.wide_row(r)) + b"\n" for r in records)
        self.engine.execute(f"INSERT INTO {TABLE} ({', '.join(names)}) FORMAT JSONEachRow", body)

    def prune(self, now_unix_ns: int | None = None) -> int:
        """Drop the days older than ``max_age_s`` (engines without ``TTL``); returns parts
        dropped. Engines with ``TTL`` expire rows themselves."""
        if self.max_age_s is None or self.engine.server_ttl:
            return 0
        now = time.time_ns() if now_unix_ns is None else now_unix_ns
        cutoff_day = time.strftime("%Y-%m-%d", time.gmtime((now / 1e9) - self.max_age_s))
        days = self.engine.execute(
            f"SELECT DISTINCT toString(day) FROM {TABLE} WHERE day < toDate('{cutoff_day}')"
        )
        dropped = 0
        for day in days.decode().split():
            self.engine.execute(f"ALTER TABLE {TABLE} DROP PARTITION '{day}'")
            dropped += 1
        return dropped

    def count(self) -> int:
        return int(self.engine.execute(f"SELECT count() FROM {TABLE} FINAL").strip() or 0)

    def records(
        self,
        *,
        since_unix_ns: int | None = None,
        until_unix_ns: int | None = None,
        category: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The records in the window, oldest first, one per exchange (``FINAL`` collapses a
        resent exchange that has not been merged yet)."""
        where = []
        if since_unix_ns is not None:
            where.append(f"time_unix_ns >= {int(since_unix_ns)}")
        if until_unix_ns is not None:
            where.append(f"time_unix_ns < {int(until_unix_ns)}")
        if category is not None:
            where.append(f"category = '{_quote(category)}'")
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        sql = (
            f"SELECT record FROM {TABLE} FINAL{clause} ORDER BY time_unix_ns, exchange_id"
            " FORMAT JSONEachRow"
        )
        for line in self.engine.lines(sql):
            yield jsonx.loads(jsonx.loads(line)["record"])

    def close(self) -> None:
        self.engine.close()


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


class _Retryable(ClickHouseError):
    pass


class ClickHouseWriter:
    """The evidence consumer for a ClickHouse or chDB store (see the module docstring)."""

    def __init__(
        self,
        store: ClickHouseStore,
        *,
        label: str,
        batch_size: int = 1000,
        max_batches: int = 64,
        attempts: int = 5,
        backoff_s: float = 0.5,
        prune_interval_s: float = 3600.0,
    ) -> None:
        self.store = store
        self.path = label  # what logs name: the URL without its password
        self.batch_size = max(1, batch_size)
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self.on_loss: Callable[[str, int], None] | None = None  # (reason, records)
        self._batch: list[Mapping[str, Any]] = []
        self._queue: queue.Queue[list[Mapping[str, Any]] | None] = queue.Queue(max_batches)
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._prune_interval_s = prune_interval_s
        self._next_prune = time.monotonic()
        self._sender = threading.Thread(target=self._send_loop, name="specshadow-clickhouse")
        self._sender.daemon = True
        self._sender.start()

    def handle(self, evidence: Evidence) -> None:
        self._batch.append(evidence.record)
        if len(self._batch) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # the server is slower than the fleet: drop and count, never block
            self.dropped += len(batch)
            log.warning("record queue to %s full: dropped %d records", self.path, len(batch))
            self._lost("queue_full", len(batch))

    def _append(self, batch: list[Mapping[str, Any]]) -> None:
        @retry(
            retry=retry_if_exception_type(ClickHouseError),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._backoff_s, max=30.0),
            reraise=True,
        )
        def once() -> None:
            self.store.append(batch)

        once()

    def _send_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self._append(batch)
            except Exception:
                self.failed += len(batch)
                log.exception("could not write %d records to %s", len(batch), self.path)
                self._lost("write_failed", len(batch))
            else:
                self.written += len(batch)
            if time.monotonic() >= self._next_prune:
                self._next_prune = time.monotonic() + self._prune_interval_s
                try:
                    self.store.prune()
                except Exception:
                    log.warning("record retention on %s failed", self.path, exc_info=True)

    def _lost(self, reason: str, n: int) -> None:
        if self.on_loss is not None:
            try:
                self.on_loss(reason, n)
            except Exception:
                log.warning("record loss callback failed", exc_info=True)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._sender.join()
        self.store.close()
