"""Where rollout state lives when replicas share it: ``--state sqlite:///PATH`` or
``--state clickhouse://host:port/db`` (a plain path stays the one process's JSON file,
:mod:`rollout.state`).

A shared store holds three append-only tables:

- ``rollout_log`` — every rule's state, one row per change: ``(rule, version, row_id,
  parent_id, priority, writer, at, fingerprint, state)``, the state as JSON with the
  transition that made it (``last``). The current state of a rule is the head of its chain
  (:func:`resolve`). Every transition and every operator action is a row; nothing is updated.
- ``rollout_evidence`` — each replica's guard observations, one row per exchange, tagged with
  the rule and the episode they belong to; every replica reads the same rows in the same order
  (:mod:`rollout.fleet` runs one sequential test over them).
- ``rollout_replicas`` — one row per replica start: its incarnation number ``k`` (the share of
  the false-alarm budget its local guards may spend, :mod:`rollout.fleet`).

**Compare-and-set.** A change names the version it was computed from (:meth:`cas`). On SQLite
that is a transaction (``BEGIN IMMEDIATE``; WAL mode; a busy timeout): the row is written only
if the rule's newest version is still the expected one, so versions form one chain. ClickHouse
has no transactions: the row is inserted at ``expected + 1`` with ``parent_id`` = the row it
was built on, then read back. Where two writers raced to one version, :func:`resolve` keeps,
at each version, only rows whose parent is the previous version's winner, and among those the
highest ``priority`` wins — a rollback (priority 2) over anything else (1), then the earlier
row. So a rollback is never undone by a writer that had not seen it: a row built on a state the
rollback replaced has the wrong parent and is not part of the chain.

Errors of every kind (the file unreadable, the server refused or unreachable) are
:class:`StoreError`; the caller keeps its last state (fail static).
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core import jsonx
from core.faults import BadInput
from core.sqlite_wal import enable_wal
from records.urls import parse_url
from rollout.state import RuleState

ROLLBACK_PRIORITY = 2
CHANGE_PRIORITY = 1
DEFAULT_POLL_S = 0.5
MAX_POLL_S = 60.0
DEFAULT_SETTLE_S = 2.0  # ClickHouse: evidence rows are read once this old (server clock)
Cursor = tuple[int, str, int]  # where a reader stands in the evidence log


LOG_COLUMNS = "rule, version, row_id, parent_id, priority, writer, at, fingerprint, state"
LOG_COLUMN_NAMES = tuple(c.strip() for c in LOG_COLUMNS.split(","))


class StoreError(BadInput, RuntimeError):
    """The shared store could not be read or written (at start, a bad ``--state``: exit 2)."""


@dataclass(frozen=True, slots=True)
class StateURL:
    """``--state``: a file path, ``sqlite:///PATH`` or ``clickhouse://[user[:pw]@]host[:port]/db``;
    ``?poll_s=`` (how often a replica reads the store, default 0.5 s)."""

    kind: str  # file | sqlite | clickhouse
    path: str | None = None
    host: str | None = None
    port: int = 8123
    database: str = "default"
    user: str | None = None
    password: str | None = None
    poll_s: float = DEFAULT_POLL_S

    @property
    def shared(self) -> bool:
        return self.kind != "file"

    def describe(self) -> str:
        if self.kind == "clickhouse":
            return f"clickhouse://{self.host}:{self.port}/{self.database}"
        return f"sqlite://{self.path}" if self.kind == "sqlite" else str(self.path)


def parse_state_url(text: str) -> StateURL:
    """``--state`` parsed (the URL by :func:`records.urls.parse_url`, the one parser ``--store``
    shares); ValueError naming what is wrong."""
    if "://" not in text:
        return StateURL("file", path=text)
    url = parse_url(
        text, schemes=("sqlite", "clickhouse"), options=("poll_s",), sqlite_example="rollout.db"
    )
    poll_s = url.option("poll_s", DEFAULT_POLL_S, most=MAX_POLL_S)
    if url.kind == "sqlite":
        return StateURL("sqlite", path=url.path, poll_s=poll_s)
    return StateURL(
        "clickhouse", host=url.host, port=url.port, database=url.database, user=url.user,
        password=url.password, poll_s=poll_s,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoredState:
    """One row of ``rollout_log``: a rule's state at ``version``."""

    rule: str
    version: int
    row_id: str
    parent_id: str
    priority: int
    writer: str
    at: float
    state: RuleState = field(compare=False)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> StoredState:
        """A ``rollout_log`` row (its :data:`LOG_COLUMNS`; 64-bit integers may come quoted)."""
        rule, version, row_id, parent, priority, writer, at, _fingerprint, state = (
            row[c] for c in LOG_COLUMN_NAMES
        )
        return cls(str(rule), int(version), str(row_id), str(parent), int(priority), str(writer),
                   float(at), RuleState.from_json(jsonx.loads(state)))  # fmt: skip


