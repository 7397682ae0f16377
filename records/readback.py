"""Reading comparison records back: from several stores and files at once, deduplicated.

A fleet of N gateway replicas keeps N embedded stores, or exports every record as an OTLP log
record to a collector. :func:`read_records` takes any mix of:

- a record store by path or URL (:mod:`records.stores`): SQLite, ``chdb:///dir``,
  ``clickhouse://host:port/db``;
- a JSON Lines file of records (what ``specshadow records`` prints), or a folder of them;
- a JSON Lines file the OpenTelemetry Collector's ``file`` exporter wrote (``format: json``): one
  OTLP/JSON ``{"resourceLogs": [...]}`` object per line, records as the ``specshadow.record`` log
  records' bodies (a folder of ``*.json``/``*.jsonl`` files — the exporter's rotated files — too).

Records are deduplicated by ``exchange_id`` (the same exchange can arrive twice: an OTLP client
that got no acknowledgement resends, a store and its log export can both be read) and returned in
one canonical order — by start time, then exchange id — so a report over the union of several
stores is the report over one store that holds the same exchanges.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from core import jsonx
from core.faults import BadInput
from records.rules import canonical_key
from records.sqlite_store import StoreFileError, query_records
from records.stores import StoreURLError, is_url, parse_store, read_store

RECORD_EVENT = "specshadow.record"  # the event name of a record's log record (otel.semconv)
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


class SourceError(BadInput, ValueError):
    """A source that is not a store, a records file or a collector file (message names it)."""


def read_records(
    sources: Sequence[str | Path],
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
) -> list[dict[str, Any]]:
    """Every record in ``sources`` (in the window), deduplicated by exchange id, oldest first."""
    seen: dict[str, dict[str, Any]] = {}
    for source in sources:
        for record in records_in(source, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns):
            exchange_id = str(record.get("exchange_id", ""))
            if exchange_id and exchange_id not in seen:
                seen[exchange_id] = record
    return sorted(seen.values(), key=canonical_key)


def iter_records(
    sources: Sequence[str | Path],
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    exchange_ids: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every record in ``sources``, deduplicated by exchange id, streamed in source order.

    Holds only the exchange ids seen, not the records: for aggregates over large stores, where
    :func:`read_records`'s canonical order is not needed. ``exchange_ids`` keeps only those
    exchanges — the same record of each as an unfiltered pass yields.
    """
    seen: set[str] = set()
    for source in sources:
        for record in records_in(
            source,
            since_unix_ns=since_unix_ns,
            until_unix_ns=until_unix_ns,
            exchange_ids=exchange_ids,
        ):
            exchange_id = str(record.get("exchange_id", ""))
            if exchange_id and exchange_id not in seen:
                seen.add(exchange_id)
                yield record


def records_in(
    source: str | Path,
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    exchange_ids: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The records of one source in the window ``[since, until)``, as stored (not deduplicated);
    only ``exchange_ids``' when given.

    SQLite stores filter in their engine; files and column stores as they are read.
    """
    wanted = None if exchange_ids is None else frozenset(exchange_ids)

    def kept(record: Mapping[str, Any]) -> bool:
        return wanted is None or str(record.get("exchange_id", "")) in wanted

    if isinstance(source, str) and is_url(source) and not source.startswith("sqlite://"):
        try:
            for record in read_store(
                source, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns
            ):
                if kept(record):
                    yield record
        except FileNotFoundError as exc:
            raise SourceError(f"{source}: no such store") from exc
        except StoreURLError as exc:
            raise SourceError(str(exc)) from exc
        return
    path = Path(parse_store(str(source)).path)
    if path.is_dir() or path.suffix in JSON_SUFFIXES:
        if not path.exists():
            raise SourceError(f"{path}: no such store or file")
        for record in _files(path):
            t = record.get("started_unix_ns")
            t = t if isinstance(t, int) else 0
            if (
                (since_unix_ns is None or t >= since_unix_ns)
                and (until_unix_ns is None or t < until_unix_ns)
                and kept(record)
            ):
                yield record
        return
    if not path.exists():
        raise SourceError(f"{path}: no such store or file")
    try:
        yield from query_records(
            path, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, exchange_ids=wanted
        )
    except StoreFileError as exc:
        raise SourceError(str(exc)) from exc
    except sqlite3.DatabaseError as exc:
        raise SourceError(f"{path}: not a record store ({exc}), nor a .jsonl file") from exc


def _files(path: Path) -> Iterator[dict[str, Any]]:
    if path.is_dir():
        for child in sorted(p for p in path.iterdir() if p.suffix in JSON_SUFFIXES):
            yield from _json_lines(child)
    else:
        yield from _json_lines(path)


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for obj in jsonx.json_lines(
            f, invalid=lambda n, e: SourceError(f"{path}:{n}: invalid JSON: {e}")
        ):
            if not isinstance(obj, dict):
                continue
            if "resourceLogs" in obj:
                yield from otlp_records(obj)
            elif "exchange_id" in obj:
                yield obj


def otlp_records(export: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The records carried by one OTLP/JSON logs object (``{"resourceLogs": [...]}``).

    Every level is optional (pdata omits empty fields); a log record is a specshadow record when
    its event name (or, from collectors that predate ``eventName``, its body's schema) says so.
    """
    for resource_logs in _list(export.get("resourceLogs")):
        for scope_logs in _list(resource_logs.get("scopeLogs")):
            for log_record in _list(scope_logs.get("logRecords")):
                record = _record_of(log_record)
                if record is not None:
                    yield record


def _record_of(log_record: Mapping[str, Any]) -> dict[str, Any] | None:
    event = log_record.get("eventName")
    body = log_record.get("body")
    text = body.get("stringValue") if isinstance(body, Mapping) else None
    if not isinstance(text, str) or event not in (RECORD_EVENT, None, ""):
        return None
    try:
        record = jsonx.loads(text)
    except jsonx.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not str(record.get("schema", "")).startswith(
        "specshadow.record/"
    ):
        return None
    return record


def _list(value: object) -> Iterable[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
