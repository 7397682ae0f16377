"""Non-streaming throughput: a closed loop of ``concurrency`` clients per arm, arms in rotating rounds;
and latency at a fixed offered rate (open loop).

Each round gives every arm one segment of ``segment_s`` seconds (the arm that goes first rotates
with the round), so drifts of a shared machine fall on all arms alike. Within a segment,
``concurrency`` workers each send a request, read the whole body, and send the next at once.
Measured per arm: completed requests / summed segment time, latency (client send → last body byte)
and, for proxy arms, the proxy process's CPU seconds per request (from ``/proc``): a busy client or
upstream caps the achieved rate for every arm alike, but not the proxy's own cost.

A closed loop's latency is its queueing at saturation (8 clients / rate), so it says little about
the cost of a request at a load the proxy can carry. :func:`open_loop` offers every arm the same
fixed rate and times each request from its *scheduled* send time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import aiohttp
from yarl import URL

from bench.analysis import Dist, dist_ms
from bench.client import Arm
from bench.procstat import cpu_s

T = TypeVar("T")


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
    cpu_us_per_request_by_round: tuple[float, ...] = ()  # one per round (proxy arms)


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


async def rotating_rounds(
    arms: Sequence[Arm],
    pids: Mapping[str, int],
    rounds: int,
    segment: Callable[[Arm], Awaitable[T]],
) -> list[tuple[Arm, T, float, float]]:
    """Every arm's ``segment`` once per round, the arm that goes first rotating with the round.

    Returns (arm, result, the proxy's CPU seconds during it (0 for arms without a pid), wall
    seconds) per segment, in the order they ran: drifts of a shared machine fall on all arms alike.
    """
    out: list[tuple[Arm, T, float, float]] = []
    for r in range(rounds):
        shift = r % len(arms)
        for arm in [*arms[shift:], *arms[:shift]]:
            pid = pids.get(arm.name)
            cpu0, t0 = (cpu_s(pid) if pid else 0.0), time.perf_counter()
            result = await segment(arm)
            used_s = (cpu_s(pid) - cpu0) if pid else 0.0
            out.append((arm, result, used_s, time.perf_counter() - t0))
    return out


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
    per_round: dict[str, list[float]] = {a.name: [] for a in arms}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for arm in arms:  # open keep-alive connections, warm caches
            await _segment(session, arm, body, concurrency, warmup_s)

        async def segment(arm: Arm) -> tuple[list[int], int]:
            return await _segment(session, arm, body, concurrency, segment_s)

        for arm, (got, bad), used_s, wall_s in await rotating_rounds(arms, pids, rounds, segment):
            wall[arm.name] += wall_s
            cpu[arm.name] += used_s
            if arm.name in pids and got:
                per_round[arm.name].append(used_s / len(got) * 1e6)
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
                cpu_us_per_request_by_round=tuple(per_round[arm.name]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class OpenLoopResult:
    arm: str
    rate_rps: float  # offered
    requests: int
    errors: int
    late_sends: int  # sends that left > 1 ms after their scheduled time (the client fell behind)
    latency: Dist  # measured from the *scheduled* send time: a stalled client cannot hide queueing
    cpu_us_per_request: float | None
    proxy_utilisation: float | None
    p99_ms_by_round: tuple[float, ...] = ()


class _Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight.

    The open-loop client is hand-written on ``asyncio.Protocol`` because it shares a core with the
    simulator and must offer its rate with headroom: aiohttp's client costs several times more per
    request, and a client that falls behind its schedule measures itself, not the arm. It
    understands exactly what the arms answer: ``Content-Length`` bodies and chunked bodies
    without trailers.
    """

    def __init__(self, idle: list[_Exchange], done: list[tuple[int, int, bool]]) -> None:
        self.idle, self.done = idle, done
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.scheduled_ns = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, request: bytes, scheduled_ns: int) -> None:
        assert self.transport is not None
        self.scheduled_ns = scheduled_ns
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buf[:head_end]).lower()
        body = len(self.buf) - head_end - 4
        length_at = head.find(b"\r\ncontent-length:")
        if length_at >= 0:
            line_end = head.find(b"\r\n", length_at + 2)
            length = int(head[length_at + 17 : line_end if line_end > 0 else None])
            complete = body >= length
        else:  # chunked: the body ends with the zero-size chunk
            complete = self.buf.endswith(b"0\r\n\r\n") and body >= 5
        if complete:
            ok = head.startswith(b"http/1.1 200")
            self.buf.clear()
            self.done.append((self.scheduled_ns, time.perf_counter_ns(), ok))
            self.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.buf or self.scheduled_ns:
            if self in self.idle:
                self.idle.remove(self)
            else:
                self.done.append((self.scheduled_ns, time.perf_counter_ns(), False))


