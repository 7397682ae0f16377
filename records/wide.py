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

Every column is derived from the reader's declared field (:func:`column`: the field's path and
kind, :mod:`records.fields`), so a column and the reader's attribute cannot drift apart.

Pure: builds rows and DDL text; the engines live in :mod:`records.clickhouse`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core import jsonx
from records.fields import Field
from records.reader import (
    Acceptance,
    Captured,
    Drop,
    Leg as Leg_,
    LegQuality,
    Load,
    Policy,
    Record as Record_,
    Rollout,
    Sampling,
    Scraped,
    Speculative,
)

__all__ = [
    "EXCHANGE_COLUMNS",
    "LEG_COLUMNS",
    "WIDE_VERSION",
    "create_table",
    "migrations",
    "otel_view",
    "wide_row",
]

WIDE_VERSION = 3

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


# The wide kind of each declared field kind (records.fields); a column may override it where the
# table's type differs from the reader's (an int read as Float64, the start time as Int64).
_WIDE_KIND: Mapping[str, Kind] = {
    "key": "key",
    "str": "str",
    "num": "num",
    "int": "int",
    "flag": "flag",
    "truth": "flag",
    "keys": "keys",
}


def column(
    name: str, *path: Field[Any], kind: Kind | None = None, item: Field[Any] | None = None
) -> Column:
    """The column ``name`` holding the declared field at the end of ``path`` (a chain of view
    fields, then the field), read as its kind (or ``kind``); ``item``: for a list of objects,
    the items' field whose values the column lists."""
    last = path[-1]
    full = tuple(k for f in path for k in f.path)
    if item is not None:
        return Column(name, full, "keys", item.path[0])
    return Column(name, full, kind or _WIDE_KIND[last.kind])


R, L = Record_, Leg_
EXCHANGE_COLUMNS: tuple[Column, ...] = (
    column("exchange_id", R.exchange_id),
    column("time_unix_ns", R._started_unix_ns, kind="time"),
    column("schema", R.schema),
    column("request_id", R.request_id),
    column("route", R.route),
    column("requested_model", R.requested_model),
    column("category", R._category),
    column("stream", R.stream),
    column("greedy", R.greedy),
    column("temperature", R.temperature),
    column("served_by", R._served_by),
    column("rollout_stage", R.rollout, Rollout.stage),
    column("policy_rule", R.policy, Policy.rule),
    column("sampled", R._sampling, Sampling.sampled),
    column("output_length_bucket", R.output_length_bucket),
    column("concurrency", R.concurrency, kind="num"),
    column("load_parity", R.load_parity),
    column("speculation_skip", R.speculation_skip),
    # added in version 2: what the report's exclusions and candidate list read
    column("candidates", R._sampling, Sampling.candidates),
    column("dropped_backends", R._sampling, Sampling.dropped, item=Drop.backend),
    column("dropped_roles", R._sampling, Sampling.dropped, item=Drop.role),
    column("dropped_reasons", R._sampling, Sampling.dropped, item=Drop._reason),
    # added in version 3: the rollout episode the report splits a rolled-back window at
    column("rollout_episode", R.rollout, Rollout.episode),
)

LEG_COLUMNS: tuple[Column, ...] = (
    column("role", L.role, kind="key"),
    column("backend", L.backend),
    column("outcome", L.outcome),
    column("status", L.status),
    column("ttft_s", L.ttft_s),
    column("tpot_s", L.tpot_s),
    column("e2e_s", L.e2e_s),
    column("output_tokens", L.output_tokens),
    column("prompt_tokens", L.prompt_tokens),
    column("finish_reason", L.finish_reason),
    column("share", L.share),
    column("in_flight", L._load, Load.in_flight),
    column("per_replica_rate_rps", L._load, Load.per_replica_rate_rps),
    column("num_requests_running", L._load, Load.scraped, Scraped.num_requests_running),
    column("load_parity", L.load_parity),
    column("method", L.speculative, Speculative.method),
    column("num_speculative_tokens", L.speculative, Speculative.num_speculative_tokens, kind="num"),
    column("tokens_per_pass", L._acceptance, Acceptance.tokens_per_pass),
    column("mean_acceptance_length", L._acceptance, Acceptance.mean_acceptance_length),
    column("num_drafts", L._acceptance, Acceptance.num_drafts),
    column("num_draft_tokens", L._acceptance, Acceptance.num_draft_tokens),
    column("num_accepted_tokens", L._acceptance, Acceptance.num_accepted_tokens),
    column("output_sha256", L.output, Captured.sha256),
    column("similarity", L.quality, LegQuality.similarity),
    column("refusal", L.quality, LegQuality.refusal),
    column("error_type", L.error_type),  # version 2
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