def resolve(rows: Iterable[StoredState]) -> list[StoredState]:
    """One rule's chain, oldest first: at each version the highest-priority row (then the
    earliest, then the smallest id) among those built on the previous version's winner."""
    by_version: dict[int, list[StoredState]] = {}
    for r in rows:
        by_version.setdefault(r.version, []).append(r)
    chain: list[StoredState] = []
    parent, version = "", 1
    while version in by_version:
        built_on = [r for r in by_version[version] if r.parent_id == parent]
        if not built_on:
            break
        winner = min(built_on, key=lambda r: (-r.priority, r.at, r.row_id))
        chain.append(winner)
        parent, version = winner.row_id, version + 1
    return chain


def priority_of(state: RuleState) -> int:
    return ROLLBACK_PRIORITY if state.stage == "shadow" and state.rolled_back else CHANGE_PRIORITY


class SharedStore(Protocol):
    """What :mod:`rollout.fleet` needs of a shared store (SQLite or ClickHouse)."""

    name: str

    def register(self, replica: str, at: float) -> int: ...
    def current(self) -> dict[str, StoredState]: ...
    def history(self, rule: str) -> list[StoredState]: ...
    def cas(
        self, rule: str, expected: StoredState | None, new: RuleState, writer: str
    ) -> StoredState | None: ...
    def append(self, rows: Sequence[tuple[str, str, str, int, bytes]]) -> None: ...
    def evidence(
        self, rule: str, episode: str, after: Cursor | None, limit: int
    ) -> tuple[Cursor | None, list[bytes]]: ...
    def close(self) -> None: ...


def new_row(rule: str, version: int, parent: str, new: RuleState, writer: str) -> dict[str, Any]:
    return {
        "rule": rule, "version": version, "row_id": uuid.uuid4().hex, "parent_id": parent,
        "priority": priority_of(new), "writer": writer,
        "at": new.last.at_unix if new.last is not None else new.since_unix,
        "fingerprint": new.fingerprint, "state": jsonx.dumps(new.to_json()).decode(),
    }  # fmt: skip


