"""Exporter plumbing: counts what the export path drops, so a dead collector shows up as a number.

Sits between the SDK's batching and the OTLP exporters, off the data path: ``Span.end()`` only
appends to the ``BatchSpanProcessor``'s bounded deque, and everything here runs on the SDK's export
threads. The SDK's processor drops silently (a log line) when its queue is full, and its own
``otel.sdk.processor.*`` metrics hang off a global env switch and a private module; instead
:class:`DropCountingSpanProcessor` mirrors the queue's occupancy with two single-writer counters
(spans accepted by ``on_end`` on the caller's thread, spans handed to the exporter on the worker
thread) and counts a drop exactly when the SDK's ``deque(maxlen=…)`` would evict one. The mirror
can over-count by at most one batch in the instant between the worker popping a batch and calling
``export`` — only ever while the queue is full, i.e. while real drops are happening anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_log = logging.getLogger(__name__)

# on_drop(signal, reason, count): signal is "spans" | "metrics".
DropCallback = Callable[[str, str, int], None]


class _QueueMirror:
    """Occupancy of the BatchSpanProcessor's deque, from counters each written by one thread."""

    __slots__ = ("accepted", "dequeued", "evicted")

    def __init__(self) -> None:
        self.accepted = 0  # written by on_end's thread only
        self.evicted = 0  # written by on_end's thread only
        self.dequeued = 0  # written by the export worker only

    def occupancy(self) -> int:
        return self.accepted - self.evicted - self.dequeued


class CountingSpanExporter(SpanExporter):
    """Wraps a span exporter: counts failed exports as dropped spans; never raises."""

    def __init__(
        self, inner: SpanExporter, on_drop: DropCallback, mirror: _QueueMirror | None = None
    ) -> None:
        self._inner = inner
        self._on_drop = on_drop
        self._mirror = mirror

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._mirror is not None:
            self._mirror.dequeued += len(spans)
        try:
            result = self._inner.export(spans)
        except Exception:  # noqa: BLE001 — an exporter bug must not kill the export thread
            _log.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_drop("spans", "export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


class DropCountingSpanProcessor(SpanProcessor):
    """A bounded ``BatchSpanProcessor`` that reports queue-full and after-shutdown drops.

    ``on_end`` must be called from one thread at a time (the gateway ends spans on its event loop).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        on_drop: DropCallback,
        *,
        max_queue_size: int,
        max_export_batch_size: int,
        schedule_delay_s: float,
    ) -> None:
        self._mirror = _QueueMirror()
        self._max_queue_size = max_queue_size
        self._on_drop = on_drop
        self._shutdown = False
        self._batch = BatchSpanProcessor(
            CountingSpanExporter(exporter, on_drop, self._mirror),
            max_queue_size=max_queue_size,
            max_export_batch_size=min(max_export_batch_size, max_queue_size),
            schedule_delay_millis=schedule_delay_s * 1000.0,
        )

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._batch.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if self._shutdown:
            self._on_drop("spans", "shutdown", 1)
            return
        if self._mirror.occupancy() >= self._max_queue_size:
            self._mirror.evicted += 1  # the deque evicts its oldest span to take this one
            self._on_drop("spans", "queue_full", 1)
        self._mirror.accepted += 1
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self._shutdown = True
        self._batch.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._batch.force_flush(timeout_millis)


class CountingMetricExporter(MetricExporter):
    """Wraps a metric exporter: counts the data points of failed exports; never raises.

    Keeps the SDK's default (cumulative) temporality, which is what a collector feeding Prometheus
    expects.
    """

    def __init__(self, inner: MetricExporter, on_drop: DropCallback) -> None:
        super().__init__()
        self._inner = inner
        self._on_drop = on_drop

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:  # noqa: BLE001 — an exporter bug must not kill the reader thread
            _log.debug("metric export raised", exc_info=True)
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._on_drop("metrics", "export_failed", count_data_points(metrics_data))
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def count_data_points(metrics_data: MetricsData) -> int:
    """Number of data points in one export batch."""
    return sum(
        len(metric.data.data_points)
        for resource_metrics in metrics_data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    )
