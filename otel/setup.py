"""Setup: telemetry settings from the standard ``OTEL_*`` variables, and the providers they build.

Runs once at startup, before the app (``create_app(settings, telemetry)``); nothing here is on the
request path. No global provider is ever set: the returned :class:`~otel.telemetry.Telemetry` owns
its ``TracerProvider`` and ``MeterProvider``, so several apps (and tests) live in one process.

Failure model (docs/telemetry.md): spans go through a bounded ``BatchSpanProcessor`` (``Span.end()`` is a
deque append; a full queue evicts and counts), metrics through a ``PeriodicExportingMetricReader``
thread; exporter timeouts are short; ``Telemetry.shutdown(timeout_s)`` runs the flush in a thread
and returns when the bound passes, so a black-holed collector cannot hang process exit.

The settings themselves (``OTEL_*`` → :class:`~otel.settings.TelemetrySettings`) are read in
:mod:`otel.settings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import LogRecordExporter as LogExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.version import __version__ as sdk_version

from otel import semconv as sc
from otel.export import CountingMetricExporter, DropCallback, DropCountingSpanProcessor
from otel.histograms import HistogramTable, sdk_seams_present
from otel.prometheus import PullMetricReader
from otel.settings import OtlpTarget, TelemetrySettings
from otel.telemetry import Telemetry


def build_telemetry(
    settings: TelemetrySettings,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
    pull_reader: PullMetricReader | None = None,
    process_attributes: Mapping[str, str | int] | None = None,
) -> Telemetry:
    """Build the providers, exporters and instruments described by ``settings``.

    Args:
        span_exporter: an extra exporter (tests: ``InMemorySpanExporter``), attached with a
            ``SimpleSpanProcessor`` so spans are visible the moment they end.
        metric_reader: an extra reader (tests: ``InMemoryMetricReader``).
        pull_reader: the reader ``GET /metrics`` collects through (a worker of ``serve
            --workers N``: :class:`otel.multiproc.FleetPullReader`); default a plain one.
        process_attributes: resource attributes of this process only (a worker's
            ``service.instance.id`` and ``specshadow.worker.index``): on what it exports over
            OTLP, which must tell the workers apart, not on ``/metrics``' ``target_info``,
            which describes the whole gateway.
    """
    if not settings.enabled:
        return Telemetry.disabled(settings)
    gateway = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": sdk_version,
        **settings.resource_attributes,
        sc.SERVICE_NAME: settings.service_name,
    }
    resource = Resource({**gateway, **(process_attributes or {})})
    relay = _DropRelay()  # exporters are built before the counter they report into
    readers: list[MetricReader] = []
    pull = (pull_reader or PullMetricReader()) if settings.prometheus else None
    if pull is not None:
        readers.append(pull)
    if settings.metrics is not None:
        readers.append(
            PeriodicExportingMetricReader(
                CountingMetricExporter(_metric_exporter(settings.metrics), relay),
                export_interval_millis=settings.metric_export_interval_s * 1000.0,
                export_timeout_millis=settings.metric_export_timeout_s * 1000.0,
            )
        )
    if metric_reader is not None:
        readers.append(metric_reader)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource)
    # Histograms are aggregated by specshadow (~1 µs a value, the SDK's record ~14 µs) and merged
    # into what every reader collects: see otel/histograms.py.
    # If a future SDK dropped the private seams the table needs, the SDK's own (slower)
    # histograms take over: same data, more CPU.
    histograms = None
    if sdk_seams_present():
        histograms = HistogramTable(resource=resource, scope=InstrumentationScope(sc.SCOPE_NAME))
        for reader in readers:
            histograms.attach(reader)
    # No span is built when nothing would receive it: with no trace exporter the tracer is a
    # no-op (spans cost ~190 µs per request even unexported — profiled), and traceparent is
    # still forwarded from the client's own header by the no-op span's context.
    tracer_provider = (
        TracerProvider(resource=resource, sampler=_sampler(settings))
        if settings.traces is not None or span_exporter is not None
        else None
    )
    telemetry = Telemetry(
        settings=settings,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        logger_provider=_logger_provider(settings.logs, resource) if settings.logs else None,
        pull_reader=pull,
        max_chunk_gap_observations=settings.max_chunk_gap_observations,
        resource_attributes=dict(Resource(gateway).attributes),
        histograms=histograms,
    )
    relay.target = telemetry.count_telemetry_dropped
    if settings.traces is not None and tracer_provider is not None:
        tracer_provider.add_span_processor(
            DropCountingSpanProcessor(
                _span_exporter(settings.traces),
                relay,
                max_queue_size=settings.span_queue_size,
                max_export_batch_size=settings.span_batch_size,
                schedule_delay_s=settings.span_schedule_delay_s,
            )
        )
    if span_exporter is not None and tracer_provider is not None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    return telemetry


class _DropRelay:
    """Forwards exporter drop reports to a Telemetry's counter once it exists."""

    __slots__ = ("target",)

    def __init__(self) -> None:
        self.target: DropCallback | None = None

    def __call__(self, signal: str, reason: str, count: int) -> None:
        if self.target is not None:
            self.target(signal, reason, count)


def _sampler(settings: TelemetrySettings) -> Sampler:
    ratio = TraceIdRatioBased(settings.sampler_arg if settings.sampler_arg is not None else 1.0)
    root: Sampler = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": ratio,
        "parentbased_always_on": ParentBased(ALWAYS_ON),
        "parentbased_always_off": ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": ParentBased(ratio),
    }[settings.sampler]
    return root


def _span_exporter(target: OtlpTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(
            endpoint=target.endpoint,
            insecure=_insecure(target.endpoint),
            headers=dict(target.headers),
            timeout=target.timeout_s,
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(
        endpoint=target.endpoint, headers=dict(target.headers), timeout=target.timeout_s
    )


def _metric_exporter(target: OtlpTarget) -> MetricExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter(
            endpoint=target.endpoint,
            insecure=_insecure(target.endpoint),
            headers=dict(target.headers),
            timeout=target.timeout_s,
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(
        endpoint=target.endpoint, headers=dict(target.headers), timeout=target.timeout_s
    )


def _logger_provider(target: OtlpTarget, resource: Resource) -> LoggerProvider:
    """Comparison records as OTLP log records, batched on the SDK's export thread."""
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    exporter: LogExporter
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
            OTLPLogExporter as GrpcLogExporter,
        )

        exporter = GrpcLogExporter(
            endpoint=target.endpoint,
            insecure=_insecure(target.endpoint),
            headers=dict(target.headers),
            timeout=target.timeout_s,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import (
            OTLPLogExporter as HttpLogExporter,
        )

        exporter = HttpLogExporter(
            endpoint=target.endpoint, headers=dict(target.headers), timeout=target.timeout_s
        )
    provider = LoggerProvider(resource=resource)
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter, max_queue_size=4096))
    return provider


def _insecure(endpoint: str) -> bool:
    return urlsplit(endpoint).scheme != "https"
