"""Histograms aggregated by specshadow itself, merged into every metric reader's collection.

Why not the SDK's ``Histogram.record``: it re-validates and re-hashes the attribute dict on every
call — about 14 µs per value on the benchmark machine, and one streamed leg records 12 to 140
values (profiled; docs/benchmarks.md). That made metric recording the largest single cost of the
gateway's telemetry. A :class:`HistogramTable` keeps, per instrument and attribute set, exactly
what the SDK's explicit-bucket aggregation keeps (bucket counts, sum, count, min, max) at about
1 µs per value, and :meth:`HistogramTable.attach` makes each reader's collection return the SDK's
own metrics *plus* these as ordinary ``HistogramDataPoint``\\ s — cumulative, or delta for a reader
that prefers delta. The Prometheus renderer, the OTLP exporters and the in-memory readers of the
tests see the same ``MetricsData`` they always did.

Like the SDK: values that are negative or not finite are ignored, and an instrument holds at most
``cardinality_limit`` attribute sets; later sets land in one ``otel.metric.overflow=true`` series.
Recording and collecting may run on different threads (one lock; recording never waits on I/O).

It leans on three private seams of the OTel SDK — ``MetricReader._collect``,
``MetricReader._set_collect_callback`` and ``sdk.metrics._internal.instrument._Histogram`` (the
key of a reader's preferred temporality) — so the SDK is pinned in ``pyproject.toml`` to
:data:`TESTED_SDK` (a test holds the two together and checks the seams exist).
:func:`sdk_seams_present` lets setup fall back to the SDK's own histograms if they ever vanish.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

# The reader's temporality preferences are keyed by the SDK's instrument class.
from opentelemetry.sdk.metrics import _internal as sdk_internal
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util.types import AttributeValue

AttributeKey = tuple[tuple[str, AttributeValue], ...]
OVERFLOW_KEY: AttributeKey = (("otel.metric.overflow", True),)
DEFAULT_CARDINALITY_LIMIT = 2000
# The SDK's default explicit-bucket boundaries.
DEFAULT_BOUNDS: tuple[float, ...] = (
    0, 5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000,
)  # fmt: skip
# The opentelemetry-sdk releases this module was tested with (pyproject.toml pins the same range).
TESTED_SDK = ">=1.45,<1.46"


def sdk_seams_present() -> bool:
    """True when the installed SDK still has the private seams :class:`HistogramTable` uses."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    instrument = getattr(sdk_internal, "instrument", None)
    reader = InMemoryMetricReader()
    return (
        instrument is not None
        and hasattr(instrument, "_Histogram")
        and hasattr(reader, "_collect")
        and callable(getattr(reader, "_set_collect_callback", None))
    )


@dataclass(slots=True)
class _Series:
    """One attribute set of one instrument: the explicit-bucket aggregation's state."""

    counts: list[int]
    sum: float = 0.0
    count: int = 0
    min: float = math.inf
    max: float = -math.inf

    def copy(self) -> _Series:
        return _Series(list(self.counts), self.sum, self.count, self.min, self.max)


@dataclass(slots=True)
class _Instrument:
    name: str
    unit: str
    description: str
    bounds: tuple[float, ...]
    series: dict[AttributeKey, _Series] = field(default_factory=dict)


def attribute_key(attributes: Mapping[str, AttributeValue] | None) -> AttributeKey:
    """The series key of an attribute set: independent of the mapping's insertion order."""
    return tuple(sorted(attributes.items())) if attributes else ()


