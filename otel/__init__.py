"""OpenTelemetry for specshadow: traces, metrics, a Prometheus endpoint and records as logs — off
the data path.

Layout: :mod:`otel.semconv` (every name), :mod:`otel.instruments` (one factory per metric,
"measured from … to …"), :mod:`otel.histograms` (specshadow-aggregated histograms),
:mod:`otel.attributes` (domain values → attributes, pure), :mod:`otel.telemetry` (the one API the
gateway and the evidence worker call), :mod:`otel.settings` (``OTEL_*`` → settings),
:mod:`otel.setup` (settings → providers), :mod:`otel.prometheus` (pull reader + text exposition),
:mod:`otel.export` (drop counting around the SDK's exporters).

Builds on :mod:`core` only. Import the module you need (``from otel.setup import
build_telemetry``): this file re-exports nothing, so no import order matters.
"""