class SqliteStateStore:
    """The shared store in one SQLite file: the processes of one host (WAL, busy timeout,
    transactions)."""

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.name = f"sqlite://{path}"
        self.path = path
        self._lock = threading.Lock()  # one connection, used by this process's threads in turn
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
            self._db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            # Replicas started together race to switch a fresh file to WAL (core.sqlite_wal).
            enable_wal(self._db, timeout_s=timeout_s)
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.executescript(
                "CREATE TABLE IF NOT EXISTS rollout_log (rule TEXT NOT NULL, version INTEGER NOT"
                " NULL, row_id TEXT NOT NULL, parent_id TEXT NOT NULL, priority INTEGER NOT NULL,"
                " writer TEXT NOT NULL, at REAL NOT NULL, fingerprint TEXT NOT NULL, state TEXT"
                " NOT NULL, PRIMARY KEY (rule, version));"
                "CREATE TABLE IF NOT EXISTS rollout_evidence (id INTEGER PRIMARY KEY"
                " AUTOINCREMENT, rule TEXT NOT NULL, episode TEXT NOT NULL, replica TEXT NOT NULL,"
                " seq INTEGER NOT NULL, body BLOB NOT NULL);"
                "CREATE INDEX IF NOT EXISTS rollout_evidence_episode ON rollout_evidence"
                " (rule, episode, id);"
                "CREATE TABLE IF NOT EXISTS rollout_replicas (k INTEGER PRIMARY KEY AUTOINCREMENT,"
                " replica TEXT NOT NULL, at REAL NOT NULL);"
            )
        except sqlite3.Error as exc:
            what = "is a folder" if Path(path).is_dir() else f"not a rollout state store ({exc})"
            raise StoreError(
                f"{self.name}: {what}; give a new path or the one serve wrote"
            ) from exc

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            with self._lock:
                return list(self._db.execute(sql, args))
        except sqlite3.Error as exc:
            raise StoreError(f"{self.name}: {exc}") from exc

    def register(self, replica: str, at: float) -> int:
        try:
            with self._lock:
                cur = self._db.execute(
                    "INSERT INTO rollout_replicas (replica, at) VALUES (?, ?)", (replica, at)
                )
                return int(cur.lastrowid or 0)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.name}: {exc}") from exc

    def _states(self, sql: str, args: Sequence[Any] = ()) -> list[StoredState]:
        rows = self._query(sql, args)
        return [StoredState.from_row(dict(zip(LOG_COLUMN_NAMES, r, strict=True))) for r in rows]

    def current(self) -> dict[str, StoredState]:
        rows = self._states(
            f"SELECT {LOG_COLUMNS} FROM rollout_log l WHERE version ="
            " (SELECT max(version) FROM rollout_log m WHERE m.rule = l.rule)"
        )
        return {r.rule: r for r in rows}

    def history(self, rule: str) -> list[StoredState]:
        return self._states(
            f"SELECT {LOG_COLUMNS} FROM rollout_log WHERE rule = ? ORDER BY version", (rule,)
        )

    def cas(
        self, rule: str, expected: StoredState | None, new: RuleState, writer: str
    ) -> StoredState | None:
        """Write ``new`` as the rule's next version if its head is still ``expected``: the row
        written, or None (the head moved: re-read)."""
        version = expected.version if expected is not None else 0
        row = new_row(rule, version + 1, expected.row_id if expected else "", new, writer)
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    (head,) = self._db.execute(
                        "SELECT coalesce(max(version), 0) FROM rollout_log WHERE rule = ?", (rule,)
                    ).fetchone()
                    if head != version:
                        self._db.execute("ROLLBACK")
                        return None
                    self._db.execute(
                        f"INSERT INTO rollout_log ({LOG_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                        [row[c] for c in LOG_COLUMN_NAMES],
                    )
                    self._db.execute("COMMIT")
                    return StoredState.from_row(row)
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise StoreError(f"{self.name}: {exc}") from exc

    def append(self, rows: Sequence[tuple[str, str, str, int, bytes]]) -> None:
        if not rows:
            return
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.executemany(
                        "INSERT INTO rollout_evidence (rule, episode, replica, seq, body)"
                        " VALUES (?, ?, ?, ?, ?)",
                        rows,
                    )
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise StoreError(f"{self.name}: {exc}") from exc

    def evidence(
        self, rule: str, episode: str, after: Cursor | None, limit: int
    ) -> tuple[Cursor | None, list[bytes]]:
        start = after[0] if after is not None else 0
        rows = self._query(
            "SELECT id, body FROM rollout_evidence WHERE rule = ? AND episode = ? AND id > ?"
            " ORDER BY id LIMIT ?",
            (rule, episode, start, limit),
        )
        if not rows:
            return after, []
        return (int(rows[-1][0]), "", 0), [bytes(body) for _, body in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_transitions(text: str) -> list[dict[str, Any]]:
    """The rollout transitions a ``serve --state`` holds, as JSON (:meth:`Transition.to_json`),
    for ``specshadow report --state``: the JSON file's last transition of each rule; a shared
    store's (``sqlite:///``, ``clickhouse://``) every transition of each rule's chain, so a
    rollback followed by a later change is still there. Nothing is created: a store that does
    not exist, or cannot be read, is a :class:`StoreError` naming it."""
    try:
        url = parse_state_url(text)
    except ValueError as exc:
        raise StoreError(f"--state {exc}") from None
    where = f"--state {url.describe()}"
    if url.kind in ("file", "sqlite"):
        path = Path(str(url.path))
        if not path.exists():
            raise StoreError(f"{where}: no such file; give the state serve --state wrote")
        if path.is_dir():
            raise StoreError(f"{where}: is a folder; give the state serve --state wrote")
    if url.kind == "file":
        try:
            data = jsonx.loads(Path(str(url.path)).read_bytes())
            rules = data["rules"] if isinstance(data, dict) else None
            if not isinstance(rules, dict):
                raise ValueError("no rules")
            states = [RuleState.from_json(s) for s in rules.values()]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"{where}: not a rollout state file ({exc})") from exc
        return [s.last.to_json() for s in states if s.last is not None]
    store = open_store(url)
    try:
        out: list[dict[str, Any]] = []
        for rule in sorted(store.current()):
            seen: set[tuple[Any, ...]] = set()
            for row in resolve(store.history(rule)):
                last = row.state.last
                if last is None:
                    continue
                key = (last.at_unix, last.from_stage, last.to_stage)
                if key not in seen:
                    seen.add(key)
                    out.append(last.to_json())
        return out
    finally:
        store.close()


def open_store(url: StateURL) -> SharedStore:
    """The shared store ``url`` names (StoreError if it cannot be opened now)."""
    if url.kind == "sqlite":
        assert url.path is not None
        return SqliteStateStore(url.path)
    if url.kind == "clickhouse":
        from rollout.store_clickhouse import ClickHouseStateStore

        return ClickHouseStateStore(url)
    raise ValueError(f"{url.describe()} is a file, not a shared store")
