"""OpenTelemetry for specshadow: traces, metrics, a Prometheus endpoint — off the data path.

Layout: :mod:`otel.semconv` (every name), :mod:`otel.instruments` (one factory per metric, "measured
from … to …"), :mod:`otel.record` (domain objects → attributes/observations, never raising),
:mod:`otel.telemetry` (the object the gateway holds), :mod:`otel.setup` (``OTEL_*`` settings →
providers), :mod:`otel.prometheus` (pull reader + text exposition), :mod:`otel.export` (drop
counting around the SDK's exporters).
"""

from otel.record import EvaluationResult
from otel.setup import OtlpTarget, TelemetrySettings, build_telemetry
from otel.telemetry import Telemetry

__all__ = ["EvaluationResult", "OtlpTarget", "Telemetry", "TelemetrySettings", "build_telemetry"]
