"""``specshadow report --store S --out DIR [--results FILE] [--since T | --last D] [--until T]
[--sample N] [--state FILE]``: build the adoption report (memory bounded: :mod:`report.population`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.extras import require
from core.faults import BadInput, NothingToDo
from records.cli import add_store_argument, add_window_arguments, window_since

__all__ = ["register"]

SAMPLE = 5000  # report.aggregates.SAMPLE (not imported: registering the command stays cheap)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _run(args: argparse.Namespace) -> int:
    require("report", command="report")
    # Imported here: numpy and matplotlib load only when a report is built, not for every command.
    from records.readback import SourceError
    from records.stores import StoreURLError
    from report import build_report
    from report.gather import gather
    from report.inputs import read_results

    if not args.store and not args.results:
        print("specshadow report: give --store and/or --results", file=sys.stderr)
        return 2
    try:
        population, records = (
            gather(
                args.store,
                since_unix_ns=window_since(args),
                until_unix_ns=args.until,
                sample=args.sample,
            )
            if args.store
            else (None, [])
        )
        results = [r for path in args.results for r in read_results(path)]
    except (SourceError, StoreURLError):
        raise  # a bad store: worded once, by the console script (BadInput, exit 2)
    except (OSError, ValueError) as exc:
        print(f"specshadow report: {exc}", file=sys.stderr)
        return 2
    if args.store and not records:
        raise NothingToDo(
            f"0 records in {', '.join(args.store)} ({window_text(args)}): nothing to report on; "
            "widen the window, or check that serve --store wrote there"
        )
    # Read before anything is written: a --state that names nothing is refused, not ignored.
    transitions = args.read_state(args.state) if args.state else []
    margins, alpha = None, None
    if args.policy:
        from policies.compile import load_policy
        from policies.errors import PolicyError

        try:
            quality = load_policy(args.policy).quality
        except (OSError, PolicyError) as exc:
            print(f"specshadow report: {exc}", file=sys.stderr)
            return 2
        margins, alpha = quality.margins, quality.alpha
    sources = [f"store {path}" for path in args.store] + [f"results {p}" for p in args.results]
    from counterfactual.cli import token_texts
    from records.reader import read

    # Token texts for the counterfactual section's rejection classes: the tokenizer server's
    # /detokenize, while it still answers (else the section counts rejections by position only).
    texts = (
        token_texts(lambda: iter(records), None, None)[0]
        if any(read(r).tokens is not None for r in records)
        else None
    )
    # The application's own spans, where the Collector writes them beside the records.
    from records.clickhouse import ClickHouseError
    from report.spans import store_bounds

    try:
        spans = store_bounds(
            args.store, {w.trace_id for r in records if (w := read(r).workflow) and w.trace_id}
        )
    except (OSError, StoreURLError, ClickHouseError) as exc:
        print(f"specshadow report: no application spans: {exc}", file=sys.stderr)
        spans = {}
    paths = build_report(
        records,
        results,
        args.out,
        sources=sources,
        margins=margins,
        alpha=alpha,
        population=population,
        transitions=transitions,
        token_texts=texts,
        spans=spans,
    )
    a = paths.analysis
    from report.front import terminal

    for line in terminal(a):  # the first screen: rollbacks, failing candidates, the fix first
        print(line)
    indent = "  " if a.several else ""
    for c in a.candidates.values():
        if a.several:
            print(f"{c.label} ({c.backend}):")
        for v in c.verdicts:
            print(f"{indent}{v.category:<20} {v.decision}")
    for cat, r in a.recommendations.items():
        pick = a.candidates[r.backend].label if r.backend is not None else "none"
        print(f"recommended for {cat}: {pick}")
    print(f"report: {paths.html}\nsummary: {paths.markdown}")
    for name, path in paths.rollout.items():
        print(f"{name}: {path}")
    return 0


def window_text(args: argparse.Namespace) -> str:
    """The window ``--since``/``--last``/``--until`` chose, in words: ``window 2026-01-01 12:00
    UTC to now``, or ``window: all time``."""
    since, until = window_since(args), args.until
    if since is None and until is None:
        return "window: all time"

    def at(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    return (
        f"window {at(since) if since is not None else 'the first record'} to "
        f"{at(until) if until is not None else 'now'}"
    )


def _state_file(text: str) -> list[dict[str, Any]]:
    """``--state`` without the console script's reader (this package alone): the JSON file
    only; one that does not exist is refused."""
    from report.rollbacks import load_transitions

    if not Path(text).is_file():
        raise BadInput(f"--state {text}: no such rollout state file")
    return load_transitions(text)


StateReader = Callable[[str], list[dict[str, Any]]]


def register(subparsers: Any, read_state: StateReader | None = None) -> None:
    """Add ``report`` to the ``specshadow`` parser. ``read_state``: the rollout transitions a
    ``--state`` holds, every kind ``serve --state`` writes (the console script passes
    :func:`rollout.store.read_transitions`, which this package does not import); without it,
    only the JSON file is read."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="build the adoption report (HTML + Markdown) from records and/or matrix results",
    )
    add_store_argument(p)
    add_window_arguments(p)
    p.add_argument(
        "--results", action="append", default=[], help="loadgen/matrix results JSONL (repeatable)"
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--sample",
        type=_positive,
        default=SAMPLE,
        metavar="N",
        help="exchanges the detail sections (latency, quality, examples, rollout) read at most; "
        "the verdict's load-true speed-ups count every exchange, summed where the records are "
        f"(default {SAMPLE})",
    )
    p.add_argument(
        "--state",
        metavar="STATE",
        default=None,
        help="the gateway's rollout state (serve --state: the JSON file, sqlite:///PATH or "
        "clickhouse://HOST:PORT/DB): who rolled a candidate back inside the window, when, and "
        "why (default: the records' rollout stages only)",
    )
    p.add_argument(
        "--policy",
        metavar="FILE",
        help="the gateway's policy file: its quality section's margins and alpha judge "
        "equivalence (default: the built-in margins, docs/quality.md)",
    )
    p.set_defaults(func=_run, read_state=read_state or _state_file)
