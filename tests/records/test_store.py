"""The SQLite record store: filters by time and category, newest-N limits, retention."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from records.sqlite_store import RecordStore, query_records

T0 = 1_700_000_000 * 10**9
S = 10**9


def rec(i: int, *, t_s: float, category: str | None = "chat") -> dict[str, Any]:
    return {
        "schema": "specshadow.record/1",
        "exchange_id": f"ex-{i}",
        "started_unix_ns": T0 + int(t_s * S),
        "category": category,
        "payload": {"i": i, "text": "é ✓"},
    }


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "r.db"
    store = RecordStore(path)
    store.append([rec(i, t_s=i, category=("code" if i % 3 == 0 else "chat")) for i in range(10)])
    store.close()
    return path


def ids(records: Any) -> list[int]:
    return [r["payload"]["i"] for r in records]


def test_records_come_back_oldest_first_and_unchanged(store_path: Path) -> None:
    out = list(query_records(store_path))
    assert ids(out) == list(range(10))
    assert out[3] == rec(3, t_s=3, category="code")


def test_filters_by_time_window_and_category(store_path: Path) -> None:
    assert ids(query_records(store_path, since_unix_ns=T0 + 5 * S)) == [5, 6, 7, 8, 9]
    assert ids(query_records(store_path, until_unix_ns=T0 + 2 * S)) == [0, 1]
    assert ids(query_records(store_path, category="code")) == [0, 3, 6, 9]
    assert ids(query_records(store_path, category="code", since_unix_ns=T0 + S)) == [3, 6, 9]
    assert ids(query_records(store_path, category="nope")) == []


def test_a_limit_keeps_the_newest_records_in_time_order(store_path: Path) -> None:
    assert ids(query_records(store_path, limit=3)) == [7, 8, 9]
    assert ids(query_records(store_path, category="chat", limit=2)) == [7, 8]


def test_reading_a_missing_store_raises_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(query_records(tmp_path / "absent.db"))
    assert not (tmp_path / "absent.db").exists()


def test_retention_by_row_count_deletes_the_oldest(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "r.db", max_rows=4)
    store.append([rec(i, t_s=i) for i in range(10)])
    assert store.prune() == 6 and store.count() == 4
    assert ids(query_records(tmp_path / "r.db")) == [6, 7, 8, 9]
    assert store.prune() == 0
    store.close()


def test_retention_by_age_deletes_what_is_older_than_max_age(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "r.db", max_age_s=3.0)
    store.append([rec(i, t_s=i) for i in range(10)])
    assert store.prune(now_unix_ns=T0 + 10 * S) == 7
    assert ids(query_records(tmp_path / "r.db")) == [7, 8, 9]
    store.close()


def test_the_store_uses_wal_and_indexes_time_category_and_exchange(store_path: Path) -> None:
    with sqlite3.connect(store_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        indexes = {row[1] for row in db.execute("PRAGMA index_list(records)")}
    assert {"records_time", "records_category", "records_exchange"} <= indexes