class TableHistogram:
    """One histogram instrument of a :class:`HistogramTable`; the SDK ``Histogram`` call shape."""

    __slots__ = ("_instrument", "_table")

    def __init__(self, table: HistogramTable, instrument: _Instrument) -> None:
        self._table = table
        self._instrument = instrument

    @property
    def name(self) -> str:
        return self._instrument.name

    def record(self, amount: float, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.record_many((amount,), attributes)

    def record_many(
        self, amounts: Iterable[float], attributes: Mapping[str, AttributeValue] | None = None
    ) -> None:
        """Several values with one attribute set (the key is built once)."""
        inst = self._instrument
        key = attribute_key(attributes)
        bounds = inst.bounds
        with self._table.lock:
            series = inst.series.get(key)
            if series is None:
                series = self._table.new_series(inst, key)
            counts = series.counts
            for amount in amounts:
                if not (amount >= 0.0 and amount < math.inf):  # also rejects NaN
                    continue
                counts[bisect_left(bounds, amount)] += 1
                series.sum += amount
                series.count += 1
                if amount < series.min:
                    series.min = amount
                if amount > series.max:
                    series.max = amount


class HistogramTable:
    """Explicit-bucket histograms keyed by attribute set; see the module docstring."""

    def __init__(
        self,
        *,
        resource: Resource,
        scope: InstrumentationScope,
        cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT,
    ) -> None:
        self.resource = resource
        self.scope = scope
        self.cardinality_limit = cardinality_limit
        self.lock = threading.Lock()
        self.start_unix_ns = time.time_ns()
        self._instruments: dict[str, _Instrument] = {}
        # Per delta reader: the cumulative state it last exported, and when.
        self._last: dict[int, tuple[int, dict[tuple[str, AttributeKey], _Series]]] = {}

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> TableHistogram:
        """The instrument ``name`` (``Meter.create_histogram``'s shape; same name → same one)."""
        bounds = tuple(explicit_bucket_boundaries_advisory or DEFAULT_BOUNDS)
        with self.lock:
            inst = self._instruments.get(name)
            if inst is None:
                inst = _Instrument(name, unit, description, bounds)
                self._instruments[name] = inst
        return TableHistogram(self, inst)

    def new_series(self, inst: _Instrument, key: AttributeKey) -> _Series:
        """Called with :attr:`lock` held."""
        if len(inst.series) >= self.cardinality_limit and key not in inst.series:
            key = OVERFLOW_KEY
            existing = inst.series.get(key)
            if existing is not None:
                return existing
        series = _Series([0] * (len(inst.bounds) + 1))
        inst.series[key] = series
        return series

    # --- collection ----------------------------------------------------------------------------

    def attach(self, reader: MetricReader) -> None:
        """Make ``reader``'s collections include this table (call after the MeterProvider took it).

        The SDK gives a reader its collect callback when a ``MeterProvider`` registers it; this
        wraps that callback, so ``reader.collect()`` — pull, periodic export, or a test's
        ``get_metrics_data()`` — returns the SDK's metrics with this table's merged in.
        """
        # The SDK types this callback loosely (it returns MetricsData | None): Any here.
        inner: Any = reader._collect  # the one seam the SDK offers for this
        if inner is None:
            raise ValueError("attach a reader after it was registered with a MeterProvider")

        def collect(r: MetricReader, timeout_millis: float = 10_000) -> MetricsData | None:
            data = inner(r, timeout_millis=timeout_millis)
            return self.merge(data, self.metrics(_temporality(r), reader_id=id(r)))

        reader._set_collect_callback(cast(Any, collect))

    def metrics(self, temporality: AggregationTemporality, *, reader_id: int = 0) -> list[Metric]:
        """One ``Metric`` per instrument that has data, as of now."""
        now = time.time_ns()
        with self.lock:
            snapshot = {
                (inst.name, key): series.copy()
                for inst in self._instruments.values()
                for key, series in inst.series.items()
            }
            instruments = list(self._instruments.values())
        start_ns = self.start_unix_ns
        if temporality is AggregationTemporality.DELTA:
            start_ns, previous = self._last.get(reader_id, (self.start_unix_ns, {}))
            self._last[reader_id] = (now, snapshot)
            snapshot = _delta(snapshot, previous)
        out = []
        for inst in instruments:
            points = [
                HistogramDataPoint(
                    attributes=dict(key),
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now,
                    count=series.count,
                    sum=series.sum,
                    bucket_counts=series.counts,
                    explicit_bounds=inst.bounds,
                    min=series.min,
                    max=series.max,
                )
                for (name, key), series in snapshot.items()
                if name == inst.name and series.count
            ]
            if points:
                out.append(
                    Metric(
                        name=inst.name,
                        description=inst.description,
                        unit=inst.unit,
                        data=Histogram(data_points=points, aggregation_temporality=temporality),
                    )
                )
        return out

    def merge(self, data: MetricsData | None, metrics: list[Metric]) -> MetricsData | None:
        """``data`` with ``metrics`` added to this table's scope (created when absent)."""
        if not metrics:
            return data
        if data is None or not data.resource_metrics:
            scope = ScopeMetrics(scope=self.scope, metrics=metrics, schema_url="")
            return MetricsData([ResourceMetrics(self.resource, [scope], schema_url="")])
        first, *rest = data.resource_metrics
        scopes = list(first.scope_metrics)
        for i, scope_metrics in enumerate(scopes):
            if scope_metrics.scope.name == self.scope.name:
                scopes[i] = replace(scope_metrics, metrics=[*scope_metrics.metrics, *metrics])
                break
        else:
            scopes.append(ScopeMetrics(scope=self.scope, metrics=metrics, schema_url=""))
        return MetricsData([replace(first, scope_metrics=scopes), *rest])


def _temporality(reader: MetricReader) -> AggregationTemporality:
    preferred = reader._instrument_class_temporality
    return preferred.get(sdk_internal.instrument._Histogram, AggregationTemporality.CUMULATIVE)


def _delta(
    now: dict[tuple[str, AttributeKey], _Series], before: dict[tuple[str, AttributeKey], _Series]
) -> dict[tuple[str, AttributeKey], _Series]:
    """What happened since ``before``. min/max stay those of all time (a delta has none)."""
    out = {}
    for key, series in now.items():
        prev = before.get(key)
        if prev is None:
            out[key] = series
            continue
        out[key] = _Series(
            [a - b for a, b in zip(series.counts, prev.counts, strict=True)],
            series.sum - prev.sum,
            series.count - prev.count,
            series.min,
            series.max,
        )
    return out
