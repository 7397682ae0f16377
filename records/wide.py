"""The wide row: one typed row per exchange, for column stores (ClickHouse, chDB).

Langfuse-style: one mostly immutable row per exchange, written once when its legs have ended,
with typed columns for what aggregates read — the exchange's category, rollout stage and
sampling, and per leg its timings, load, acceptance and quality scalars as parallel arrays
(``legs_<name>``, index ``i`` is the record's ``legs[i]``) — and the full record as JSON text
beside them (``record``), so nothing is lost and a reader that wants the whole record never
joins. Unknown values are NULL, never invented. The layout is versioned (:data:`WIDE_VERSION`,
kept in the table's comment); adding a column is an ``ALTER TABLE … ADD COLUMN IF NOT EXISTS``
migration that :func:`migrations` lists, so an old table keeps working.

Records that reach ClickHouse another way — the OpenTelemetry Collector's ClickHouse exporter,
which stores each ``specshadow.record`` log record's body in its logs table — get the same rows
from the materialized view :func:`otel_view` builds from the same column definitions
(``specshadow records sql`` prints it).

Pure: builds rows and DDL text; the engines live in :mod:`records.clickhouse`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core import jsonx

__all__ = [
    "EXCHANGE_COLUMNS",
    "LEG_COLUMNS",
    "WIDE_VERSION",
    "create_table",
    "migrations",
    "otel_view",
    "wide_row",
]

WIDE_VERSION = 2

Record = Mapping[str, Any]


Kind = str  # "key" (a string, "" when absent), "str", "num", "int", "flag", "time", "keys"

_SQL_TYPES = {
    "key": "String",
    "str": "Nullable(String)",
    "num": "Nullable(Float64)",
    "int": "Nullable(Int32)",
    "flag": "Nullable(UInt8)",
    "time": "Int64",
    "keys": "Array(String)",
}


@dataclass(frozen=True, slots=True)
class Column:
    """One typed column: the value at ``path`` in the record (or the leg), read as ``kind``.

    Declarative, so that the Python extraction (:func:`wide_row`) and the SQL one
    (:func:`otel_view`, for records that arrive as OTLP log bodies) come from one definition."""

    name: str
    path: tuple[str, ...]
    kind: Kind
    item: str | None = None  # "keys": the list's objects' field (None: a list of strings)

    @property
    def type(self) -> str:
        return _SQL_TYPES[self.kind]

    def value(self, obj: Mapping[str, Any]) -> Any:
        v: Any = obj
        for key in self.path:
            v = v.get(key) if isinstance(v, Mapping) else None
        if self.kind == "key":
            return "" if v is None else str(v)
        if self.kind == "keys":
            items = v if isinstance(v, list) else []
            if self.item is None:
                return [str(x) for x in items if x is not None]
            return [
                "" if (x := d.get(self.item)) is None else str(x)
                for d in items
                if isinstance(d, Mapping)
            ]
        if self.kind == "str":
            return v if isinstance(v, str) else None
        if self.kind in ("num", "time"):
            if isinstance(v, bool) or not isinstance(v, int | float):
                return None if self.kind == "num" else 0
            return float(v) if self.kind == "num" else int(v)
        if self.kind == "int":
            return v if isinstance(v, int) and not isinstance(v, bool) else None
        return None if v is None else int(bool(v))  # flag

    def sql(self, json: str) -> str:
        """The ClickHouse expression reading this column from the JSON text ``json``."""
        keys = ", ".join(f"'{k}'" for k in self.path)
        if self.kind == "keys" and self.item is None:
            return f"JSONExtract({json}, {keys}, 'Array(String)')"
        if self.kind == "keys":
            return (
                f"arrayMap(d -> JSONExtractString(d, '{self.item}'), "
                f"JSONExtractArrayRaw({json}, {keys}))"
            )
        if self.kind == "key":
            return f"ifNull(JSONExtract({json}, {keys}, 'Nullable(String)'), '')"
        if self.kind == "time":
            return f"JSONExtract({json}, {keys}, 'Int64')"
        return f"JSONExtract({json}, {keys}, '{self.type}')"


def _c(name: str, kind: Kind, *path: str) -> Column:
    return Column(name, path or (name,), kind)


EXCHANGE_COLUMNS: tuple[Column, ...] = (
    _c("exchange_id", "key"),
    _c("time_unix_ns", "time", "started_unix_ns"),
    _c("schema", "key"),
    _c("request_id", "str"),
    _c("route", "str"),
    _c("requested_model", "str"),
    _c("tenant", "str"),
    _c("category", "str"),
    _c("stream", "flag"),
    _c("greedy", "flag"),
    _c("temperature", "num"),
    _c("served_by", "str"),
    _c("rollout_stage", "str", "rollout", "stage"),
    _c("policy_rule", "str", "policy", "rule"),
    _c("sampled", "flag", "sampling", "sampled"),
    _c("output_length_bucket", "str"),
    _c("concurrency", "num"),
    _c("load_parity", "num"),
    _c("speculation_skip", "str"),
    # added in version 2: what the report's exclusions and candidate list read
    Column("candidates", ("sampling", "candidates"), "keys"),
    Column("dropped_backends", ("sampling", "dropped"), "keys", "backend"),
    Column("dropped_roles", ("sampling", "dropped"), "keys", "role"),
    Column("dropped_reasons", ("sampling", "dropped"), "keys", "reason"),
)

LEG_COLUMNS: tuple[Column, ...] = (
    _c("role", "key"),
    _c("backend", "key"),
    _c("outcome", "str"),
    _c("status", "int"),
    _c("ttft_s", "num"),
    _c("tpot_s", "num"),
    _c("e2e_s", "num"),
    _c("output_tokens", "num"),
    _c("prompt_tokens", "num"),
    _c("finish_reason", "str"),
    _c("share", "num"),
    _c("in_flight", "num", "load", "in_flight"),
    _c("per_replica_rate_rps", "num", "load", "per_replica_rate_rps"),
    _c("num_requests_running", "num", "load", "scraped", "num_requests_running"),
    _c("load_parity", "num"),
    _c("method", "str", "speculative", "method"),
    _c("num_speculative_tokens", "num", "speculative", "num_speculative_tokens"),
    _c("tokens_per_pass", "num", "acceptance", "tokens_per_pass"),
    _c("mean_acceptance_length", "num", "acceptance", "mean_acceptance_length"),
    _c("num_drafts", "num", "acceptance", "num_drafts"),
    _c("num_draft_tokens", "num", "acceptance", "num_draft_tokens"),
    _c("num_accepted_tokens", "num", "acceptance", "num_accepted_tokens"),
    _c("output_sha256", "str", "output", "sha256"),
    _c("similarity", "num", "quality", "similarity"),
    _c("loglik", "num", "quality", "loglik"),
    _c("refusal", "flag", "quality", "refusal"),
    _c("error_type", "str"),  # version 2
)


def _legs(record: Record) -> list[Mapping[str, Any]]:
    legs = record.get("legs")
    return [leg for leg in legs if isinstance(leg, Mapping)] if isinstance(legs, list) else []


def wide_row(record: Record) -> dict[str, Any]:
    """The record's wide row as a JSON object (``FORMAT JSONEachRow``); the record itself under
    ``record``."""
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
    the order every reader uses. ``server_ttl``: the engine knows ``TTL`` and adaptive granules
    (ClickHouse ≥ 19.6, chDB); otherwise retention is :func:`records.clickhouse.ClickHouseStore.prune`'s partition
    drops."""
    cols = ",\n  ".join(f"`{name}` {type_}" for name, type_ in columns())
    day = "toDate(intDiv(time_unix_ns, 1000000000))"
    ttl = ""
    if ttl_days is not None and server_ttl:
        seconds = int(ttl_days * 86400)
        ttl = f"\nTTL toDateTime(intDiv(time_unix_ns, 1000000000)) + INTERVAL {seconds} SECOND"
    # Granules of about 1 MiB (modern engines; the default is 10 MiB): a report's sample reads
    # the JSON of a few thousand rows scattered through the window, and each costs its granule.
    settings = "\nSETTINGS index_granularity_bytes = 1048576" if server_ttl else ""
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n  {cols},\n  `day` Date DEFAULT {day}\n)"
        "\nENGINE = ReplacingMergeTree\nPARTITION BY day\nORDER BY (time_unix_ns, exchange_id)"
        f"{ttl}{settings}"
    )


