"""Throughput against the number of gateway workers: ``serve --workers 1`` vs ``--workers 2``,
beside the raw relay, non-streaming, closed loop.

``python -m bench.workers [--rounds 5] [--segment-s 3] [--concurrency 32] [--json FILE]``

One fast simulator (16-token answers, no delays) is the upstream of every arm. Each round gives
every arm one segment (the arm that goes first rotates with the round, so a shared machine's
drifts fall on all arms alike); within a segment ``concurrency`` clients each send a request,
read the answer and send the next, each on its own keep-alive connection (so the kernel spreads
them over the workers' sockets). Measured per arm and round: completed requests per second and
the CPU seconds of all the arm's processes (the parent and its workers). The verdict is the
median over rounds of (2 workers ÷ 1 worker) requests/s. Nothing is pinned: two workers need
two cores, and the client and the simulator share them — on a 2-core machine the ratio is capped
well below 2 by the client and the upstream, which is what this measures honestly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.client import Arm
from bench.fleet import Fleet, simulator_args
from bench.procstat import cpu_s
from bench.tables import run_main
from bench.throughput import _segment, nonstream_body
from core import jsonx

ARMS = ("relay", "workers-1", "workers-2")


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    requests: int
    errors: int
    rps: float  # over all its segments
    rps_by_round: tuple[float, ...]
    cpu_us_per_request: float  # every process of the arm
    cores_busy: float  # the arm's CPU seconds / wall seconds of its segments
    latency_p50_ms: float
    latency_p99_ms: float


def _cpu(fleet: Fleet, name: str) -> float:
    total = 0.0
    for pid in fleet.procs[name].process_ids():
        try:
            total += cpu_s(pid)
        except (OSError, ValueError):  # a worker exited between the listing and the read
            continue
    return total


def _quantile(values: Sequence[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


async def measure(rounds: int, segment_s: float, concurrency: int) -> list[ArmResult]:
    state = tempfile.mkdtemp(prefix="specshadow-bench-state-")
    with Fleet(pin=False) as fleet:
        upstream = await fleet.simulator(
            "upstream", simulator_args(mode="plain", prefill_ms=0, step_ms=0, tokens=16)
        )
        urls = {"relay": await fleet.relay("relay", upstream)}
        for n in (1, 2):
            urls[f"workers-{n}"] = await fleet.gateway(
                f"workers-{n}",
                ["--primary", upstream, "--primary-kind", "sim", "--workers", str(n)],
                env={"XDG_STATE_HOME": os.path.join(state, str(n))},
            )
        arms = [Arm(name, urls[name] + "/v1/chat/completions") for name in ARMS]
        body = nonstream_body(16)
        lat: dict[str, list[int]] = {a.name: [] for a in arms}
        errs = dict.fromkeys(lat, 0)
        wall = dict.fromkeys(lat, 0.0)
        cpu = dict.fromkeys(lat, 0.0)
        by_round: dict[str, list[float]] = {a.name: [] for a in arms}
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for arm in arms:
                await _segment(session, arm, body, concurrency, 1.0)  # warm: connections, caches
            for r in range(rounds):
                shift = r % len(arms)
                for arm in [*arms[shift:], *arms[:shift]]:
                    cpu0, t0 = _cpu(fleet, arm.name), time.perf_counter()
                    got, bad = await _segment(session, arm, body, concurrency, segment_s)
                    secs = time.perf_counter() - t0
                    cpu[arm.name] += _cpu(fleet, arm.name) - cpu0
                    wall[arm.name] += secs
                    lat[arm.name] += got
                    errs[arm.name] += bad
                    by_round[arm.name].append(len(got) / secs)
                    print(f"round {r + 1} {arm.name}: {len(got) / secs:.0f} req/s", file=sys.stderr)
    return [
        ArmResult(
            arm=a.name,
            requests=len(lat[a.name]),
            errors=errs[a.name],
            rps=len(lat[a.name]) / wall[a.name],
            rps_by_round=tuple(by_round[a.name]),
            cpu_us_per_request=cpu[a.name] / max(1, len(lat[a.name])) * 1e6,
            cores_busy=cpu[a.name] / wall[a.name],
            latency_p50_ms=_quantile(lat[a.name], 0.5),
            latency_p99_ms=_quantile(lat[a.name], 0.99),
        )
        for a in arms
    ]


def table(results: Sequence[ArmResult]) -> str:
    by = {r.arm: r for r in results}
    one, two = by["workers-1"], by["workers-2"]
    ratios = [b / a for a, b in zip(one.rps_by_round, two.rps_by_round, strict=True) if a]
    lines = [
        "arm          reqs  err    req/s  CPU µs/req  cores busy  lat p50 ms  lat p99 ms",
        *(
            f"{r.arm:<11} {r.requests:>6} {r.errors:>4} {r.rps:>8.1f} {r.cpu_us_per_request:>11.0f}"
            f" {r.cores_busy:>11.2f} {r.latency_p50_ms:>11.2f} {r.latency_p99_ms:>11.2f}"
            for r in results
        ),
        f"2 workers ÷ 1 worker, req/s: median of rounds {statistics.median(ratios):.3f} "
        f"(rounds {' '.join(f'{x:.3f}' for x in ratios)}); over all segments "
        f"{two.rps / one.rps:.3f}",
        f"CPU-bound ceiling (derived, not measured: 1e6 / CPU µs per request per core the arm "
        f"can use): 1 worker {1e6 / one.cpu_us_per_request:.0f} req/s on 1 core, 2 workers "
        f"{2e6 / two.cpu_us_per_request:.0f} req/s on 2 cores "
        f"({2 * one.cpu_us_per_request / two.cpu_us_per_request:.2f} ×)",
        f"machine: {os.cpu_count()} CPUs; nothing pinned",
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    results = await measure(args.rounds, args.segment_s, args.concurrency)
    print(table(results))
    if args.json:
        Path(args.json).write_bytes(jsonx.dumps([asdict(r) for r in results], indent=True))  # noqa: ASYNC240 — once, at the end
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--segment-s", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    return run_main(lambda: main_async(args))


if __name__ == "__main__":
    sys.exit(main())
