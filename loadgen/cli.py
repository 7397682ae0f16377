"""``specshadow loadgen`` (replay a trace against one endpoint) and ``specshadow matrix`` (sweep a
benchmark matrix); both print a summary table and write machine-readable results."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from core.extras import require
from loadgen.progress import Progress
from loadgen.results import (
    SloError,
    format_summary,
    parse_slo,
    summarize,
    write_results,
    write_summary,
)
from loadgen.runner import run_loadgen
from loadgen.schedule import ScheduleError
from loadgen.trace import TraceError, bundled_trace, read_trace

__all__ = ["register"]


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _slo(text: str) -> tuple[str, float]:
    try:
        return parse_slo(text)
    except SloError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_loadgen(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "loadgen",
        help="replay a trace against an OpenAI-compatible endpoint and measure it",
        description=(
            "Replay a JSONL trace of OpenAI request bodies (closed loop at --concurrency, "
            "Poisson --rate, or the trace's own --replay-timing) and measure every request with "
            "the gateway's recorder. Open-loop modes measure from the scheduled send time."
        ),
    )
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1 (as the OpenAI SDK takes it)")
    p.add_argument("--trace", help="JSONL trace (default: the bundled demo trace)")
    p.add_argument("--matrix", metavar="FILE", help="run a benchmark matrix file instead")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight (closed loop; cap in open loop)",
    )
    p.add_argument(
        "--max-requests", type=int, default=None, help="measured requests (default: one pass)"
    )
    p.add_argument(
        "--duration", type=float, default=None, metavar="S", help="stop sending after S seconds"
    )
    p.add_argument(
        "--rate", type=float, default=None, metavar="R", help="open loop: R requests/s (Poisson)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)"
    )
    p.add_argument("--replay-timing", action="store_true", help="open loop: the trace's timestamps")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply trace time gaps (0.5 = 2× faster)"
    )
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests before measuring")
    p.add_argument("--model", default=None, help="override the trace's model name")
    p.add_argument("--max-tokens", type=int, default=None, help="override max_tokens")
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream with stream_options.include_usage (default) or not",
    )
    p.add_argument("--header", type=_header, action="append", default=[], metavar="NAME:VALUE")
    p.add_argument(
        "--category-header",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the trace category as x-specshadow-category (default on)",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        action="append",
        default=[],
        metavar="NAME=LIMIT",
        help="goodput SLO, e.g. ttft_s=0.5 (repeatable)",
    )
    p.add_argument("--seed", type=int, default=0, help="arrival-process seed")
    p.add_argument("--timeout", type=float, default=600.0, help="idle read timeout per request (s)")
    p.add_argument("--out", default=None, help="per-request results (JSONL)")
    p.add_argument("--summary", default=None, help="machine-readable summary (JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=_run_loadgen)  # fmt: skip


def _run_loadgen(args: argparse.Namespace) -> int:
    if args.matrix:
        return run_matrix_file(args.matrix, out=args.out, progress=not args.no_progress)
    if not args.base_url:
        print("specshadow loadgen: --base-url is required (or --matrix FILE)", file=sys.stderr)
        return 2
    try:
        records = read_trace(args.trace) if args.trace else bundled_trace()
    except (TraceError, OSError) as exc:
        print(f"specshadow loadgen: {exc}", file=sys.stderr)
        return 2
    total = (
        args.max_requests
        if args.max_requests is not None
        else (None if args.duration else len(records) - min(args.warmup, len(records)))
    )
    progress = None if args.no_progress else Progress(total)
    started = time.perf_counter()
    try:
        results = asyncio.run(
            run_loadgen(
                args.base_url,
                records,
                concurrency=args.concurrency,
                max_requests=args.max_requests,
                rate_rps=args.rate,
                burstiness=args.burstiness,
                replay_timing=args.replay_timing,
                time_scale=args.time_scale,
                warmup=args.warmup,
                duration_s=args.duration,
                model=args.model,
                max_tokens=args.max_tokens,
                stream=args.stream,
                headers=dict(args.header),
                category_header=args.category_header,
                seed=args.seed,
                request_timeout_s=args.timeout,
                progress=progress,
            )
        )
    except ScheduleError as exc:
        print(f"specshadow loadgen: {exc}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.close()
    wall_s = time.perf_counter() - started
    run = {
        "base_url": args.base_url,
        "trace": args.trace or "bundled:demo_trace.jsonl",
        "mode": "trace" if args.replay_timing else ("rate" if args.rate else "concurrency"),
        "concurrency": args.concurrency,
        "rate_rps": args.rate,
        "burstiness": args.burstiness,
        "time_scale": args.time_scale,
        "warmup": args.warmup,
        "stream": args.stream,
    }
    summary = summarize(results, slos=dict(args.slo), wall_s=wall_s, run=run)
    if args.out:
        write_results(args.out, results)
    if args.summary:
        write_summary(args.summary, summary)
    print(format_summary(summary))
    return 0 if summary["overall"]["succeeded"] else 1


def _add_matrix(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "matrix",
        help="sweep output length × concurrency × backend configuration; write one results table",
    )
    p.add_argument("file", help="matrix YAML file")
    p.add_argument("--out", default=None, help="results table (JSONL; default from the file)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run_matrix)


def _run_matrix(args: argparse.Namespace) -> int:
    require("loadgen", command="matrix")
    return run_matrix_file(args.file, out=args.out, progress=not args.no_progress)


def run_matrix_file(path: str | Path, *, out: str | None = None, progress: bool = True) -> int:
    """``specshadow matrix FILE``: run, write the table, print it and the stable region."""
    # Imported here: numpy (paired bootstrap) loads only for matrix runs.
    from loadgen.matrix import (
        MatrixError,
        format_table,
        load_matrix,
        run_matrix,
        stable_regions,
        write_table,
    )

    try:
        config = load_matrix(path)
        base = Path(path).resolve().parent
        records = read_trace(base / config.trace) if config.trace else bundled_trace()
    except (MatrixError, ValueError, OSError) as exc:
        print(f"specshadow matrix: {exc}", file=sys.stderr)
        return 2
    target = Path(out) if out else (base / (config.out or "matrix_results.jsonl"))
    try:
        rows = asyncio.run(run_matrix(config, records, progress=progress))
    except MatrixError as exc:
        print(f"specshadow matrix: {exc}", file=sys.stderr)
        return 1
    write_table(target, rows)
    print(format_table(rows))
    regions = stable_regions(rows)
    print("\nstable operating region:" if regions else "\nno stable operating region found")
    for line in regions:
        print(f"  {line}")
    print(f"\nresults table: {target}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``loadgen`` and ``matrix`` to the ``specshadow`` parser."""
    _add_loadgen(subparsers)
    _add_matrix(subparsers)
