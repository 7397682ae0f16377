"""Exchange sinks: where finished exchanges go (comparison, records and telemetry plug in here).

``submit`` is called on the event loop once per exchange, after every leg ended; it must return
quickly and never raise. Heavy work (comparison, disk) belongs in the sink's own worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from core.exchange import Exchange, ExchangeSink

log = logging.getLogger(__name__)

T = TypeVar("T")


class MemorySink:
    """Keeps the last ``maxlen`` exchanges in memory; tests and the demo read them."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self.exchanges: deque[Exchange] = deque(maxlen=maxlen)
        self._waiters: list[tuple[Callable[[Exchange], bool], asyncio.Future[Exchange]]] = []

    def submit(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)
        for entry in list(self._waiters):
            predicate, future = entry
            if not future.done() and predicate(exchange):
                future.set_result(exchange)
                self._waiters.remove(entry)

    async def wait_for(
        self, predicate: Callable[[Exchange], bool] = lambda _: True, *, timeout_s: float = 10.0
    ) -> Exchange:
        """The first exchange (already seen or future) that satisfies ``predicate``."""
        for exchange in self.exchanges:
            if predicate(exchange):
                return exchange
        future: asyncio.Future[Exchange] = asyncio.get_running_loop().create_future()
        entry = (predicate, future)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)


class FanoutSink:
    """Hands each exchange to several sinks; one failing sink never stops the others."""

    def __init__(self, sinks: Iterable[ExchangeSink]) -> None:
        self.sinks = tuple(sinks)

    def submit(self, exchange: Exchange) -> None:
        for sink in self.sinks:
            try:
                sink.submit(exchange)
            except Exception:  # a sink bug must not break the data path or its peers
                log.exception("exchange sink %r failed", sink)


class ThreadedSink(Generic[T]):
    """Runs ``handle(item)`` on one worker thread, in batches.

    For CPU-bound consumers (metric recording walks every chunk gap). ``submit`` on the event loop
    is one ``deque.append`` — no lock, no wake-up: the worker wakes every ``interval_s`` (or on
    :meth:`join`) and handles everything queued. A wake-up per item cost more than the work
    itself at 1,000 requests/s (futex, GIL hand-off; profiled in docs/benchmarks.md). After every
    ``slice_s`` of work the worker releases the GIL (``time.sleep(0)``), so the event loop waits at
    most about one slice — not CPython's whole 5 ms switch interval — when a chunk arrives
    meanwhile. Not after every item: each hand-off is two context switches, and at one per
    exchange they cost the process more CPU than the metric recording itself (measured).

    ``on_idle`` runs on the worker whenever it has emptied the queue after handling something (a
    consumer that batches commits there); :meth:`join` returns once that has happened for
    everything submitted before it. More than ``maxsize`` waiting items drops the newest, counts it
    in :attr:`dropped` and calls ``on_drop`` — bounded in memory, never back-pressuring the data
    path. ``start=False`` defers the thread to :meth:`start` (items queue meanwhile).
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[T], None],
        *,
        maxsize: int = 10_000,
        interval_s: float = 0.05,
        slice_s: float = 0.0005,
        on_drop: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        start: bool = True,
    ) -> None:
        self.name = name
        self.handle = handle
        self.maxsize = max(1, maxsize)
        self.on_drop = on_drop
        self.on_idle = on_idle
        self.interval_s = interval_s
        self.slice_ns = int(slice_s * 1e9)
        self.dropped = 0
        self.failed = 0
        self.submitted = 0  # written by the event loop only
        self.handled = 0  # written by the worker only
        self.idle_at = 0  # handled count when on_idle last ran (written by the worker only)
        self._pending: deque[T] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=f"sink:{self.name}", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, item: T) -> None:
        if len(self._pending) >= self.maxsize:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop()
            return
        self._pending.append(item)
        self.submitted += 1

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        pending, handle = self._pending, self.handle
        if not pending:
            return
        perf_ns, slice_ns = time.perf_counter_ns, self.slice_ns
        yielded_ns = perf_ns()
        while pending:
            item = pending.popleft()
            try:
                handle(item)
            except Exception:  # the worker must outlive a bad item
                self.failed += 1
                log.exception("sink %s failed on an item", self.name)
            self.handled += 1
            if perf_ns() - yielded_ns >= slice_ns:
                time.sleep(0)  # let the event loop take the GIL if it is waiting for it
                yielded_ns = perf_ns()
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # e.g. a failed commit: logged by its owner, the worker goes on
                log.exception("sink %s: idle step failed", self.name)
        self.idle_at = self.handled

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything submitted so far was handled (and, with
        ``on_idle``, followed by an idle step); False on timeout or with no running worker."""
        deadline = time.monotonic() + timeout_s
        target = self.submitted
        self._wake.set()
        while self.idle_at < target and time.monotonic() < deadline and self.running:
            time.sleep(0.002)
        return self.idle_at >= target

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish what is queued (bounded), then stop the worker."""
        thread = self._thread
        if thread is None:
            return
        self.join(timeout_s)
        self._stopping = True
        self._wake.set()
        thread.join(timeout=max(0.0, timeout_s))
        self._thread = None
