"""The evidence worker: every finished exchange becomes one :class:`~core.evidence.Evidence`,
built once, off the event loop, and handed to every consumer.

``submit`` runs on the event loop and is one ``deque.append`` (a :class:`~core.sinks.ThreadedSink`);
more than ``maxsize`` waiting exchanges drops the newest and counts it (``dropped``,
``on_drop``) — evidence is bounded in memory and never back-pressures the data path. One worker
thread wakes every ``interval_s`` and, per exchange: classifies the request, computes every leg's acceptance,
puts every leg's token count on one footing (:mod:`evidence.counts`), compares each shadow leg with the primary (candidate vs primary; baseline vs primary — the noise
floor), and calls each consumer's ``handle`` in turn — the record store, metrics and spans, OTLP
logs, rollout guards. The comparison record itself is built only if a consumer reads it.

Whenever the queue has run empty, every consumer's ``flush`` runs (the store commits its batch
there).

A failing consumer is logged and counted (``consumer_failures``) and never stops the others; an
exchange whose evidence cannot be built is logged and counted in ``failed``. The backend pollers, when
given — the metrics scraper (``/metrics``) and the server-info probe (what speculation each
backend runs) — run as tasks between :meth:`start` and :meth:`stop`; records carry what they
know. What each backend runs is read when the exchange is submitted (a :class:`ProbeView`), so a
worker that lags records the configuration the legs ran on, not one polled after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core import request_body
from core.classify import categorize
from core.evidence import Comparison, Evidence, EvidenceConsumer
from core.exchange import CAPTURE_OFF, CaptureSpec, Exchange
from core.sinks import ThreadedSink
from core.tasks import TaskSet
from evidence.acceptance import leg_acceptance
from evidence.compare import compare, is_greedy
from evidence.counts import reconcile
from evidence.quality import leg_quality, speculation_skip
from evidence.scrape import MetricsScraper, window_json
from evidence.serverinfo import ProbeView, ServerInfoProbe, resolve
from records.writer import BackendFacts, build_record

log = logging.getLogger(__name__)


def build_evidence(
    exchange: Exchange,
    *,
    capture_default: CaptureSpec = CAPTURE_OFF,
    scraper: MetricsScraper | None = None,
    probe: ServerInfoProbe | ProbeView | None = None,
) -> Evidence:
    """Classify, measure acceptance and compare one exchange (pure, apart from the pollers).

    ``probe``: what each backend runs — the worker passes the :class:`ProbeView` it took when the
    exchange was submitted, so the record carries the configuration its legs ran on.

    Acceptance reads each leg's own count; everything that compares legs reads them counted on
    one footing (:func:`evidence.counts.reconcile`), and so does every consumer."""
    acceptance = tuple(leg_acceptance(leg.recording) for leg in exchange.legs)
    exchange = reconcile(exchange)
    category, source = categorize(exchange.category, exchange.request_json)
    greedy = is_greedy(exchange.temperature, exchange.seed)
    comparisons: tuple[Comparison, ...] = ()
    # What only mirrored (or candidate-served) exchanges need is computed only for them: the
    # worker shares the gateway's core, and most exchanges are neither.
    speculative = bool(exchange.shadows) or exchange.served_by != "primary"
    expects_json = (
        request_body.json_mode(exchange.request_json)
        if exchange.request_json is not None and exchange.shadows
        else None
    )
    if exchange.shadows:
        comparisons = tuple(
            compare(exchange.primary, shadow, greedy=greedy, expects_json=expects_json)
            for shadow in exchange.shadows
        )
    capture = exchange.capture or capture_default

    def record(evidence: Evidence) -> Mapping[str, Any]:
        return build_record(evidence, capture=capture, facts=backend_facts(scraper, probe))

    similarity = {id(s): c.similarity for s, c in zip(exchange.shadows, comparisons, strict=True)}
    return Evidence(
        exchange,
        category=category,
        category_source=source,
        greedy=greedy,
        comparisons=comparisons,
        acceptance=acceptance,
        record=record,
        # Only mirrored exchanges are compared; the rest pay nothing for quality.
        quality=tuple(
            leg_quality(
                leg,
                expects_json=expects_json,
                similarity=similarity.get(id(leg)),
                sampled=not greedy,
            )
            for leg in exchange.legs
        )
        if exchange.shadows
        else (),
        speculation_skip=speculation_skip(exchange.request_json) if speculative else None,
        engines=_fingerprints(probe, exchange),
    )


def _fingerprints(probe: ServerInfoProbe | ProbeView | None, exchange: Exchange) -> dict[str, str]:
    """Each leg's backend → its engine configuration's fingerprint, where the probe knows it."""
    if probe is None:
        return {}
    out = {}
    for leg in exchange.legs:
        engine = probe.engine(leg.backend)
        if engine is not None:
            out[leg.backend] = engine.fingerprint
    return out


def backend_facts(
    scraper: MetricsScraper | None = None, probe: ServerInfoProbe | ProbeView | None = None
) -> BackendFacts:
    """What the pollers know, in the record's shape (the writer only lays it out): a backend's
    metrics window, the scrape nearest a leg, a leg's speculation as declared and reported, and
    its backend's engine configuration."""
    snapshot = scraper.snapshot() if scraper is not None else {}
    reported = probe.reported if probe is not None else None
    return BackendFacts(
        window=lambda backend: window_json(snapshot.get(backend)),
        nearest=scraper.nearest if scraper is not None else None,
        speculative=lambda leg: resolve(
            leg.speculative, reported(leg.backend) if reported is not None else None
        ),
        engine=lambda leg: _engine_json(probe, leg.backend),
    )


