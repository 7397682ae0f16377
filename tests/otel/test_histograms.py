"""HistogramTable: the same data points the SDK's own histogram aggregation would export."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics import Histogram as HistogramInstrument, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel.histograms import OVERFLOW_KEY, HistogramTable

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)
SCOPE = "specshadow-test"


def table_with_reader(
    *, temporality: AggregationTemporality = AggregationTemporality.CUMULATIVE, limit: int = 2000
) -> tuple[HistogramTable, InMemoryMetricReader, MeterProvider]:
    reader = InMemoryMetricReader(preferred_temporality={HistogramInstrument: temporality})
    resource = Resource({"service.name": "t"})
    provider = MeterProvider(metric_readers=[reader], resource=resource)
    table = HistogramTable(
        resource=resource, scope=InstrumentationScope(SCOPE), cardinality_limit=limit
    )
    table.attach(reader)
    return table, reader, provider


def points(data: MetricsData | None, name: str) -> list[HistogramDataPoint]:
    if data is None:  # nothing to export at all
        return []
    return [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
        if isinstance(point, HistogramDataPoint)
    ]


def sdk_points(values: Sequence[float], attributes: dict[str, Any]) -> list[HistogramDataPoint]:
    """Ground truth: the SDK's own explicit-bucket aggregation of the same values."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    hist = provider.get_meter(SCOPE).create_histogram(
        "h", explicit_bucket_boundaries_advisory=BOUNDS
    )
    for value in values:
        hist.record(value, attributes)
    try:
        return points(reader.get_metrics_data(), "h")
    finally:
        provider.shutdown()


def test_buckets_sum_count_min_max_match_the_sdks_aggregation_of_the_same_values() -> None:
    rng = random.Random(7)
    values = [rng.choice([*BOUNDS, 0.0]) for _ in range(50)]  # boundary values: le is inclusive
    values += [rng.uniform(0, 2) for _ in range(500)]
    attributes = {"gen_ai.operation.name": "chat", "specshadow.leg.role": "primary"}
    table, reader, provider = table_with_reader()
    hist = table.create_histogram("h", "s", "d", explicit_bucket_boundaries_advisory=BOUNDS)
    hist.record_many(values[:100], attributes)
    for value in values[100:]:
        hist.record(value, attributes)

    (ours,) = points(reader.get_metrics_data(), "h")
    (truth,) = sdk_points(values, attributes)
    assert list(ours.bucket_counts) == list(truth.bucket_counts)
    assert list(ours.explicit_bounds) == list(truth.explicit_bounds)
    assert ours.count == truth.count == 550
    assert math.isclose(ours.sum, truth.sum)
    assert (ours.min, ours.max) == (truth.min, truth.max)
    assert dict(ours.attributes or {}) == attributes
    provider.shutdown()


def test_the_same_attributes_in_another_order_are_one_series() -> None:
    table, reader, provider = table_with_reader()
    hist = table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    hist.record(0.002, {"a": "1", "b": "2"})
    hist.record(0.003, {"b": "2", "a": "1"})
    hist.record(0.004, {"a": "1", "b": "3"})
    got = sorted(
        ((p.attributes or {})["b"], p.count) for p in points(reader.get_metrics_data(), "h")
    )
    assert got == [("2", 2), ("3", 1)]
    provider.shutdown()


def test_negative_and_non_finite_values_are_ignored_like_the_sdk_does() -> None:
    table, reader, provider = table_with_reader()
    hist = table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    hist.record_many([-1.0, math.nan, math.inf, 0.5], {"k": "v"})
    (point,) = points(reader.get_metrics_data(), "h")
    assert (point.count, point.sum, point.min, point.max) == (1, 0.5, 0.5, 0.5)
    provider.shutdown()


