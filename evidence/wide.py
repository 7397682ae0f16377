"""The wide row: one typed row per exchange, for column stores (ClickHouse, chDB).

Langfuse-style: one mostly immutable row per exchange, written once when its legs have ended,
with typed columns for what aggregates read — the exchange's category, rollout stage and
sampling, and per leg its timings, load, acceptance and quality scalars as parallel arrays
(``legs_<name>``, index ``i`` is the record's ``legs[i]``) — and the full record as JSON text
beside them (``record``), so nothing is lost and a reader that wants the whole record never
joins. Unknown values are NULL, never invented. The layout is versioned (:data:`WIDE_VERSION`,
kept in the table's comment); adding a column is an ``ALTER TABLE … ADD COLUMN IF NOT EXISTS``
migration that :func:`migrations` lists, so an old table keeps working.

Pure: builds rows and DDL text; the engines live in :mod:`evidence.clickhouse`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from core import jsonx

__all__ = [
    "EXCHANGE_COLUMNS",
    "LEG_COLUMNS",
    "WIDE_VERSION",
    "create_table",
    "migrations",
    "wide_row",
]

WIDE_VERSION = 1

Record = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # ClickHouse type; Nullable where the record may hold null
    value: Callable[[Mapping[str, Any]], Any]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _path(*keys: str) -> Callable[[Mapping[str, Any]], Any]:
    def get(obj: Mapping[str, Any]) -> Any:
        value: Any = obj
        for key in keys:
            if not isinstance(value, Mapping):
                return None
            value = value.get(key)
        return value

    return get


def _f(*keys: str) -> Callable[[Mapping[str, Any]], float | None]:
    get = _path(*keys)
    return lambda obj: _num(get(obj))


def _s(*keys: str) -> Callable[[Mapping[str, Any]], str | None]:
    get = _path(*keys)
    return lambda obj: _str(get(obj))


def _flag(*keys: str) -> Callable[[Mapping[str, Any]], int | None]:
    get = _path(*keys)

    def value(obj: Mapping[str, Any]) -> int | None:
        v = get(obj)
        return None if v is None else int(bool(v))

    return value


EXCHANGE_COLUMNS: tuple[Column, ...] = (
    Column("exchange_id", "String", _s("exchange_id")),
    Column("time_unix_ns", "Int64", lambda r: int(r["started_unix_ns"])),
    Column("schema", "String", _s("schema")),
    Column("request_id", "Nullable(String)", _s("request_id")),
    Column("route", "Nullable(String)", _s("route")),
    Column("requested_model", "Nullable(String)", _s("requested_model")),
    Column("tenant", "Nullable(String)", _s("tenant")),
    Column("category", "Nullable(String)", _s("category")),
    Column("stream", "Nullable(UInt8)", _flag("stream")),
    Column("greedy", "Nullable(UInt8)", _flag("greedy")),
    Column("temperature", "Nullable(Float64)", _f("temperature")),
    Column("served_by", "Nullable(String)", _s("served_by")),
    Column("rollout_stage", "Nullable(String)", _s("rollout", "stage")),
    Column("policy_rule", "Nullable(String)", _s("policy", "rule")),
    Column("sampled", "Nullable(UInt8)", _flag("sampling", "sampled")),
    Column("output_length_bucket", "Nullable(String)", _s("output_length_bucket")),
    Column("concurrency", "Nullable(Float64)", _f("concurrency")),
    Column("load_parity", "Nullable(Float64)", _f("load_parity")),
    Column("speculation_skip", "Nullable(String)", _s("speculation_skip")),
)

LEG_COLUMNS: tuple[Column, ...] = (
    Column("role", "String", lambda leg: str(leg.get("role") or "")),
    Column("backend", "String", lambda leg: str(leg.get("backend") or "")),
    Column("outcome", "Nullable(String)", _s("outcome")),
    Column("status", "Nullable(Int32)", lambda leg: _int(leg.get("status"))),
    Column("ttft_s", "Nullable(Float64)", _f("ttft_s")),
    Column("tpot_s", "Nullable(Float64)", _f("tpot_s")),
    Column("e2e_s", "Nullable(Float64)", _f("e2e_s")),
    Column("output_tokens", "Nullable(Float64)", _f("output_tokens")),
    Column("prompt_tokens", "Nullable(Float64)", _f("prompt_tokens")),
    Column("finish_reason", "Nullable(String)", _s("finish_reason")),
    Column("share", "Nullable(Float64)", _f("share")),
    Column("in_flight", "Nullable(Float64)", _f("load", "in_flight")),
    Column("per_replica_rate_rps", "Nullable(Float64)", _f("load", "per_replica_rate_rps")),
    Column("num_requests_running", "Nullable(Float64)", _f("load", "scraped", "num_requests_running")),
    Column("load_parity", "Nullable(Float64)", _f("load_parity")),
    Column("method", "Nullable(String)", _s("speculative", "method")),
    Column("num_speculative_tokens", "Nullable(Float64)", _f("speculative", "num_speculative_tokens")),
    Column("tokens_per_pass", "Nullable(Float64)", _f("acceptance", "tokens_per_pass")),
    Column("mean_acceptance_length", "Nullable(Float64)", _f("acceptance", "mean_acceptance_length")),
    Column("num_drafts", "Nullable(Float64)", _f("acceptance", "num_drafts")),
    Column("num_draft_tokens", "Nullable(Float64)", _f("acceptance", "num_draft_tokens")),
    Column("num_accepted_tokens", "Nullable(Float64)", _f("acceptance", "num_accepted_tokens")),
    Column("output_sha256", "Nullable(String)", _s("output", "sha256")),
    Column("similarity", "Nullable(Float64)", _f("quality", "similarity")),
    Column("loglik", "Nullable(Float64)", _f("quality", "loglik")),
    Column("refusal", "Nullable(UInt8)", _flag("quality", "refusal")),
)  # fmt: skip


def _legs(record: Record) -> list[Mapping[str, Any]]:
    legs = record.get("legs")
    return [leg for leg in legs if isinstance(leg, Mapping)] if isinstance(legs, list) else []


def wide_row(record: Record) -> dict[str, Any]:
    """The record's wide row as a JSON object (``FORMAT JSONEachRow``); the record itself under
    ``record``. Raises KeyError for a record without ``exchange_id``/``started_unix_ns``."""
    row: dict[str, Any] = {c.name: c.value(record) for c in EXCHANGE_COLUMNS}
    legs = _legs(record)
    for c in LEG_COLUMNS:
        row[f"legs_{c.name}"] = [c.value(leg) for leg in legs]
    row["record"] = jsonx.dumps(record).decode()
    return row


def columns() -> list[tuple[str, str]]:
    """Every column of the table, in order: ``(name, ClickHouse type)``."""
    out = [(c.name, c.type) for c in EXCHANGE_COLUMNS]
    out += [(f"legs_{c.name}", f"Array({c.type})") for c in LEG_COLUMNS]
    out.append(("record", "String"))
    return out


def create_table(table: str, *, ttl_days: float | None, server_ttl: bool) -> str:
    """``CREATE TABLE IF NOT EXISTS``: a ReplacingMergeTree (a resent exchange collapses on its
    key), partitioned by day so retention drops whole parts; ordered by time then exchange id,
    the order every reader uses. ``server_ttl``: the engine knows ``TTL`` (ClickHouse ≥ 19.6,
    chDB); otherwise retention is :func:`evidence.clickhouse.ClickHouseStore.prune`'s partition
    drops."""
    cols = ",\n  ".join(f"`{name}` {type_}" for name, type_ in columns())
    day = "toDate(intDiv(time_unix_ns, 1000000000))"
    ttl = ""
    if ttl_days is not None and server_ttl:
        seconds = int(ttl_days * 86400)
        ttl = f"\nTTL toDateTime(intDiv(time_unix_ns, 1000000000)) + INTERVAL {seconds} SECOND"
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n  {cols},\n  `day` Date DEFAULT {day}\n)"
        "\nENGINE = ReplacingMergeTree\nPARTITION BY day\nORDER BY (time_unix_ns, exchange_id)"
        f"{ttl}"
    )


def migrations(table: str, present: set[str]) -> list[str]:
    """``ALTER TABLE`` statements adding the columns an older table lacks."""
    return [
        f"ALTER TABLE {table} ADD COLUMN `{name}` {type_}"
        for name, type_ in columns()
        if name not in present
    ]
