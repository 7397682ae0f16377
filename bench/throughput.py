"""Non-streaming throughput: a closed loop of ``concurrency`` clients per arm, arms in rotating rounds.

Each round gives every arm one segment of ``segment_s`` seconds (the arm that goes first rotates
with the round), so drifts of a shared machine fall on all arms alike. Within a segment,
``concurrency`` workers each send a request, read the whole body, and send the next at once.
Measured per arm: completed requests / summed segment time, latency (client send → last body byte)
and, for proxy arms, the proxy process's CPU seconds per request (from ``/proc``): a busy client or
upstream caps the achieved rate for every arm alike, but not the proxy's own cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from bench.harness import Arm, Dist, dist_ms
from bench.procstat import cpu_s


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    arm: str
    requests: int
    errors: int
    seconds: float
    rps: float
    latency: Dist
    proxy_cpu_s: float | None  # the proxy process's CPU over its segments (None: direct arm)
    cpu_us_per_request: float | None
    proxy_utilisation: float | None  # proxy CPU seconds / wall seconds of its segments


def nonstream_body(max_tokens: int) -> bytes:
    return (
        b'{"model":"sim-model","messages":[{"role":"user","content":"throughput"}],'
        b'"max_tokens":%d,"stream":false}' % max_tokens
    )


async def _segment(
    session: aiohttp.ClientSession, arm: Arm, body: bytes, concurrency: int, segment_s: float
) -> tuple[list[int], int]:
    latencies: list[int] = []
    errors = 0
    headers = {"content-type": "application/json", **dict(arm.headers)}
    perf_ns = time.perf_counter_ns
    deadline_ns = perf_ns() + int(segment_s * 1e9)

    async def worker() -> None:
        nonlocal errors
        while perf_ns() < deadline_ns:
            t0 = perf_ns()
            try:
                async with session.post(arm.url, data=body, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies.append(perf_ns() - t0)
            else:
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors


async def closed_loop(
    arms: Sequence[Arm],
    pids: Mapping[str, int],
    *,
    body: bytes,
    concurrency: int,
    segment_s: float,
    rounds: int,
    warmup_s: float = 0.5,
) -> list[ThroughputResult]:
    """Run the rounds; ``pids`` maps proxy arm names to their process ids (CPU accounting)."""
    lat: dict[str, list[int]] = {a.name: [] for a in arms}
    errs = dict.fromkeys(lat, 0)
    wall = dict.fromkeys(lat, 0.0)
    cpu = dict.fromkeys(lat, 0.0)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for arm in arms:  # open keep-alive connections, warm caches
            await _segment(session, arm, body, concurrency, warmup_s)
        for r in range(rounds):
            shift = r % len(arms)
            for arm in [*arms[shift:], *arms[:shift]]:
                pid = pids.get(arm.name)
                cpu0, t0 = (cpu_s(pid) if pid else 0.0), time.perf_counter()
                got, bad = await _segment(session, arm, body, concurrency, segment_s)
                wall[arm.name] += time.perf_counter() - t0
                cpu[arm.name] += (cpu_s(pid) - cpu0) if pid else 0.0
                lat[arm.name] += got
                errs[arm.name] += bad
    out: list[ThroughputResult] = []
    for arm in arms:
        n, secs = len(lat[arm.name]), wall[arm.name]
        proxy = arm.name in pids
        out.append(
            ThroughputResult(
                arm=arm.name,
                requests=n,
                errors=errs[arm.name],
                seconds=secs,
                rps=n / secs if secs else 0.0,
                latency=dist_ms(lat[arm.name]),
                proxy_cpu_s=cpu[arm.name] if proxy else None,
                cpu_us_per_request=cpu[arm.name] / n * 1e6 if proxy and n else None,
                proxy_utilisation=cpu[arm.name] / secs if proxy and secs else None,
            )
        )
    return out
