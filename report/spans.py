"""The application's own spans, where they reach the same store as the records: each trace's
first start and last end, for a run's true start and end (:mod:`report.workflows`).

The OpenTelemetry Collector's ClickHouse exporter writes spans to its traces table
(``otel_traces`` by default: ``Timestamp`` DateTime64(9), ``TraceId``, ``Duration`` in
nanoseconds, ``ServiceName``, …). The gateway's own spans are left out (``ServiceName`` the
gateway's, ``specshadow`` unless ``OTEL_SERVICE_NAME`` says otherwise): a shadow leg's span may
end after the client had its answer, which is not the application's time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from records.clickhouse import Engine

__all__ = ["TRACES_TABLE", "store_bounds", "trace_bounds"]

TRACES_TABLE = "otel_traces"
GATEWAY_SERVICE = "specshadow"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_HEX = re.compile(r"[0-9a-f]{32}")
BATCH = 1000  # trace ids per query


def trace_bounds(
    engine: Engine,
    trace_ids: Iterable[str],
    *,
    table: str = TRACES_TABLE,
    gateway_service: str = GATEWAY_SERVICE,
) -> dict[str, tuple[int, int]]:
    """Trace id → (first span start, last span end) in unix ns, for the ``trace_ids`` the table
    holds spans of (other than the gateway's). ``{}`` when the engine has no such table."""
    if not _NAME.fullmatch(table):
        raise ValueError(f"not a table name: {table!r}")
    if table.encode() not in engine.execute("SHOW TABLES").split():
        return {}
    ids = sorted({t for t in trace_ids if _HEX.fullmatch(t)})
    service = gateway_service.replace("\\", "\\\\").replace("'", "\\'")
    out: dict[str, tuple[int, int]] = {}
    for i in range(0, len(ids), BATCH):
        wanted = ", ".join(f"'{t}'" for t in ids[i : i + BATCH])
        sql = (
            "SELECT lower(TraceId), min(toUnixTimestamp64Nano(Timestamp)), "
            "max(toUnixTimestamp64Nano(Timestamp) + toInt64(Duration)) "
            f"FROM {table} WHERE lower(TraceId) IN ({wanted}) AND ServiceName != '{service}' "
            "GROUP BY lower(TraceId) FORMAT TabSeparated"
        )
        for line in engine.execute(sql).decode().splitlines():
            tid, start, end = line.split("\t")
            out[tid] = (int(start), int(end))
    return out


def store_bounds(sources: Sequence[str], trace_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
    """:func:`trace_bounds` from the one ``chdb:///`` or ``clickhouse://`` store among
    ``sources`` (the Collector writing its traces beside the records); ``{}`` for any other
    sources, or when the store holds no traces table."""
    from records.stores import is_url, open_column_store, parse_store

    one = str(sources[0]) if len(sources) == 1 else ""
    if not (one and is_url(one) and parse_store(one).kind in ("chdb", "clickhouse")):
        return {}
    store = open_column_store(one, migrate=False)
    try:
        return trace_bounds(store.engine, trace_ids)
    finally:
        store.close()
