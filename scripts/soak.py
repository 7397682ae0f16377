#!/usr/bin/env python3
"""Soak the gateway for N minutes and print how its resources move over time.

Mixed traffic (streaming and not, every request mirrored, a share to shadows that hang, answer
500, reset, send malformed SSE or refuse; some clients leave mid-stream) against a gateway
subprocess, sampling its RSS, open descriptors and — from ``GET /admin/shadow`` — shadow legs in
flight, primary requests in flight and live background tasks. The engine is
``tests/reliability/soak.py``; a 20 s version runs in CI (``tests/reliability/test_soak.py``).

    .venv/bin/python scripts/soak.py --minutes 10 --concurrency 16 [--json out.json]

Exit status 1 when something leaked: primary errors, legs or tasks still live after the drain,
or RSS still climbing at steady state (slope over the second half above ``--max-slope-mib``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the engine lives in the tests package

from tests.reliability.soak import Sample, SoakConfig, dumps, run_soak  # noqa: E402

HEADER = f"{'t_s':>8} {'requests':>9} {'req/s':>7} {'rss_MiB':>8} {'fds':>5} {'sockets':>8} {'legs':>5} {'primary':>8} {'tasks':>6}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--max-slope-mib", type=float, default=1.0, help="MiB/min allowed at the end")
    p.add_argument("--json", type=Path, default=None, help="write the summary here too")
    args = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=args.minutes * 60.0,
        concurrency=args.concurrency,
        sample_every_s=args.sample_every,
    )
    last: list[Sample] = []

    def show(sample: Sample) -> None:
        dt = sample.t_s - last[-1].t_s if last else 0.0
        rate = (sample.requests - last[-1].requests) / dt if last and dt > 0 else 0.0
        last.append(sample)
        print(
            f"{sample.t_s:8.1f} {sample.requests:9d} {rate:7.1f} {sample.rss_kib / 1024:8.1f}"
            f" {sample.fds:5d} {sample.sockets:8d} {sample.in_flight:5d}"
            f" {sample.primary_in_flight:8d} {sample.tasks:6d}",
            flush=True,
        )

    print(f"soak: {args.minutes} min, {args.concurrency} concurrent clients", flush=True)
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run_soak(cfg, Path(tmp), on_sample=show))
    summary = result.to_json()
    slope = result.rss_slope_kib_per_min()
    warm, final = result.warm, result.final
    assert warm is not None
    assert final is not None
    print()
    print(f"requests: {result.requests}  outcomes: {dict(result.outcomes)}")
    print(
        f"RSS: {warm.rss_kib / 1024:.1f} MiB after warm-up → {final.rss_kib / 1024:.1f} MiB at the end;"
        f" slope over the second half: {'n/a' if slope is None else f'{slope / 1024:.2f} MiB/min'}"
    )
    print(
        f"fds: {warm.fds} → {final.fds} (sockets {warm.sockets} → {final.sockets});"
        f" peak {summary['peak_fds']}; connections open after the drain:"
        f" {result.held_at_drain}, of which still open 2 keep-alives later: {result.still_open}"
    )
    print(
        f"after the drain: legs in flight {final.in_flight}, primary {final.primary_in_flight},"
        f" tasks {final.tasks} (peak {summary['peak_tasks']})"
    )
    if args.json is not None:
        args.json.write_text(dumps(result))
    leaks = []
    if result.errors:
        leaks.append(f"{len(result.errors)} primary errors, e.g. {result.errors[0]}")
    if final.in_flight or final.primary_in_flight or final.tasks > 1:
        leaks.append("work still in flight after the drain")
    if result.still_open:
        leaks.append(f"{result.still_open} connections never closed after the drain")
    if slope is not None and slope / 1024 > args.max_slope_mib:
        leaks.append(f"RSS still growing: {slope / 1024:.2f} MiB/min")
    for leak in leaks:
        print(f"LEAK: {leak}")
    print("verdict:", "FAIL" if leaks else "ok")
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
