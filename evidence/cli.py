"""``specshadow records --store PATH [--since ISO | --last 1h] [--category C] [--limit N]``.

Prints the store's comparison records as JSON lines (one record per line, oldest first), for
scripts and other tools; the schema is in docs/records.md. ``--limit N`` keeps the newest N.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

from core import jsonx
from evidence.store import query_records

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


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "records", help="print comparison records from a store as JSON lines"
    )
    p.add_argument("--store", required=True, help="the record store (SQLite file)")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--since", type=parse_time_unix_ns, default=None, help="ISO 8601 time (UTC if no zone)"
    )
    when.add_argument(
        "--last", type=parse_duration_s, default=None, help="only the last 30s / 15m / 1h / 7d"
    )
    p.add_argument("--until", type=parse_time_unix_ns, default=None, help="ISO 8601 time")
    p.add_argument("--category", default=None, help="only this category")
    p.add_argument("--limit", type=int, default=None, help="at most N records (the newest)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    since = args.since
    if args.last is not None:
        since = time.time_ns() - int(args.last * 1e9)
    try:
        out = sys.stdout.buffer
        for record in query_records(
            args.store,
            since_unix_ns=since,
            until_unix_ns=args.until,
            category=args.category,
            limit=args.limit,
        ):
            out.write(jsonx.dumps(record) + b"\n")
        out.flush()
    except FileNotFoundError:
        print(f"{args.store}: no such record store", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `specshadow records … | head` is normal use
        return 0
    return 0