def _request_bytes(arm: Arm, body: bytes) -> tuple[str, int, bytes]:
    url = URL(arm.url)
    host, port = url.host or "127.0.0.1", url.port or 80
    lines = [
        f"POST {url.raw_path_qs} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in arm.headers),
    ]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _open_segment(
    arm: Arm, body: bytes, rate_rps: float, segment_s: float, idle: list[_Exchange]
) -> tuple[list[int], int, int]:
    """Send at a fixed rate for ``segment_s`` whether or not earlier requests finished.

    ``idle`` is the arm's pool of keep-alive connections (kept between segments); a send finds
    none free opens one more. Returns the latencies (from each request's scheduled time), the
    errors, and how many sends left more than 1 ms after their scheduled time.
    """
    loop = asyncio.get_running_loop()
    host, port, request = _request_bytes(arm, body)
    done: list[tuple[int, int, bool]] = []
    for conn in idle:
        conn.done = done
    late = 0
    perf_ns = time.perf_counter_ns
    interval_ns = int(1e9 / rate_rps)
    n = int(segment_s * rate_rps)
    start_ns = perf_ns()
    for i in range(n):
        scheduled_ns = start_ns + i * interval_ns
        wait_ns = scheduled_ns - perf_ns()
        if wait_ns > 0:
            await asyncio.sleep(wait_ns / 1e9)
        elif wait_ns < -1_000_000:
            late += 1
        while idle and idle[-1].closed:
            idle.pop()
        if idle:
            idle.pop().send(request, scheduled_ns)
        else:
            _transport, conn = await loop.create_connection(
                lambda: _Exchange(idle, done), host, port
            )
            conn.send(request, scheduled_ns)
    deadline_ns = perf_ns() + 30_000_000_000
    while len(done) < n and perf_ns() < deadline_ns:  # noqa: ASYNC110 - protocols fill `done`
        await asyncio.sleep(0.005)
    latencies = [end - sched for sched, end, ok in done if ok]
    errors = n - len(latencies)
    return latencies, errors, late


async def open_loop(
    arms: Sequence[Arm],
    pids: Mapping[str, int],
    *,
    body: bytes,
    rate_rps: float,
    segment_s: float,
    rounds: int,
) -> list[OpenLoopResult]:
    """Every arm offered the same fixed rate in rotating rounds: latency at a load, not at saturation.

    The closed loop answers "how much can it do"; this answers "what does a request cost at a
    load it can carry" — issue 8's "p99 ≤ 10 ms at 0.6 × the relay's throughput".
    """
    lat: dict[str, list[int]] = {a.name: [] for a in arms}
    errs = dict.fromkeys(lat, 0)
    late = dict.fromkeys(lat, 0)
    wall = dict.fromkeys(lat, 0.0)
    cpu = dict.fromkeys(lat, 0.0)
    pools: dict[str, list[_Exchange]] = {a.name: [] for a in arms}
    p99_by_round: dict[str, list[float]] = {a.name: [] for a in arms}
    try:
        for arm in arms:  # open enough keep-alive connections for the rate
            await _open_segment(arm, body, rate_rps, 0.5, pools[arm.name])

        async def segment(arm: Arm) -> tuple[list[int], int, int]:
            return await _open_segment(arm, body, rate_rps, segment_s, pools[arm.name])

        results = await rotating_rounds(arms, pids, rounds, segment)
        for arm, (got, bad, behind), used_s, wall_s in results:
            wall[arm.name] += wall_s
            cpu[arm.name] += used_s
            lat[arm.name] += got
            errs[arm.name] += bad
            late[arm.name] += behind
            if (p99 := dist_ms(got).p99_ms) is not None:
                p99_by_round[arm.name].append(p99)
    finally:
        for pool in pools.values():
            for conn in pool:
                if conn.transport is not None:
                    conn.transport.close()
    out: list[OpenLoopResult] = []
    for arm in arms:
        n, secs = len(lat[arm.name]), wall[arm.name]
        proxy = arm.name in pids
        out.append(
            OpenLoopResult(
                arm=arm.name,
                rate_rps=rate_rps,
                requests=n,
                errors=errs[arm.name],
                late_sends=late[arm.name],
                latency=dist_ms(lat[arm.name]),
                cpu_us_per_request=cpu[arm.name] / n * 1e6 if proxy and n else None,
                proxy_utilisation=cpu[arm.name] / secs if proxy and secs else None,
                p99_ms_by_round=tuple(p99_by_round[arm.name]),
            )
        )
    return out
