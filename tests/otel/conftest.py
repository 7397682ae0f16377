"""Fixtures for telemetry tests: a Telemetry wired to in-memory sinks, and the real receivers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from otel.telemetry import Telemetry


@dataclass
class InMemoryTelemetry:
    telemetry: Telemetry
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader


@pytest.fixture
def mem() -> Iterator[InMemoryTelemetry]:
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    telemetry = build_telemetry(TelemetrySettings(), span_exporter=spans, metric_reader=reader)
    yield InMemoryTelemetry(telemetry, spans, reader)
    assert telemetry.shutdown(timeout_s=5.0)
