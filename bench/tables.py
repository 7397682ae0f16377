"""The benchmarks' reporting and entry points: targets, fixed-width tables, run context, ``main``.

Owns :class:`Check` (a target and its verdict), :func:`render_table` / :func:`render_checks`, the
lines that put a run in context (machine, pinning, load average), ``--json`` output, the options
every benchmark shares (:func:`add_common_args`) and :func:`run_main`, which runs a benchmark on
uvloop with SIGTERM turned into ``SystemExit`` so its fleet is always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet import CLIENT_CPU, GATEWAY_CPU, UPSTREAM_CPU
from core import jsonx
from core.procs import ProcessError

__all__ = [
    "Check",
    "add_common_args",
    "cell",
    "load_line",
    "machine",
    "pinning_line",
    "render_checks",
    "render_table",
    "run_main",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class Check:
    """A target: passes when ``value`` is known and ``value <= limit`` (``>=`` with ``at_least``)."""

    name: str
    value: float | int | None  # int for counts
    limit: float
    unit: str = "ms"
    at_least: bool = False

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def limit_text(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.limit:g} {self.unit}".rstrip()


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Fixed-width text; numeric columns right-aligned, text columns left-aligned."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in [list(header), *cells]) for i in range(len(header))]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] in (None, "") for row in rows)
        for i in range(len(header))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "-" * max(len(line(list(header))), len(title))
    return "\n".join([title, rule, line(list(header)), rule, *map(line, cells), rule])


def render_checks(checks: Sequence[Check]) -> str:
    rows = [(c.name, c.value, c.limit_text, "PASS" if c.passed else "FAIL") for c in checks]
    return render_table("Targets", ("target", "measured", "limit", "verdict"), rows)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "affinity_client": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }


def pinning_line(pinned: bool) -> str:
    if not pinned:
        return "pinning: off (all processes float over all CPUs)"
    return (
        f"pinning (taskset): gateways → CPU {GATEWAY_CPU}; "
        f"upstream simulators → CPU {UPSTREAM_CPU}; client (this process) → CPU {CLIENT_CPU}"
    )


def load_line(label: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average at {label}: {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} CPUs)"


def write_json(path: str, obj: Any) -> None:
    Path(path).write_bytes(jsonx.dumps(obj, indent=True) + b"\n")


def add_common_args(p: argparse.ArgumentParser, *, requests: int) -> None:
    p.add_argument("--requests", type=int, default=requests, help="measured requests per arm")
    p.add_argument("--warmup", type=int, default=5, help="warm-up requests per arm (discarded)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--step-ms", type=float, default=20.0, help="upstream pacing between tokens")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="upstream time to first token")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request client timeout")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE")


def run_main(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main`` on uvloop; SIGTERM becomes SystemExit so the fleet is always stopped."""

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            return runner.run(main())
        except ProcessError as exc:  # StartupError, or a child that exited before it was ready
            print(f"benchmark setup failed: {exc}", file=sys.stderr)
            return 2
