"""The evidence worker: every finished exchange becomes one :class:`~core.evidence.Evidence`,
built once, off the event loop, and handed to every consumer.

``submit`` runs on the event loop and is one ``deque.append`` (no lock, no wake-up); more than
``maxsize`` waiting exchanges drops the newest and counts it (``dropped``, ``on_drop``) — evidence
is bounded in memory and never back-pressures the data path. One worker thread wakes every
``interval_s`` and, per exchange: classifies the request, computes every leg's acceptance,
compares each shadow leg with the primary (candidate vs primary; baseline vs primary — the noise
floor), and calls each consumer's ``handle`` in turn — the record store, metrics and spans, OTLP
logs, rollout guards. The comparison record itself is built only if a consumer reads it.

The GIL is handed back after every ``slice_s`` of work (``time.sleep(0)``), so the event loop
waits at most about one slice — not CPython's 5 ms switch interval — when a chunk arrives
meanwhile; not after every exchange, because each hand-off is two context switches and at one per
exchange they cost more than the work itself (measured; docs/benchmarks.md). Whenever the queue
has run empty, every consumer's ``flush`` runs (the store commits its batch there).

A failing consumer is logged and counted (``consumer_failures``) and never stops the others; an
exchange whose evidence cannot be built is counted in ``failed``. The backend scraper (vLLM's
``/metrics``), when given, runs as a task between :meth:`start` and :meth:`stop`; records carry
its latest snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.evidence import Comparison, Evidence, EvidenceConsumer
from core.exchange import CAPTURE_OFF, CaptureSpec, Exchange
from core.tasks import TaskSet
from evidence.acceptance import leg_acceptance
from evidence.classify import categorize, request_traits
from evidence.compare import compare, is_greedy
from evidence.schema import build_record
from evidence.scrape import MetricsScraper

log = logging.getLogger(__name__)


def build_evidence(
    exchange: Exchange,
    *,
    capture_default: CaptureSpec = CAPTURE_OFF,
    scraper: MetricsScraper | None = None,
) -> Evidence:
    """Classify, measure acceptance and compare one exchange (pure, apart from the scraper)."""
    category, source = categorize(exchange.category, exchange.request_json)
    greedy = is_greedy(exchange.temperature, exchange.seed)
    comparisons: tuple[Comparison, ...] = ()
    if exchange.shadows:
        expects_json = (
            request_traits(exchange.request_json).json_mode
            if exchange.request_json is not None
            else None
        )
        comparisons = tuple(
            compare(exchange.primary, shadow, greedy=greedy, expects_json=expects_json)
            for shadow in exchange.shadows
        )
    capture = exchange.capture or capture_default

    def record(evidence: Evidence) -> Mapping[str, Any]:
        scraped = scraper.snapshot() if scraper is not None else None
        return build_record(evidence, capture=capture, scraped=scraped)

    return Evidence(
        exchange,
        category=category,
        category_source=source,
        greedy=greedy,
        comparisons=comparisons,
        acceptance=tuple(leg_acceptance(leg.recording) for leg in exchange.legs),
        record=record,
    )


class EvidenceWorker:
    """Exchanges in (on the event loop), evidence out to ``consumers`` (on one worker thread).

    A :class:`~core.exchange.ManagedSink`: the gateway calls :meth:`start` before serving and
    :meth:`stop` after its last exchange. See the module docstring.
    """

    def __init__(
        self,
        consumers: Sequence[EvidenceConsumer | Callable[[Evidence], None]],
        *,
        capture_default: CaptureSpec = CAPTURE_OFF,
        scraper: MetricsScraper | None = None,
        maxsize: int = 10_000,
        interval_s: float = 0.05,
        slice_s: float = 0.0005,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.consumers = tuple(consumers)
        # A consumer is an object with handle() (flush() and close() optional) or a callable.
        self._handlers: tuple[Callable[[Evidence], None], ...] = tuple(
            c.handle if isinstance(c, EvidenceConsumer) else c for c in consumers
        )
        self._flushers = _steps(consumers, "flush")
        self._closers = _steps(consumers, "close")
        self.capture_default = capture_default
        self.scraper = scraper
        self.maxsize = max(1, maxsize)
        self.interval_s = interval_s
        self.slice_ns = int(slice_s * 1e9)
        self.on_drop = on_drop
        self.submitted = 0  # written by the event loop only
        self.dropped = 0
        self.handled = 0  # written by the worker only
        self.flushed = 0  # handled exchanges whose consumers have flushed since
        self.failed = 0  # exchanges whose evidence could not be built
        self.consumer_failures = 0
        self._pending: deque[Exchange] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._tasks = TaskSet()
        self._scrape_task: asyncio.Task[None] | None = None

    # -- event loop side -----------------------------------------------------------------------

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange``; never blocks, never raises (a full queue drops and counts)."""
        if len(self._pending) >= self.maxsize:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop()
            return
        self._pending.append(exchange)
        self.submitted += 1

    async def start(self) -> None:
        """Start the worker thread and the scraper (idempotent)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specshadow-evidence", daemon=True)
        self._thread.start()
        if self.scraper is not None:
            self._scrape_task = self._tasks.spawn(self.scraper.run(), name="metrics-scraper")

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far was handled and flushed; False on timeout."""
        return await asyncio.to_thread(self.join, timeout_s)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Handle what is queued (within ``timeout_s``), close every consumer, stop the scraper."""
        if self._scrape_task is not None:
            self._scrape_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scrape_task
            self._scrape_task = None
        thread = self._thread
        if thread is None:
            return
        await asyncio.to_thread(self._finish, thread, timeout_s)
        self._thread = None

    async def __aenter__(self) -> EvidenceWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- worker thread -------------------------------------------------------------------------

    def join(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until everything submitted so far was handled and flushed."""
        deadline = time.monotonic() + timeout_s
        target = self.submitted
        self._wake.set()
        while self.flushed < target and time.monotonic() < deadline:
            if self._thread is None or not self._thread.is_alive():
                break
            time.sleep(0.002)
        return self.flushed >= target

    def _finish(self, thread: threading.Thread, timeout_s: float) -> None:
        self.join(timeout_s)
        self._stopping = True
        self._wake.set()
        thread.join(timeout=max(0.0, timeout_s))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                self._drain()
            self._drain()
        finally:
            for close in self._closers:
                self._call(close)

    def _drain(self) -> None:
        pending = self._pending
        perf_ns, slice_ns = time.perf_counter_ns, self.slice_ns
        yielded_ns = perf_ns()
        if not pending:
            return
        while pending:
            self._handle(pending.popleft())
            self.handled += 1
            if perf_ns() - yielded_ns >= slice_ns:
                time.sleep(0)  # let the event loop take the GIL if it is waiting for it
                yielded_ns = perf_ns()
        for flush in self._flushers:
            self._call(flush)
        self.flushed = self.handled

    def _handle(self, exchange: Exchange) -> None:
        try:
            evidence = build_evidence(
                exchange, capture_default=self.capture_default, scraper=self.scraper
            )
        except Exception:  # one malformed exchange must not stop the worker
            self.failed += 1
            log.exception("could not build the evidence of exchange %s", exchange.exchange_id)
            return
        for handle in self._handlers:
            try:
                handle(evidence)
            except Exception:  # a consumer bug must not starve its peers
                self.consumer_failures += 1
                log.debug("evidence consumer %r failed", handle, exc_info=True)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # each consumer's flush/close is its own step
            self.consumer_failures += 1
            log.warning("evidence consumer step %r failed", fn, exc_info=True)


def _steps(consumers: Sequence[object], name: str) -> tuple[Callable[[], None], ...]:
    found = (getattr(c, name, None) for c in consumers if isinstance(c, EvidenceConsumer))
    return tuple(step for step in found if callable(step))