def _engine_json(
    probe: ServerInfoProbe | ProbeView | None, backend: str
) -> Mapping[str, Any] | None:
    engine = probe.engine(backend) if probe is not None else None
    return engine.to_json() if engine is not None else None


class EvidenceWorker:
    """Exchanges in (on the event loop), evidence out to ``consumers`` (on one worker thread).

    A :class:`~core.exchange.ManagedSink`: the gateway calls :meth:`start` before serving and
    :meth:`stop` after its last exchange. The queue and the thread are a
    :class:`~core.sinks.ThreadedSink` (see its docstring for the GIL and batching trade-offs);
    ``flush`` of every consumer is its idle step. See the module docstring.
    """

    def __init__(
        self,
        consumers: Sequence[EvidenceConsumer | Callable[[Evidence], None]],
        *,
        capture_default: CaptureSpec = CAPTURE_OFF,
        scraper: MetricsScraper | None = None,
        probe: ServerInfoProbe | None = None,
        maxsize: int = 10_000,
        interval_s: float = 0.05,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.consumers = tuple(consumers)
        self.capture_default = capture_default
        self.scraper = scraper
        self.probe = probe
        self.consumer_failures = 0
        # A consumer is an object with handle() (flush() and close() optional) or a callable.
        self._handlers: tuple[Callable[[Evidence], None], ...] = tuple(
            c.handle if isinstance(c, EvidenceConsumer) else c for c in consumers
        )
        self._flushers = _steps(consumers, "flush")
        self._closers = _steps(consumers, "close")
        self._sink: ThreadedSink[tuple[Exchange, ProbeView | None]] = ThreadedSink(
            "evidence",
            self._handle,
            maxsize=maxsize,
            interval_s=interval_s,
            on_drop=on_drop,
            on_idle=self._flush,
            start=False,
        )
        self._tasks = TaskSet()
        self._pollers: list[asyncio.Task[None]] = []  # the metrics scraper, the info probe

    # Counters, for tests and the admin endpoint.
    @property
    def submitted(self) -> int:
        return self._sink.submitted

    @property
    def dropped(self) -> int:
        """Exchanges dropped because the queue was full."""
        return self._sink.dropped

    @property
    def failed(self) -> int:
        """Exchanges whose evidence could not be built."""
        return self._sink.failed

    @property
    def handled(self) -> int:
        return self._sink.handled

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange``; never blocks, never raises (a full queue drops and counts).

        What the probe knows of the exchange's backends is read here, on the event loop, not
        when the worker gets to it: a worker that lags must not record a configuration change
        that came after the exchange ran (a report splits its evidence at that change)."""
        probe = self.probe
        view = probe.view(leg.backend for leg in exchange.legs) if probe is not None else None
        self._sink.submit((exchange, view))

    async def start(self) -> None:
        """Start the worker thread and the scraper (idempotent)."""
        if self._sink.running:
            return
        self._sink.start()
        if self.scraper is not None:
            self._pollers.append(self._tasks.spawn(self.scraper.run(), name="metrics-scraper"))
        if self.probe is not None:
            self._pollers.append(self._tasks.spawn(self.probe.run(), name="server-info-probe"))

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far was handled and flushed; False on timeout."""
        return await asyncio.to_thread(self._sink.join, timeout_s)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Handle what is queued (within ``timeout_s``), close every consumer, stop the scraper."""
        for task in self._pollers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pollers.clear()
        if not self._sink.running:
            return
        await asyncio.to_thread(self._sink.close, timeout_s)
        for close in self._closers:  # each its own step: one failing close skips no other
            self._call(close)

    async def __aenter__(self) -> EvidenceWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- worker thread -------------------------------------------------------------------------

    def _handle(self, item: tuple[Exchange, ProbeView | None]) -> None:
        exchange, view = item
        evidence = build_evidence(
            exchange, capture_default=self.capture_default, scraper=self.scraper, probe=view
        )  # raising here counts the exchange in ``failed`` (ThreadedSink)
        for handle in self._handlers:
            try:
                handle(evidence)
            except Exception:  # a consumer bug must not starve its peers
                self.consumer_failures += 1
                log.debug("evidence consumer %r failed", handle, exc_info=True)

    def _flush(self) -> None:
        for flush in self._flushers:
            self._call(flush)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # each consumer's flush/close is its own step
            self.consumer_failures += 1
            log.warning("evidence consumer step %r failed", fn, exc_info=True)


def _steps(consumers: Sequence[object], name: str) -> tuple[Callable[[], None], ...]:
    found = (getattr(c, name, None) for c in consumers if isinstance(c, EvidenceConsumer))
    return tuple(step for step in found if callable(step))
