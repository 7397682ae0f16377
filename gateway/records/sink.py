"""RecordSink: the :class:`~gateway.exchange.ExchangeSink` that turns exchanges into records.

``submit`` runs on the event loop and only enqueues (O(1)); when the bounded queue is full the
exchange is dropped and counted (``dropped``) — recording never slows the primary. One writer
thread does everything else, off the event loop: classify the request, compare each shadow leg
with the primary (candidate vs primary, baseline vs primary — the noise floor), build the record
(:mod:`gateway.records.schema`), run the hooks, and append to the SQLite store in batches
(a batch is committed whenever the queue runs empty or ``batch_size`` records are waiting).

Hooks (``RecordHook``) receive every finished record with its comparisons in the writer thread:
the telemetry package maps them to ``gen_ai.evaluation.result`` events, comparison metrics, and —
at scale — OTLP log records. A failing hook is logged and counted, never propagated.

Lifecycle: ``async with build_record_sink(...) as sink`` (or ``await start()`` / ``await
stop()``); ``stop`` writes what is queued, then closes the store. A killed process loses at most
the records still queued or in the uncommitted batch; the store itself stays consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from gateway.classify import categorize, request_traits
from gateway.compare import Comparison, compare, is_greedy
from gateway.exchange import Exchange
from gateway.records.schema import build_record
from gateway.records.store import RecordStore
from gateway.scrape import MetricsScraper
from gateway.tasks import TaskSet
from policies.compiled import CaptureSpec, CaptureText

log = logging.getLogger(__name__)

DEFAULT_REDACT = frozenset({"emails", "secrets"})


@dataclass(frozen=True, slots=True)
class RecordEvidence:
    """What a hook gets: the exchange, its record, and the comparisons behind it."""

    exchange: Exchange
    record: Mapping[str, Any]
    comparisons: tuple[Comparison, ...]
    category: str | None


RecordHook = Callable[[RecordEvidence], None]

_STOP = object()


class RecordSink:
    """Queue → writer thread → SQLite store. See the module docstring."""

    def __init__(
        self,
        store_path: str | Path,
        *,
        capture_default: CaptureSpec,
        scraper: MetricsScraper | None = None,
        hooks: Sequence[RecordHook] = (),
        queue_size: int = 10_000,
        batch_size: int = 256,
        max_rows: int | None = 1_000_000,
        max_age_s: float | None = 30 * 86_400.0,
        prune_interval_s: float = 60.0,
    ) -> None:
        self.store_path = Path(store_path)
        self.capture_default = capture_default
        self.scraper = scraper
        self.hooks = tuple(hooks)
        self.batch_size = max(1, batch_size)
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.prune_interval_s = prune_interval_s
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, queue_size))
        self._thread: threading.Thread | None = None
        self._tasks: TaskSet | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self.submitted = 0
        self.dropped = 0  # queue full
        self.written = 0
        self.failed = 0  # records that could not be built or committed
        self.hook_failures = 0

    # -- event loop side -------------------------------------------------------------------------

    def submit(self, exchange: Exchange) -> None:
        """Enqueue ``exchange``; never blocks, never raises (a full queue drops and counts)."""
        try:
            self._queue.put_nowait(exchange)
        except queue.Full:
            self.dropped += 1
            return
        self.submitted += 1

    async def start(self, tasks: TaskSet | None = None) -> None:
        """Open the store (in the writer thread) and start the scraper task, if any."""
        if self._thread is not None:
            return
        opened: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def ready(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(opened.set_result, error)

        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="specshadow-records", daemon=True
        )
        self._thread.start()
        error = await opened
        if error is not None:
            self._thread = None
            raise error
        if self.scraper is not None:
            self._tasks = tasks if tasks is not None else TaskSet()
            self._scrape_task = self._tasks.spawn(self.scraper.run(), name="metrics-scraper")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (within ``timeout_s``), stop the thread and the scraper."""
        if self._scrape_task is not None:
            self._scrape_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scrape_task
            self._scrape_task = None
        thread = self._thread
        if thread is None:
            return
        await asyncio.to_thread(self._queue.put, _STOP, True, timeout_s)
        await asyncio.to_thread(thread.join, timeout_s)
        self._thread = None

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is committed (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def __aenter__(self) -> RecordSink:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- writer thread -----------------------------------------------------------------------------

    def evidence(self, exchange: Exchange) -> RecordEvidence:
        """Classify, compare and build the record of one exchange (pure apart from the scraper)."""
        category, source = categorize(exchange.category, exchange.request_json)
        greedy = is_greedy(exchange.temperature, exchange.seed)
        expects_json = (
            request_traits(exchange.request_json).json_mode
            if exchange.request_json is not None
            else None
        )
        comparisons = tuple(
            compare(exchange.primary, shadow, greedy=greedy, expects_json=expects_json)
            for shadow in exchange.shadows
        )
        record = build_record(
            exchange,
            category=category,
            category_source=source,
            capture=exchange.capture or self.capture_default,
            comparisons=comparisons,
            greedy=greedy,
            scraped=self.scraper.snapshot() if self.scraper is not None else None,
        )
        return RecordEvidence(exchange, record, comparisons, category)

    def _run(self, ready: Callable[[BaseException | None], None]) -> None:
        try:
            store = RecordStore(self.store_path, max_rows=self.max_rows, max_age_s=self.max_age_s)
        except Exception as exc:  # noqa: BLE001 — handed to start(), which raises it
            ready(exc)
            return
        ready(None)
        try:
            self._loop(store)
        finally:
            store.close()

    def _loop(self, store: RecordStore) -> None:
        batch: list[Mapping[str, Any]] = []
        taken = 0
        next_prune = time.monotonic()
        stopping = False
        while not stopping:
            try:
                item: object = self._queue.get(timeout=self.prune_interval_s)
                taken += 1
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping = True
            elif isinstance(item, Exchange):
                record = self._build(item)
                if record is not None:
                    batch.append(record)
            if stopping or len(batch) >= self.batch_size or self._queue.empty():
                self._commit(store, batch)
                batch = []
                for _ in range(taken):
                    self._queue.task_done()
                taken = 0
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + self.prune_interval_s
                self._prune(store)

    def _build(self, exchange: Exchange) -> Mapping[str, Any] | None:
        try:
            evidence = self.evidence(exchange)
        except Exception:  # one malformed exchange must not stop recording
            self.failed += 1
            log.exception("could not build the record of exchange %s", exchange.exchange_id)
            return None
        for hook in self.hooks:
            try:
                hook(evidence)
            except Exception:  # hooks are telemetry: never break recording
                self.hook_failures += 1
                log.debug("record hook %r failed", hook, exc_info=True)
        return evidence.record

    def _commit(self, store: RecordStore, batch: list[Mapping[str, Any]]) -> None:
        if not batch:
            return
        try:
            store.append(batch)
        except Exception:  # disk full, locked file…: count, keep serving
            self.failed += len(batch)
            log.exception("could not write %d records to %s", len(batch), self.store_path)
            return
        self.written += len(batch)

    def _prune(self, store: RecordStore) -> None:
        try:
            store.prune()
        except Exception:  # retention is retried at the next interval
            log.warning("record retention on %s failed", self.store_path, exc_info=True)


def capture_spec(capture: CaptureSpec | CaptureText) -> CaptureSpec:
    if isinstance(capture, CaptureSpec):
        return capture
    return CaptureSpec(text=capture, redact=DEFAULT_REDACT)


def build_record_sink(
    store_path: str | Path,
    *,
    capture_default: CaptureSpec | CaptureText = "off",
    scrape_targets: Mapping[str, str] | None = None,
    scrape_interval_s: float = 15.0,
    hooks: Sequence[RecordHook] = (),
    **options: Any,
) -> RecordSink:
    """A RecordSink for ``serve --store PATH``; ``scrape_targets``: backend name → /metrics URL.

    ``options`` go to :class:`RecordSink` (queue_size, batch_size, max_rows, max_age_s, …).
    """
    scraper = MetricsScraper(scrape_targets, scrape_interval_s) if scrape_targets else None
    return RecordSink(
        store_path,
        capture_default=capture_spec(capture_default),
        scraper=scraper,
        hooks=hooks,
        **options,
    )
