"""``specshadow records --store S [--store S …] [--since ISO | --last 1h] [--category C] [--limit N]``
and ``specshadow records copy --from S --to S2 [--since ISO] [--until ISO]`` and
``specshadow records sql [--table T] [--otel-logs TABLE]`` and ``specshadow records export --store S
--format speculators|conversations --out FILE [--category C] [--since/--until]
[--min-acceptance X] [--max-acceptance X] [--engine-ids-only] [--redact module:function]``.

The first prints the stores' comparison records as JSON lines (one record per line, oldest
first), for scripts and other tools; the schema is in docs/records.md. ``--limit N`` keeps the
newest N. The second moves records between any two stores (SQLite, chDB, ClickHouse; records
JSONL and collector files as sources), streamed in batches. ``export`` writes drafter training
rows from the records' token ids or captured text (:mod:`records.export`). The ``sql`` action prints the ClickHouse DDL
of the wide table and of the view that fills it from the Collector's ClickHouse exporter. A store
is a path or a URL (:mod:`records.stores`).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core import jsonx
from core.faults import Fault
from records.clickhouse import ClickHouseError
from records.export import FORMATS, LabellerFactory
from records.readback import JSON_SUFFIXES, SourceError, read_records
from records.sqlite_store import query_records
from records.stores import copy_records, is_url, parse_store

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """``90s``, ``15m``, ``1h``, ``7d`` → seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 15m, 1h or 7d: {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_time_unix_ns(text: str) -> int:
    """An ISO 8601 time (``2024-05-01T12:00:00Z``; naive means UTC) → unix ns."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 time: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1e9)


STORE_HELP = (
    "a record store: a SQLite path, clickhouse://host:port/db (a ClickHouse server) or "
    "chdb:///dir (ClickHouse embedded)"
)


def add_store_argument(
    parser: argparse.ArgumentParser, *, read: bool = True, required: bool = False
) -> None:
    """The one ``--store`` of every command, described the same way everywhere.

    ``read`` (``records``, ``report``, …): repeatable — one per gateway replica, deduplicated by
    exchange id — and records JSONL or a collector's OTLP JSON file are read too; ``args.store``
    is a list. Otherwise (``serve``): the one store records are written to, ``args.store`` a
    string or None.
    """
    if read:
        parser.add_argument(
            "--store",
            action="append",
            default=None if required else [],
            required=required,
            metavar="STORE",
            help=f"{STORE_HELP}; also records JSONL or a collector's OTLP JSON file. Repeatable "
            "(one per gateway replica): records are deduplicated by exchange id",
        )
    else:
        parser.add_argument(
            "--store",
            default=None,
            metavar="STORE",
            help=f"{STORE_HELP}, where comparison records are written (default: none kept)",
        )


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """``--since ISO`` or ``--last DURATION`` (one of them), and ``--until ISO``: the window of
    exchanges a command reads; :func:`window_since` turns ``--last`` into a start time."""
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--since",
        type=parse_time_unix_ns,
        default=None,
        metavar="ISO",
        help="only exchanges that started at or after this ISO 8601 time (UTC if no zone)",
    )
    when.add_argument(
        "--last",
        type=parse_duration_s,
        default=None,
        metavar="DURATION",
        help="only exchanges of the last 30s / 15m / 1h / 7d",
    )
    parser.add_argument(
        "--until",
        type=parse_time_unix_ns,
        default=None,
        metavar="ISO",
        help="only exchanges that started before this ISO 8601 time",
    )


def window_since(args: argparse.Namespace, now_ns: int | None = None) -> int | None:
    """The window's start in unix ns: ``--since``, or ``--last`` back from now; None: no start."""
    if getattr(args, "last", None) is not None:
        return (time.time_ns() if now_ns is None else now_ns) - int(args.last * 1e9)
    since: int | None = args.since
    return since


def register(subparsers: Any, labels: LabellerFactory | None = None) -> None:
    """``labels``: builds the export's labeller from its flags (the console script passes the
    counterfactual replay's, which this package cannot import); without it exported rows carry
    no acceptance labels and the acceptance filters are refused."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "records", help="print comparison records from a store as JSON lines"
    )
    add_store_argument(p)
    add_window_arguments(p)
    p.add_argument("--category", default=None, help="only this category")
    p.add_argument("--limit", type=int, default=None, help="at most N records (the newest)")
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="action", metavar="{copy,sql,export}")
    c: argparse.ArgumentParser = actions.add_parser(
        "copy", help="copy records from one store (or records/collector files) into another"
    )
    c.add_argument("--from", dest="source", required=True, metavar="STORE")
    c.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="STORE",
        help="where to: a SQLite path (.sqlite, .db), JSON Lines (.jsonl) or a store URL; "
        "exchanges it holds already are skipped",
    )
    add_window_arguments(c)
    shared(c)
    c.set_defaults(func=run_copy)
    q: argparse.ArgumentParser = actions.add_parser(
        "sql",
        help="print the ClickHouse DDL: the wide records table and, with --otel-logs, the "
        "materialized view that fills it from the Collector's ClickHouse exporter",
    )
    q.add_argument("--table", default="specshadow.records", help="the wide table to create")
    q.add_argument(
        "--otel-logs",
        default=None,
        metavar="TABLE",
        help="the exporter's logs table (e.g. otel.otel_logs): also print the view",
    )
    q.add_argument("--retention-days", type=float, default=30.0)
    q.set_defaults(func=run_sql)
    e: argparse.ArgumentParser = actions.add_parser(
        "export",
        help="write drafter training data (speculators' pre-tokenised rows or conversations) "
        "from the records' own token ids or captured text",
    )
    add_store_argument(e)
    add_window_arguments(e)
    shared(e)
    e.add_argument("--format", choices=FORMATS, required=True, help="the rows' shape")
    e.add_argument("--out", required=True, metavar="FILE", help="the JSON lines file to write")
    e.add_argument("--category", default=None, help="only this category")
    e.add_argument(
        "--min-acceptance",
        type=_rate,
        default=None,
        metavar="X",
        help="only rows whose labelled draft acceptance rate (0-1) is at least X",
    )
    e.add_argument(
        "--max-acceptance",
        type=_rate,
        default=None,
        metavar="X",
        help="only rows whose labelled draft acceptance rate (0-1) is at most X: where drafts fail",
    )
    e.add_argument(
        "--engine-ids-only",
        action="store_true",
        help="speculators: skip records whose output ids are re-tokenized text rather than the "
        "ids the engine generated (tokens.output_source)",
    )
    e.add_argument(
        "--acceptance-config",
        default=None,
        metavar="CONFIG",
        help="the configuration each row's acceptance is replayed with: ngram:K:MIN-MAX or "
        "draft:BACKEND:K (default ngram:4:2-4)",
    )
    e.add_argument(
        "--token-texts",
        default=None,
        metavar="FILE",
        help="token id -> text (a Hugging Face tokenizer.json or a JSON {id: text} map): label "
        "each row with the classes of the tokens its drafts were rejected at",
    )
    e.add_argument(
        "--tokenizer",
        default=None,
        metavar="URL",
        help="instead of --token-texts: a server whose POST /detokenize gives each token's text "
        "(never the primary)",
    )
    e.add_argument(
        "--drafter-vocabulary",
        default=None,
        metavar="FILE",
        help="a drafter's vocabulary (EAGLE-3 d2t, or a JSON list of target ids): label each "
        "row with its output tokens outside it (rejections by construction)",
    )
    e.add_argument(
        "--redact",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function applied to every row last: it returns the row (changed or not), or "
        "None to drop it",
    )
    e.set_defaults(func=run_export, labels=labels)


SHARED = ("store", "since", "last", "until")


def shared(subparser: argparse.ArgumentParser) -> None:
    """The options ``records`` and its subcommand share (``--store``, the window) are read
    before and after the subcommand's name alike: without a default of its own, the subcommand
    keeps what was given before it (argparse would otherwise overwrite it with its default)."""
    for action in subparser._actions:
        if action.dest in SHARED:
            action.default = argparse.SUPPRESS


def run_sql(args: argparse.Namespace) -> int:
    from records import wide

    out = [wide.create_table(args.table, ttl_days=args.retention_days, server_ttl=True) + ";"]
    if args.otel_logs:
        view = f"{args.table}_from_otel"
        out.append(wide.otel_view(args.table, args.otel_logs, view) + ";")
    print("\n\n".join(out))
    return 0


def run_copy(args: argparse.Namespace) -> int:
    # A store that is not one, a destination named for no format we write: BadInput, worded
    # once by the console script. A ClickHouse server that fails mid-copy is not the user's input.
    try:
        n = copy_records(
            args.source, args.target, since_unix_ns=window_since(args), until_unix_ns=args.until
        )
    except ClickHouseError as exc:
        print(f"specshadow records copy: {exc}", file=sys.stderr)
        return 1
    print(
        f"copied {n} new records to {parse_store(args.target).label()} "
        "(exchanges it held already are not added twice)",
        file=sys.stderr,
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.store:
        print(
            "specshadow records: give --store (or: records copy --from S --to S2)", file=sys.stderr
        )
        return 2
    since = window_since(args)
    try:  # a bad store is BadInput and a closed pipe normal use: the console script words both
        if (
            len(args.store) == 1
            and not is_url(args.store[0])
            and Path(args.store[0]).suffix not in JSON_SUFFIXES
        ):
            # One store: the filters run as SQL, on its indexes.
            records: Iterable[dict[str, Any]] = query_records(
                args.store[0],
                since_unix_ns=since,
                until_unix_ns=args.until,
                category=args.category,
                limit=args.limit,
            )
        else:
            # The window is applied where the records are read (in each store's engine).
            records = select(
                read_records(args.store, since_unix_ns=since, until_unix_ns=args.until),
                args.category,
                args.limit,
            )
        out = sys.stdout.buffer
        for record in records:
            out.write(jsonx.dumps(record) + b"\n")
        out.flush()
    except FileNotFoundError as exc:
        raise SourceError(f"{exc.filename or exc}: no such record store") from None
    return 0


def select(
    records: list[dict[str, Any]], category: str | None, limit: int | None
) -> list[dict[str, Any]]:
    """``query_records``'s category and limit, over records in memory (already windowed)."""
    chosen = [r for r in records if category is None or r.get("category") == category]
    return chosen[-limit:] if limit is not None else chosen


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected an acceptance rate in 0..1: {text!r}")
    return value


def run_export(args: argparse.Namespace) -> int:
    from records.export import (
        ExportCounts,
        ExportFilter,
        LabelOptions,
        RedactError,
        export_rows,
        load_redactor,
        write_rows,
    )
    from records.readback import iter_records

    if not args.store:
        print("specshadow records export: give --store", file=sys.stderr)
        return 2
    where = ExportFilter(
        args.category, args.min_acceptance, args.max_acceptance, args.engine_ids_only
    )
    try:
        options = LabelOptions(
            args.acceptance_config, args.token_texts, args.tokenizer, args.drafter_vocabulary
        )
        labeller = args.labels(options) if args.labels is not None else None
        redact = load_redactor(args.redact) if args.redact else None
    except (ValueError, RedactError, OSError) as exc:
        print(f"specshadow records export: {exc}", file=sys.stderr)
        return 2
    if labeller is None and (where.on_acceptance or args.token_texts or args.tokenizer):
        print(
            "specshadow records export: no labeller here (acceptance, rejections)", file=sys.stderr
        )
        return 2
    counts = ExportCounts()
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    try:
        records = iter_records(
            args.store, since_unix_ns=window_since(args), until_unix_ns=args.until
        )
        with partial.open("wb") as f:
            write_rows(
                export_rows(
                    records, args.format, where=where, labeller=labeller, redact=redact,
                    counts=counts,
                ),
                f,
            )  # fmt: skip
        partial.replace(out)
    except Fault:  # a bad store: worded once, by the console script
        partial.unlink(missing_ok=True)
        raise
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        print(f"specshadow records export: {exc}", file=sys.stderr)
        return 1
    skipped = {k: v for k, v in counts.as_json().items() if k not in ("read", "written") and v}
    why = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in skipped.items()) or "none"
    print(
        f"wrote {counts.written} {args.format} rows of {counts.read} records to {out}; "
        f"skipped: {why}",
        file=sys.stderr,
    )
    return 0
