"""Run a schedule against one OpenAI-compatible endpoint with bounded concurrency (I/O shell).

Warm-up first (closed loop, results kept but flagged ``warmup``), then the measured phase:

- closed loop: ``concurrency`` workers take the next slot as soon as they are free;
- open loop: a dispatcher sleeps until each slot's scheduled time and starts it in a tracked task;
  at most ``concurrency`` run at once, and a request that has to wait for a free place is still
  measured from its scheduled time (see :mod:`loadgen.client`), so queueing stays visible.

One ``aiohttp.ClientSession`` per run, with a connector sized to the concurrency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import aiohttp

from core.tasks import TaskSet
from loadgen.client import RequestResult, RequestSettings, send_request
from loadgen.schedule import Mode, ScheduleSpec, Slot, measured_slots, warmup_slots
from loadgen.trace import TraceRecord, trace_records as to_records

__all__ = ["OPEN_LOOP_MAX_IN_FLIGHT", "run_loadgen", "run_schedule"]

# Default cap on requests in flight for open-loop modes when none is given: high enough that the
# client never becomes the bottleneck of a single backend, low enough to stay within fd limits.
OPEN_LOOP_MAX_IN_FLIGHT = 1024
_NS_PER_S = 1_000_000_000

ProgressHook = Callable[[RequestResult], None]


async def run_schedule(
    records: Sequence[TraceRecord],
    spec: ScheduleSpec,
    settings: RequestSettings,
    *,
    progress: ProgressHook | None = None,
    session: aiohttp.ClientSession | None = None,
) -> list[RequestResult]:
    """Warm-up, then the measured requests; results in measured order (warm-ups first)."""
    if session is None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=30.0, sock_read=settings.request_timeout_s
        )
        connector = aiohttp.TCPConnector(limit=spec.concurrency, force_close=False)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as own:
            return await run_schedule(records, spec, settings, progress=progress, session=own)
    results: list[RequestResult] = []
    warm = warmup_slots(spec, len(records))
    if warm:
        results.extend(
            await _closed_loop(session, records, iter(warm), settings, spec.concurrency, None, None)
        )
    slots = measured_slots(spec, len(records), [r.timestamp_s for r in records])
    if spec.open_loop:
        measured = await _open_loop(session, records, slots, settings, spec.concurrency, progress)
    else:
        measured = await _closed_loop(
            session, records, slots, settings, spec.concurrency, spec.duration_s, progress
        )
    results.extend(sorted(measured, key=lambda r: r.index))
    return results


async def _closed_loop(
    session: aiohttp.ClientSession,
    records: Sequence[TraceRecord],
    slots: Iterator[Slot],
    settings: RequestSettings,
    concurrency: int,
    duration_s: float | None,
    progress: ProgressHook | None,
) -> list[RequestResult]:
    start_ns = time.perf_counter_ns()
    deadline_ns = start_ns + int(duration_s * _NS_PER_S) if duration_s is not None else None
    results: list[RequestResult] = []

    async def worker() -> None:
        # Slots are taken one at a time from a shared iterator: no slot is sent twice.
        for slot in slots:
            if deadline_ns is not None and time.perf_counter_ns() >= deadline_ns:
                return
            result = await send_request(
                session,
                records[slot.record_index],
                settings,
                index=slot.index,
                phase_start_ns=start_ns,
                warmup=slot.warmup,
            )
            results.append(result)
            if progress is not None:
                progress(result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _open_loop(
    session: aiohttp.ClientSession,
    records: Sequence[TraceRecord],
    slots: Iterator[Slot],
    settings: RequestSettings,
    concurrency: int,
    progress: ProgressHook | None,
) -> list[RequestResult]:
    gate = asyncio.Semaphore(concurrency)
    tasks = TaskSet()
    results: list[RequestResult] = []
    start_ns = time.perf_counter_ns()

    async def one(slot: Slot, scheduled_ns: int) -> None:
        try:
            result = await send_request(
                session,
                records[slot.record_index],
                settings,
                index=slot.index,
                phase_start_ns=start_ns,
                scheduled_ns=scheduled_ns,
            )
        finally:
            gate.release()
        results.append(result)
        if progress is not None:
            progress(result)

    try:
        for slot in slots:
            assert slot.offset_s is not None  # open-loop slots always carry a send time
            scheduled_ns = start_ns + int(slot.offset_s * _NS_PER_S)
            delay_s = (scheduled_ns - time.perf_counter_ns()) / _NS_PER_S
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            # Waiting here for a free place delays the send, not the measurement's t0.
            await gate.acquire()
            _ = tasks.spawn(one(slot, scheduled_ns), name=f"loadgen-request-{slot.index}")
        while len(tasks):
            await tasks.drain(timeout_s=3600.0)
    finally:
        tasks.cancel_all()
    return results


async def run_loadgen(
    base_url: str,
    trace_records: Iterable[TraceRecord | Mapping[str, Any]],
    *,
    concurrency: int | None = None,
    max_requests: int | None = None,
    rate_rps: float | None = None,
    burstiness: float = 1.0,
    replay_timing: bool = False,
    time_scale: float = 1.0,
    warmup: int = 0,
    duration_s: float | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    stream: bool = True,
    headers: Mapping[str, str] | None = None,
    category_header: bool = True,
    seed: int = 0,
    request_timeout_s: float = 600.0,
    progress: ProgressHook | None = None,
) -> list[RequestResult]:
    """Replay trace rows (records or raw dicts) against ``base_url`` (``http://host:port/v1``).

    Mode: ``rate_rps`` → Poisson/gamma arrivals; ``replay_timing`` → the trace's timestamps;
    otherwise closed loop at ``concurrency`` (default 1). In open-loop modes ``concurrency`` caps
    requests in flight (default :data:`OPEN_LOOP_MAX_IN_FLIGHT`). Returns warm-ups too
    (``warmup=True``); measured results are in schedule order.
    """
    records = to_records(trace_records)
    mode: Mode = "trace" if replay_timing else ("rate" if rate_rps is not None else "concurrency")
    if concurrency is None:
        concurrency = 1 if mode == "concurrency" else OPEN_LOOP_MAX_IN_FLIGHT
    spec = ScheduleSpec(
        mode=mode,
        concurrency=concurrency,
        rate_rps=rate_rps,
        burstiness=burstiness,
        time_scale=time_scale,
        warmup=warmup,
        max_requests=max_requests,
        duration_s=duration_s,
        seed=seed,
    )
    settings = RequestSettings(
        base_url=base_url,
        stream=stream,
        model=model,
        max_tokens=max_tokens,
        headers=headers,
        category_header=category_header,
        request_timeout_s=request_timeout_s,
    )
    return await run_schedule(records, spec, settings, progress=progress)
