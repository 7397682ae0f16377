"""Telemetry settings: the standard ``OTEL_*`` environment variables, read once at startup.

:meth:`TelemetrySettings.from_env` validates every variable it reads and names it in the error.
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
from urllib.parse import unquote

from otel import semconv as sc

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
_ON = frozenset({"on", "true", "1", "yes"})
_OFF = frozenset({"off", "false", "0", "no"})


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
    # Which names the GenAI client metrics carry (OTEL_SEMCONV_STABILITY_OPT_IN; otel.semconv).
    genai_names: sc.GenAiNames = "legacy"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TelemetrySettings:
        """Read the standard ``OTEL_*`` variables (plus ``SPECSHADOW_TELEMETRY=off``).

        Raises:
            ValueError: a variable has a value outside its documented set; the message names it.
        """
        env = {k: v.strip() for k, v in environ.items() if v.strip()}
        switch = env.get("SPECSHADOW_TELEMETRY", "on").lower()
        if switch not in _ON | _OFF:
            raise ValueError(
                f"SPECSHADOW_TELEMETRY: expected on/off (or true/false, 1/0, yes/no), got {switch!r}"
            )
        enabled = not (env.get("OTEL_SDK_DISABLED", "").lower() in _TRUE or switch in _OFF)
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
            genai_names=_genai_names(env.get(sc.OPT_IN_ENV, "")),
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


def _genai_names(raw: str) -> sc.GenAiNames:
    """``OTEL_SEMCONV_STABILITY_OPT_IN`` → which GenAI names to emit.

    A comma-separated list shared by every instrumentation of the process: values for other
    categories (``http``, ``database/dup``, …) belong to them and are ignored here.
    """
    values = {v.strip() for v in raw.split(",") if v.strip()}
    if sc.OPT_IN_BOTH in values:
        return "both"
    if sc.OPT_IN_LATEST in values:
        return "latest"
    return "legacy"


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
