"""Setup: telemetry settings from the standard ``OTEL_*`` variables, and the providers they build.

Runs once at startup, before the app (``create_app(settings, telemetry)``); nothing here is on the
request path. No global provider is ever set: the returned :class:`~otel.telemetry.Telemetry` owns
its ``TracerProvider`` and ``MeterProvider``, so several apps (and tests) live in one process.

Failure model (DESIGN §6): spans go through a bounded ``BatchSpanProcessor`` (``Span.end()`` is a
deque append; a full queue evicts and counts), metrics through a ``PeriodicExportingMetricReader``
thread; exporter timeouts are short; ``Telemetry.shutdown(timeout_s)`` runs the flush in a thread
and returns when the bound passes, so a black-holed collector cannot hang process exit.

Deviation from the OTel SDK's autoconfiguration, on purpose: with no ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER`` set, OTLP export is on only when an endpoint variable is set (a gateway
without a collector should not retry ``localhost:4318`` forever); set the exporter variable to
``otlp`` to use the spec's default endpoint. ``/metrics`` (Prometheus) is served whenever telemetry
is enabled, unless ``OTEL_METRICS_EXPORTER`` is exactly ``none``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

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
from otel.histograms import HistogramTable
from otel.prometheus import PullMetricReader
from otel.telemetry import Telemetry

Protocol = Literal["grpc", "http/protobuf"]
_PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_TRUE = {"true", "1", "yes", "on"}


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """Where one signal is exported: a full URL for HTTP, ``scheme://host:port`` for gRPC."""

    endpoint: str
    protocol: Protocol
    headers: Mapping[str, str]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """Process-lifetime telemetry settings. Build with :meth:`from_env` or directly in tests."""

    enabled: bool = True
    service_name: str = sc.DEFAULT_SERVICE_NAME
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    traces: OtlpTarget | None = None  # None: no OTLP span export
    metrics: OtlpTarget | None = None  # None: no OTLP metric export
    logs: OtlpTarget | None = None  # None: comparison records do not leave as OTLP log records
    prometheus: bool = True  # serve render_prometheus() (GET /metrics)
    sampler: str = "parentbased_always_on"
    sampler_arg: float | None = None
    metric_export_interval_s: float = 60.0
    metric_export_timeout_s: float = 5.0
    span_queue_size: int = 2048  # OTEL_BSP_MAX_QUEUE_SIZE: spans held while the collector is slow
    span_batch_size: int = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    span_schedule_delay_s: float = (
        1.0  # OTEL_BSP_SCHEDULE_DELAY (spec default 5 s; 1 s is livelier)
    )
    max_chunk_gap_observations: int = 128  # per leg, for time_per_output_chunk

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TelemetrySettings:
        """Read the standard ``OTEL_*`` variables (plus ``SPECSHADOW_TELEMETRY=off``).

        Raises:
            ValueError: a variable has a value outside its documented set; the message names it.
        """
        env = {k: v.strip() for k, v in environ.items() if v.strip()}
        enabled = not (
            env.get("OTEL_SDK_DISABLED", "").lower() in _TRUE
            or env.get("SPECSHADOW_TELEMETRY", "on").lower() in {"off", "false", "0", "no"}
        )
        resource = _parse_pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
        service_name = env.get("OTEL_SERVICE_NAME") or resource.pop(
            sc.SERVICE_NAME, sc.DEFAULT_SERVICE_NAME
        )
        resource.pop(sc.SERVICE_NAME, None)
        timeout_s = _ms(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 3000.0)

        sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
        if sampler not in _SAMPLERS:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER: expected one of {', '.join(_SAMPLERS)}, got {sampler!r}"
            )
        sampler_arg: float | None = None
        if "traceidratio" in sampler:
            sampler_arg = _float(env, "OTEL_TRACES_SAMPLER_ARG", 1.0)
            if not 0.0 <= sampler_arg <= 1.0:
                raise ValueError(
                    f"OTEL_TRACES_SAMPLER_ARG: expected 0 <= ratio <= 1, got {sampler_arg}"
                )

        return cls(
            enabled=enabled,
            service_name=service_name,
            resource_attributes=resource,
            traces=_target(env, "TRACES", "/v1/traces", timeout_s),
            metrics=_target(env, "METRICS", "/v1/metrics", timeout_s),
            logs=_target(env, "LOGS", "/v1/logs", timeout_s),
            prometheus=_exporters(env, "OTEL_METRICS_EXPORTER") != {"none"},
            sampler=sampler,
            sampler_arg=sampler_arg,
            metric_export_interval_s=_ms(env, "OTEL_METRIC_EXPORT_INTERVAL", 60_000.0),
            metric_export_timeout_s=_ms(env, "OTEL_METRIC_EXPORT_TIMEOUT", 5_000.0),
            span_queue_size=int(_float(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)),
            span_batch_size=int(_float(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
            span_schedule_delay_s=_ms(env, "OTEL_BSP_SCHEDULE_DELAY", 1000.0),
        )


def build_telemetry(
    settings: TelemetrySettings,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Telemetry:
    """Build the providers, exporters and instruments described by ``settings``.

    Args:
        span_exporter: an extra exporter (tests: ``InMemorySpanExporter``), attached with a
            ``SimpleSpanProcessor`` so spans are visible the moment they end.
        metric_reader: an extra reader (tests: ``InMemoryMetricReader``).
    """
    if not settings.enabled:
        return Telemetry.disabled(settings)
    resource = Resource(
        {
            "telemetry.sdk.language": "python",
            "telemetry.sdk.name": "opentelemetry",
            "telemetry.sdk.version": sdk_version,
            **settings.resource_attributes,
            sc.SERVICE_NAME: settings.service_name,
        }
    )
    relay = _DropRelay()  # exporters are built before the counter they report into
    readers: list[MetricReader] = []
    pull = PullMetricReader() if settings.prometheus else None
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
        resource_attributes=dict(resource.attributes),
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


def _target(
    env: Mapping[str, str], signal: str, http_path: str, timeout_s: float
) -> OtlpTarget | None:
    """The OTLP target of one signal, or None when that signal's OTLP export is off."""
    exporters = _exporters(env, f"OTEL_{signal}_EXPORTER")
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    supported = {"otlp", "none"} | ({"prometheus"} if signal == "METRICS" else set())
    if exporters - supported:
        raise ValueError(
            f"OTEL_{signal}_EXPORTER: supported values are {', '.join(sorted(supported))}; "
            f"got {', '.join(sorted(exporters - supported))}"
        )
    if "otlp" not in exporters and (exporters or (specific is None and generic is None)):
        return None
    raw_protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    protocol = next((p for p in _PROTOCOLS if p == raw_protocol), None)
    if protocol is None:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: expected grpc or http/protobuf, got {raw_protocol!r}"
        )
    if specific is not None:
        endpoint = specific  # signal-specific endpoints are used as given (spec)
    elif protocol == "grpc":
        endpoint = generic or "http://localhost:4317"
    else:
        endpoint = (generic or "http://localhost:4318").rstrip("/") + http_path
    headers = _parse_pairs(env.get("OTEL_EXPORTER_OTLP_HEADERS", ""), "OTEL_EXPORTER_OTLP_HEADERS")
    headers |= _parse_pairs(
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_HEADERS", ""), f"OTEL_EXPORTER_OTLP_{signal}_HEADERS"
    )
    timeout_s = _ms(env, f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT", timeout_s * 1000.0)
    return OtlpTarget(endpoint=endpoint, protocol=protocol, headers=headers, timeout_s=timeout_s)


def _exporters(env: Mapping[str, str], name: str) -> set[str]:
    return {part.strip().lower() for part in env.get(name, "").split(",") if part.strip()}


def _parse_pairs(raw: str, name: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` with percent-encoded values (W3C Baggage-like, as the OTel spec says)."""
    pairs: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"{name}: expected key=value pairs separated by commas, got {item.strip()!r}"
            )
        pairs[unquote(key.strip())] = unquote(value.strip())
    return pairs


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative number, got {raw!r}")
    return value


def _ms(env: Mapping[str, str], name: str, default_ms: float) -> float:
    """A millisecond variable, returned in seconds."""
    return _float(env, name, default_ms) / 1000.0
