"""The record's derived rules, each written once: the values the writer derives from an exchange
(buckets), how a reader names an exchange with no category and the pooled category, which leg
counts as completed, and the canonical order of records — each with its SQL form beside the
Python one, so the SQL report (:mod:`report.sql`) and every Python reader agree by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.classify import ALL, UNCATEGORIZED

__all__ = [
    "ALL",
    "CONCURRENCY_BUCKETS",
    "OUTPUT_LENGTH_BUCKETS",
    "UNCATEGORIZED",
    "canonical_key",
    "category_sql",
    "concurrency_bucket",
    "leg_ok",
    "leg_ok_sql",
    "output_length_bucket",
]

# Upper bounds (exclusive) and labels; the last label takes everything above.
OUTPUT_LENGTH_BUCKETS: tuple[tuple[int, str], ...] = (
    (64, "<64"),
    (256, "64-256"),
    (1024, "256-1024"),
)
OUTPUT_LENGTH_TOP = ">=1024"
CONCURRENCY_BUCKETS: tuple[tuple[int, str], ...] = (
    (1, "1"),
    (4, "2-4"),
    (16, "5-16"),
    (64, "17-64"),
)
CONCURRENCY_TOP = ">64"


def output_length_bucket(output_tokens: int | None) -> str | None:
    if output_tokens is None:
        return None
    for bound, label in OUTPUT_LENGTH_BUCKETS:
        if output_tokens < bound:
            return label
    return OUTPUT_LENGTH_TOP


def concurrency_bucket(in_flight: int) -> str:
    """Bucket of legs of the same role in flight at dispatch (this one included)."""
    for bound, label in CONCURRENCY_BUCKETS:
        if in_flight <= bound:
            return label
    return CONCURRENCY_TOP


def leg_ok(outcome: Any, status: Any, error_type: Any) -> bool:
    """A completed leg: no error outcome (a missing outcome is a completed one, as older records
    wrote none), no error status, no error type. :func:`leg_ok_sql` is the same rule in SQL."""
    return (
        outcome in (None, "completed")
        and (status is None or (isinstance(status, int) and status < 400))
        and error_type is None
    )


def leg_ok_sql(i: str) -> str:
    """:func:`leg_ok` over the wide row's leg columns (:mod:`records.wide`: ``legs_outcome``,
    ``legs_status``, ``legs_error_type``, arrays over the legs) at 1-based index ``i`` (an SQL
    expression; 0: no such leg, never ok)."""
    return (
        f"({i} > 0 AND (isNull(legs_outcome[{i}]) OR legs_outcome[{i}] = 'completed')"
        f" AND (isNull(legs_status[{i}]) OR legs_status[{i}] < 400)"
        f" AND isNull(legs_error_type[{i}]))"
    )


def category_sql(column: str = "category") -> str:
    """The category as every reader names it: :data:`UNCATEGORIZED` when there is none."""
    return f"if({column} = '', '{UNCATEGORIZED}', {column})"


def canonical_key(record: Mapping[str, Any]) -> tuple[int, str]:
    """The canonical order of records from any source: start time, then exchange id (SQL:
    ``ORDER BY started_unix_ns, exchange_id``)."""
    return int(record.get("started_unix_ns") or 0), str(record.get("exchange_id", ""))