def otel_view(table: str, source: str, view: str) -> str:
    """A materialized view filling ``table`` from the OpenTelemetry Collector ClickHouse
    exporter's logs table ``source``: every ``specshadow.record`` log record's body (the record's
    JSON) becomes its wide row, with the same values :func:`wide_row` writes. (Modern ClickHouse
    only: ``JSONExtract`` arrived in 19.x.)"""
    exprs = [f"{c.sql('Body')} AS `{c.name}`" for c in EXCHANGE_COLUMNS]
    exprs += [
        f"arrayMap(leg -> {c.sql('leg')}, JSONExtractArrayRaw(Body, 'legs')) AS `legs_{c.name}`"
        for c in LEG_COLUMNS
    ]
    exprs.append("Body AS `record`")
    select = ",\n  ".join(exprs)
    return (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view} TO {table} AS SELECT\n  {select}\n"
        f"FROM {source}\nWHERE EventName = 'specshadow.record'"
        " OR (EventName = '' AND startsWith(JSONExtractString(Body, 'schema'), 'specshadow.record/'))"
    )


def migrations(table: str, present: set[str]) -> list[str]:
    """``ALTER TABLE`` statements adding the columns an older table lacks."""
    return [
        f"ALTER TABLE {table} ADD COLUMN `{name}` {type_}"
        for name, type_ in columns()
        if name not in present
    ]
