"""Telemetry: the one object the gateway holds to emit traces and metrics.

Owns a ``TracerProvider`` and a ``MeterProvider`` (never the global ones), the instruments, and the
Prometheus pull reader. Its methods are the gateway-facing API; the domain → attribute mapping
lives in :mod:`otel.record`. Every method is safe to call on the event loop: span operations and
metric records are in-memory, exports happen on SDK threads, and nothing here raises into the
caller. Built by :func:`otel.setup.build_telemetry`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import jsonx
from gateway.exchange import Exchange, LegResult
from otel import instruments as inst, record, semconv as sc
from otel.prometheus import CONTENT_TYPE, PullMetricReader, render
from otel.record import EvaluationResult, nothing, safe

if TYPE_CHECKING:
    from otel.setup import TelemetrySettings

_log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()

PolicyStatus = Callable[[], tuple[int, bool]]  # (generation, last reload succeeded)


def _no_span() -> Span:
    return INVALID_SPAN


def _no_headers() -> dict[str, str]:
    return {}


def _no_status() -> tuple[int, bool] | None:
    return None


class Telemetry:
    """Traces and metrics of one gateway process (or one test app)."""

    def __init__(
        self,
        *,
        settings: TelemetrySettings,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        pull_reader: PullMetricReader | None,
        logger_provider: LoggerProvider | None = None,
        max_chunk_gap_observations: int = 128,
        resource_attributes: Mapping[str, Any] | None = None,
        histograms: inst.HistogramSource | None = None,
    ) -> None:
        self.settings = settings
        self._resource_attributes = resource_attributes
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._logger_provider = logger_provider
        self._record_logger = (
            logger_provider.get_logger(sc.SCOPE_NAME) if logger_provider is not None else None
        )
        self._pull_reader = pull_reader
        self._max_gaps = max_chunk_gap_observations
        self._policy_status: PolicyStatus | None = None
        self._shutdown_done = False
        self.tracer: Tracer = (
            tracer_provider.get_tracer(sc.SCOPE_NAME)
            if tracer_provider is not None
            else trace.NoOpTracerProvider().get_tracer(sc.SCOPE_NAME)
        )
        self.meter: Meter = (meter_provider or NoOpMeterProvider()).get_meter(sc.SCOPE_NAME)
        self.instruments = inst.create_instruments(self.meter, histograms)
        self._policy_gauges = (
            inst.policy_generation(self.meter, self._observe_generation),
            inst.policy_last_reload_success(self.meter, self._observe_reload_success),
        )

    @classmethod
    def disabled(cls, settings: TelemetrySettings) -> Telemetry:
        """A Telemetry whose every call is a no-op (``OTEL_SDK_DISABLED=true``)."""
        return cls(settings=settings, tracer_provider=None, meter_provider=None, pull_reader=None)

    @property
    def enabled(self) -> bool:
        """False for :meth:`disabled` telemetry (no spans, no metrics, no exports)."""
        return self._tracer_provider is not None or self._meter_provider is not None

    # --- spans ------------------------------------------------------------------------------------

    @safe(_no_span)
    def start_request_span(self, *, route: str, method: str, carrier: Mapping[str, str]) -> Span:
        """Start the SERVER span of one gateway request, continuing an incoming ``traceparent``.

        ``carrier`` is the request's headers (any case-insensitive mapping works; aiohttp's
        ``CIMultiDictProxy`` does). ``route`` is the route template, e.g. ``/v1/chat/completions``.
        """
        context = _PROPAGATOR.extract(carrier)
        return self.tracer.start_span(
            record.request_span_name(method, route),
            context=context,
            kind=SpanKind.SERVER,
            attributes={sc.HTTP_ROUTE: route, sc.HTTP_REQUEST_METHOD: method},
        )

    @safe(_no_span)
    def start_leg_span(
        self,
        parent: Span,
        *,
        operation: str,
        model: str | None,
        role: str,
        backend: str,
        server_address: str,
        stream: bool,
        start_unix_ns: int | None = None,
        provider: str = sc.PROVIDER_OPENAI,
    ) -> Span:
        """Start the CLIENT span of one upstream leg, named ``{operation} {model}``.

        End it with :meth:`finish_leg_span` when the leg's stream ends (not when headers arrive).
        A shadow leg may end after its parent request span; it stays in the same trace.
        """
        return self.tracer.start_span(
            record.leg_span_name(operation, model),
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            start_time=start_unix_ns,
            attributes=record.leg_start_attributes(
                operation=operation,
                model=model,
                role=role,
                backend=backend,
                server_address=server_address,
                stream=stream,
                provider=provider,
            ),
        )

    @staticmethod
    def traceparent(span: Span) -> str | None:
        """The W3C ``traceparent`` of ``span`` itself (None for a non-recording no-op span).

        Formatted directly from the span context: cheaper than a propagator round trip, for
        values kept rather than sent (e.g. to parent spans created later off the event loop).
        """
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    @staticmethod
    @safe(_no_headers)
    def traceparent_headers(span: Span) -> dict[str, str]:
        """W3C ``traceparent`` (and ``tracestate``) for the upstream request made under ``span``."""
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return headers

    @staticmethod
    def finish_leg_span(
        span: Span,
        leg: LegResult,
        *,
        end_unix_ns: int,
        capture_text: bool,
        max_chunk_events: int = 0,
    ) -> None:
        """See :func:`otel.record.finish_leg_span`."""
        record.finish_leg_span(
            span,
            leg,
            end_unix_ns=end_unix_ns,
            capture_text=capture_text,
            max_chunk_events=max_chunk_events,
        )

    @staticmethod
    def annotate_request_span(
        span: Span, exchange: Exchange, *, capture_text: bool = False
    ) -> None:
        """See :func:`otel.record.annotate_request_span`."""
        record.annotate_request_span(span, exchange, capture_text=capture_text)

    @staticmethod
    def end_request_span(
        span: Span,
        *,
        status_code: int | None,
        error_type: str | None = None,
        end_unix_ns: int | None = None,
    ) -> None:
        """See :func:`otel.record.end_request_span`."""
        record.end_request_span(
            span, status_code=status_code, error_type=error_type, end_unix_ns=end_unix_ns
        )

    @staticmethod
    def add_evaluation_events(span: Span, results: Sequence[EvaluationResult]) -> None:
        """See :func:`otel.record.add_evaluation_events`."""
        record.add_evaluation_events(span, results)

    # --- metrics ------------------------------------------------------------------------------------

    def record_exchange_metrics(self, exchange: Exchange, *, category: str | None = None) -> None:
        """See :func:`otel.record.record_exchange_metrics`."""
        record.record_exchange_metrics(
            self.instruments,
            exchange,
            category=category,
            max_chunk_gap_observations=self._max_gaps,
        )

    @safe(nothing)
    def count_shadow(
        self, outcome: str, *, role: str, backend: str, reason: str | None = None
    ) -> None:
        """Count one shadow leg event: sampled | sent | completed | failed | dropped (with reason)."""
        attributes = {sc.OUTCOME: outcome, sc.LEG_ROLE: role, sc.BACKEND: backend}
        if reason is not None:
            attributes[sc.REASON] = reason
        self.instruments.shadow_requests.add(1, attributes)

    @safe(nothing)
    def set_breaker_state(self, backend: str, state: int) -> None:
        """Record a circuit breaker transition: 0 closed, 1 half-open, 2 open."""
        self.instruments.breaker_state.set(state, {sc.BACKEND: backend})

    @safe(nothing)
    def count_comparison(self, outcome: str, *, role: str, category: str | None) -> None:
        """Count one shadow-vs-primary comparison outcome (match | diverge | …)."""
        self.instruments.compare_results.add(
            1, {sc.OUTCOME: outcome, sc.LEG_ROLE: role, sc.CATEGORY: category or "none"}
        )

    @safe(nothing)
    def count_policy_reload(self, result: Literal["ok", "error"]) -> None:
        """Count one policy reload attempt."""
        self.instruments.policy_reload.add(1, {sc.RESULT: result})

    def bind_policy_status(self, status: PolicyStatus) -> None:
        """Serve ``specshadow.policy.generation`` and ``…last_reload_success`` from ``status``.

        ``status`` is called at collection time, possibly from the metric export thread: it must be
        cheap and must only read (e.g. two attributes of the policy holder).
        """
        self._policy_status = status

    def count_telemetry_dropped(self, signal: str, reason: str, count: int) -> None:
        """Exporter drop report (called from SDK export threads)."""
        if count > 0:
            self.instruments.telemetry_dropped.add(count, {sc.SIGNAL: signal, sc.REASON: reason})

    def _observe_generation(self, _options: CallbackOptions) -> Iterable[Observation]:
        status = self._read_policy_status()
        return [Observation(status[0])] if status is not None else []

    def _observe_reload_success(self, _options: CallbackOptions) -> Iterable[Observation]:
        status = self._read_policy_status()
        return [Observation(1 if status[1] else 0)] if status is not None else []

    @safe(_no_status)
    def _read_policy_status(self) -> tuple[int, bool] | None:
        return self._policy_status() if self._policy_status is not None else None

    # --- Prometheus and lifecycle ------------------------------------------------------------------

    def render_prometheus(self) -> tuple[bytes, str]:
        """(body, content type) for ``GET /metrics``: text exposition format 0.0.4."""
        if self._pull_reader is None:
            return b"", CONTENT_TYPE
        return render(
            self._pull_reader.collect_now(), resource=self._resource_attributes
        ), CONTENT_TYPE

    # --- records as log records ---------------------------------------------------------------

    @property
    def exports_records(self) -> bool:
        """True when comparison records also leave as OTLP log records (``OTEL_LOGS_EXPORTER``)."""
        return self._record_logger is not None

    @safe(nothing)
    def emit_record(self, record: Mapping[str, Any], *, unix_ns: int | None = None) -> None:
        """One comparison record as an OTLP log record (event ``specshadow.record``).

        The body is the record's JSON (the same document the embedded store keeps, so whatever
        the collector feeds — ClickHouse, object storage — holds the same schema); a few
        low-cardinality fields are repeated as attributes for routing. Batched and exported on
        the SDK's thread; a full queue drops (bounded memory).
        """
        logger = self._record_logger
        if logger is None:
            return
        attributes = {
            sc.RECORD_SCHEMA: str(record.get("schema", "")),
            sc.EXCHANGE_ID: str(record.get("exchange_id", "")),
            sc.CATEGORY: str(record.get("category") or "none"),
        }
        logger.emit(
            timestamp=unix_ns,
            body=jsonx.dumps(record).decode(),
            attributes=attributes,
            event_name=sc.EVENT_RECORD,
        )

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is buffered; returns False if ``timeout_s`` passed first."""
        return self._bounded("otel-flush", self._flush, timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop both providers within ``timeout_s``; returns False if the bound passed.

        The work runs in a daemon thread: a black-holed collector can keep that thread busy until
        the exporter's own timeout, but not the caller.
        """
        if self._shutdown_done:
            return True
        self._shutdown_done = True
        return self._bounded("otel-shutdown", self._shutdown, timeout_s)

    def _flush(self, deadline_s: float) -> None:
        millis = int(max(0.0, deadline_s - time.monotonic()) * 1000)
        if self._tracer_provider is not None:
            self._tracer_provider.force_flush(millis)
        if self._meter_provider is not None:
            self._meter_provider.force_flush(millis)
        if self._logger_provider is not None:
            self._logger_provider.force_flush(millis)

    def _shutdown(self, deadline_s: float) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            millis = max(0.0, deadline_s - time.monotonic()) * 1000
            self._meter_provider.shutdown(timeout_millis=millis)
        if self._logger_provider is not None:
            self._logger_provider.shutdown()

    def _bounded(self, name: str, work: Callable[[float], None], timeout_s: float) -> bool:
        if (
            self._tracer_provider is None
            and self._meter_provider is None
            and self._logger_provider is None
        ):
            return True
        deadline_s = time.monotonic() + timeout_s

        def run() -> None:
            try:
                work(deadline_s)
            except Exception:  # noqa: BLE001 — telemetry teardown must not fail the process
                _log.debug("%s failed", name, exc_info=True)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            _log.warning("%s did not finish within %.1f s; abandoning it", name, timeout_s)
            return False
        return True