def test_a_delta_reader_gets_what_happened_since_its_last_collection() -> None:
    table, reader, provider = table_with_reader(temporality=AggregationTemporality.DELTA)
    hist = table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    hist.record_many([0.002, 0.002, 0.5], {"k": "v"})
    (first,) = points(reader.get_metrics_data(), "h")
    hist.record(0.02, {"k": "v"})
    (second,) = points(reader.get_metrics_data(), "h")
    assert first.count == 3 and second.count == 1
    assert math.isclose(second.sum, 0.02)
    assert sum(second.bucket_counts) == 1
    assert second.start_time_unix_nano == first.time_unix_nano
    assert points(reader.get_metrics_data(), "h") == []  # nothing new, no point
    provider.shutdown()


def test_a_cumulative_reader_keeps_counting_from_the_start() -> None:
    table, reader, provider = table_with_reader()
    hist = table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    hist.record(0.002, {"k": "v"})
    (first,) = points(reader.get_metrics_data(), "h")
    hist.record(0.002, {"k": "v"})
    (second,) = points(reader.get_metrics_data(), "h")
    assert (first.count, second.count) == (1, 2)
    assert first.start_time_unix_nano == second.start_time_unix_nano
    provider.shutdown()


def test_attribute_sets_past_the_cardinality_limit_share_one_overflow_series() -> None:
    table, reader, provider = table_with_reader(limit=3)
    hist = table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    for i in range(10):
        hist.record(0.002, {"user": str(i)})
    got = points(reader.get_metrics_data(), "h")
    assert len(got) == 4
    (overflow,) = [p for p in got if dict(p.attributes or {}) == dict(OVERFLOW_KEY)]
    assert overflow.count == 7
    provider.shutdown()


def test_table_histograms_sit_beside_the_sdks_own_instruments_in_one_scope() -> None:
    table, reader, provider = table_with_reader()
    provider.get_meter(SCOPE).create_counter("c").add(1)
    table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS).record(0.01)
    data = reader.get_metrics_data()
    assert data is not None
    (rm,) = data.resource_metrics
    (sm,) = rm.scope_metrics
    assert sm.scope.name == SCOPE
    assert sorted(m.name for m in sm.metrics) == ["c", "h"]
    assert rm.resource.attributes["service.name"] == "t"
    provider.shutdown()


def test_an_sdk_with_nothing_recorded_still_exports_the_tables_histograms() -> None:
    table, reader, provider = table_with_reader()
    table.create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS).record(0.01, {"k": 1})
    (point,) = points(reader.get_metrics_data(), "h")
    assert point.count == 1
    provider.shutdown()


def test_an_observed_counter_exports_a_monotonic_sum_of_adds_from_several_threads() -> None:
    import threading

    from opentelemetry.sdk.metrics.export import Sum

    from otel.instruments import ObservedCounter

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    counter = ObservedCounter(provider.get_meter(SCOPE), "c", unit="{x}", description="d")

    def bump() -> None:
        for _ in range(1000):
            counter.add(1, {"outcome": "sent", "role": "candidate"})
            counter.add(2, {"role": "candidate", "outcome": "sampled"})

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert isinstance(metric.data, Sum) and metric.data.is_monotonic
    got = {(p.attributes or {})["outcome"]: p.value for p in metric.data.data_points}
    assert got == {"sent": 4000, "sampled": 8000}
    provider.shutdown()


def test_the_sdk_pin_in_pyproject_is_the_range_the_table_was_tested_with() -> None:
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from otel.histograms import TESTED_SDK, sdk_seams_present

    pyproject = tomllib.loads(
        (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    )
    pins = {
        req.name: req.specifier
        for req in map(Requirement, pyproject["project"]["dependencies"])
        if req.name.startswith("opentelemetry-")
    }
    assert pins == {
        "opentelemetry-sdk": SpecifierSet(TESTED_SDK),
        "opentelemetry-exporter-otlp": SpecifierSet(TESTED_SDK),
    }
    assert version("opentelemetry-sdk") in SpecifierSet(TESTED_SDK)
    assert sdk_seams_present()
