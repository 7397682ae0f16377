"""The shared rollout store on the fleet's ClickHouse server (``--state clickhouse://host/db``).

The same three tables as the SQLite store (:mod:`rollout.store`), as ``MergeTree``
tables, spoken to over the HTTP interface by :class:`records.clickhouse.HttpEngine` (Debian's
18.16 server and current ones answer it alike). ClickHouse has no transactions, so a change is
an insert at ``expected + 1`` with its parent named, read back and kept only if the chain
(:func:`rollout.store.resolve`) contains it.

Evidence rows get the server's clock (``ts DEFAULT now()``, one clock for every replica) and
are read in ``(ts, replica, seq)`` order once they are :data:`~rollout.store.DEFAULT_SETTLE_S`
old by that clock, so every replica reads the same rows in the same order (an insert still in
flight when its second settles is the exception: its rows are read by the replicas that read
after it landed).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from core import jsonx
from records.clickhouse import ClickHouseError, HttpEngine
from rollout.state import RuleState
from rollout.store import (
    DEFAULT_SETTLE_S,
    LOG_COLUMNS,
    Cursor,
    StateURL,
    StoredState,
    StoreError,
    new_row,
    resolve,
)

_TABLES = (
    "CREATE TABLE IF NOT EXISTS rollout_log (rule String, version UInt64, row_id String,"
    " parent_id String, priority UInt8, writer String, at Float64, fingerprint String,"
    " state String) ENGINE = MergeTree ORDER BY (rule, version, row_id)",
    "CREATE TABLE IF NOT EXISTS rollout_evidence (rule String, episode String,"
    " ts DateTime DEFAULT now(), replica String, seq UInt64, body String)"
    " ENGINE = MergeTree ORDER BY (rule, episode, ts, replica, seq)",
    "CREATE TABLE IF NOT EXISTS rollout_replicas (replica String, at Float64, row_id String)"
    " ENGINE = MergeTree ORDER BY (at, row_id)",
)


def _q(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ClickHouseStateStore:
    """See the module doc."""

    def __init__(
        self, url: StateURL, *, timeout_s: float = 2.0, settle_s: float = DEFAULT_SETTLE_S
    ) -> None:
        self.name = url.describe()
        self.url = url
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._engine: HttpEngine | None = None  # connected, and the tables made, on first use

    @property
    def engine(self) -> HttpEngine:
        if self._engine is None:
            assert self.url.host is not None
            try:
                engine = HttpEngine(
                    self.url.host, self.url.port, self.url.database, self.url.user,
                    self.url.password, timeout_s=self.timeout_s,
                )  # fmt: skip
                engine.create_database()
                for sql in _TABLES:
                    engine.execute(sql)
            except (ClickHouseError, OSError) as exc:
                raise StoreError(f"{self.name}: {exc}") from exc
            self._engine = engine
        return self._engine

    def _rows(self, sql: str) -> list[dict[str, Any]]:
        try:
            body = self.engine.execute(sql + " FORMAT JSONEachRow")
        except (ClickHouseError, OSError) as exc:
            raise StoreError(f"{self.name}: {exc}") from exc
        return [jsonx.loads(line) for line in body.splitlines() if line.strip()]

    def _insert(self, table: str, rows: Sequence[dict[str, Any]]) -> None:
        # The columns named: one left out gets its DEFAULT (the evidence's server-side ``ts``);
        # a field merely missing from a JSONEachRow row gets 0 on servers before 19.x.
        data = b"".join(jsonx.dumps(r) + b"\n" for r in rows)
        try:
            self.engine.execute(
                f"INSERT INTO {table} ({', '.join(rows[0])}) FORMAT JSONEachRow", data
            )
        except (ClickHouseError, OSError) as exc:
            raise StoreError(f"{self.name}: {exc}") from exc

    def register(self, replica: str, at: float) -> int:
        mine = uuid.uuid4().hex
        self._insert("rollout_replicas", [{"replica": replica, "at": at, "row_id": mine}])
        ids = [
            r["row_id"]
            for r in self._rows("SELECT row_id FROM rollout_replicas ORDER BY at, row_id")
        ]
        return ids.index(mine) + 1 if mine in ids else len(ids) + 1

    def _log(self, rule: str | None = None) -> list[StoredState]:
        where = f" WHERE rule = {_q(rule)}" if rule is not None else ""
        return [
            StoredState.from_row(r)
            for r in self._rows(f"SELECT {LOG_COLUMNS} FROM rollout_log{where}")
        ]

    def current(self) -> dict[str, StoredState]:
        rules: dict[str, list[StoredState]] = {}
        for r in self._log():
            rules.setdefault(r.rule, []).append(r)
        heads = {rule: resolve(rows) for rule, rows in rules.items()}
        return {rule: chain[-1] for rule, chain in heads.items() if chain}

    def history(self, rule: str) -> list[StoredState]:
        return resolve(self._log(rule))

    def cas(
        self, rule: str, expected: StoredState | None, new: RuleState, writer: str
    ) -> StoredState | None:
        chain = self.history(rule)
        head = chain[-1] if chain else None
        if (head.row_id if head else "") != (expected.row_id if expected else ""):
            return None
        row = new_row(
            rule, (head.version if head else 0) + 1, head.row_id if head else "", new, writer
        )
        self._insert("rollout_log", [row])
        # Read back: a racing writer at the same version may have won (a rollback does).
        return next((r for r in self.history(rule) if r.row_id == row["row_id"]), None)

    def append(self, rows: Sequence[tuple[str, str, str, int, bytes]]) -> None:
        if rows:
            self._insert(
                "rollout_evidence",
                [
                    {"rule": r, "episode": e, "replica": p, "seq": s, "body": b.decode()}
                    for r, e, p, s, b in rows
                ],
            )

    def evidence(
        self, rule: str, episode: str, after: Cursor | None, limit: int
    ) -> tuple[Cursor | None, list[bytes]]:
        ts, replica, seq = after if after is not None else (0, "", 0)
        rows = self._rows(
            "SELECT toUInt32(ts) AS t, replica, seq, body FROM rollout_evidence"
            f" WHERE rule = {_q(rule)} AND episode = {_q(episode)}"
            f" AND toUInt32(ts) <= toUInt32(now()) - {int(self.settle_s)}"
            f" AND (toUInt32(ts) > {int(ts)} OR (toUInt32(ts) = {int(ts)} AND (replica > {_q(replica)}"
            f" OR (replica = {_q(replica)} AND seq > {int(seq)}))))"
            f" ORDER BY t, replica, seq LIMIT {int(limit)}"
        )
        if not rows:
            return after, []
        last = rows[-1]
        return (int(last["t"]), str(last["replica"]), int(last["seq"])), [
            str(r["body"]).encode() for r in rows
        ]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
