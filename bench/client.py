"""The benchmark's streaming client: one stamped read list per request, nothing parsed in flight.

While a request is in flight the client records only ``(perf_counter_ns, bytes)`` per network
read (:class:`Read`); everything else — SSE decoding, ttft, gaps, coalescing — is done afterwards
by :mod:`bench.analysis`, so measuring adds as little as possible to what is measured. Requests are
interleaved across arms (:func:`run_interleaved`) so slow drifts of the machine fall on every arm
alike. The simulator stamps every SSE event with a ``: sent_ns=<perf_counter_ns>`` comment just
before its write; perf_counter_ns is CLOCK_MONOTONIC on Linux, shared by all processes of the
machine, so ``recv_ns - sent_ns`` is the event's delivery latency from the upstream's write to the
client's read.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from core import jsonx

__all__ = [
    "Arm",
    "Read",
    "StreamResult",
    "chat_body",
    "get_json",
    "run_interleaved",
    "stream_request",
]


@dataclass(frozen=True, slots=True)
class Read:
    """One network read: when ``readany()`` returned, and what it returned."""

    recv_ns: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One streamed request as the client saw it (raw; see :func:`bench.analysis.analyze`)."""

    arm: str
    index: int
    warmup: bool
    t_send_ns: int  # just before the request is handed to aiohttp
    end_ns: int
    status: int | None
    error: str | None
    reads: tuple[Read, ...]


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    url: str  # the full POST endpoint
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (e.g. a proxy's key)


def chat_body(index: int, max_tokens: int) -> bytes:
    """Request ``index`` is identical in every arm (same prompt → same simulated text)."""
    return jsonx.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"benchmark prompt number {index}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return jsonx.loads(await resp.read())


async def stream_request(
    session: aiohttp.ClientSession,
    arm: Arm,
    index: int,
    body: bytes,
    *,
    warmup: bool,
    timeout_s: float,
) -> StreamResult:
    reads: list[Read] = []
    status: int | None = None
    error: str | None = None
    perf_ns = time.perf_counter_ns
    headers = {"content-type": "application/json", "x-request-id": f"{arm.name}-{index}"}
    headers.update(arm.headers)
    t_send_ns = perf_ns()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(arm.url, data=body, headers=headers) as resp:
                status = resp.status
                content = resp.content
                while chunk := await content.readany():
                    reads.append(Read(perf_ns(), chunk))
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = type(exc).__name__
    return StreamResult(arm.name, index, warmup, t_send_ns, perf_ns(), status, error, tuple(reads))


async def run_interleaved(
    arms: Sequence[Arm],
    *,
    requests: int,
    warmup: int,
    concurrency: int,
    body_for: Callable[[int], bytes],
    timeout_s: float = 60.0,
    stagger_s: float = 0.0,
) -> list[StreamResult]:
    """Request ``i`` goes to every arm before request ``i + 1`` goes to any; the arm that goes
    first rotates with ``i``, so slow drifts of the machine fall on every arm alike.

    ``stagger_s``: worker ``k`` of ``concurrency`` starts ``k × stagger_s / concurrency`` late, so
    equal-length streams do not start (and then end and restart) all at once.
    """
    jobs: deque[tuple[Arm, int]] = deque()
    for i in range(warmup + requests):
        shift = i % len(arms)
        jobs.extend((arm, i) for arm in [*arms[shift:], *arms[:shift]])
    results: list[StreamResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def worker(k: int) -> None:
            if stagger_s:
                await asyncio.sleep(k * stagger_s / concurrency)
            while jobs:
                arm, i = jobs.popleft()
                body = body_for(i)
                res = await stream_request(
                    session, arm, i, body, warmup=i < warmup, timeout_s=timeout_s
                )
                results.append(res)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return results
