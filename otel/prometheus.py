"""Prometheus: a pull reader per Telemetry and a pure renderer to the text exposition format 0.0.4.

Why not ``opentelemetry-exporter-prometheus``: its ``PrometheusMetricReader`` registers a collector
in ``prometheus_client``'s process-global ``REGISTRY``, so two apps (two Telemetry objects) in one
process collide, and a test suite that builds many apps leaks collectors. Here each Telemetry owns a
:class:`PullMetricReader` (collect on demand, cumulative temporality) and :func:`render` turns the
SDK's ``MetricsData`` into text with the OTel → Prometheus translation rules: dots and other
invalid characters → ``_``; unit ``s`` → ``_seconds`` suffix, ``{annotations}`` dropped; monotonic
sums → counters with ``_total``; histograms → ``_bucket{le=…}`` (cumulative) / ``_sum`` /
``_count``; resource attributes → one ``target_info`` gauge. It is pure, so it is tested on its own
and its output is checked with ``promtool check metrics`` and scraped by a real Prometheus.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    Sum,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_REPEATED_UNDERSCORES = re.compile(r"__+")
_UNIT_ANNOTATION = re.compile(r"\{[^}]*\}")
# OTel unit → Prometheus suffix (the subset specshadow uses, plus the usual time/byte units).
_UNIT_SUFFIXES = {
    "s": "seconds",
    "ms": "milliseconds",
    "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes",
    "%": "percent",
}


class PullMetricReader(MetricReader):
    """Collects only when asked (``GET /metrics``); holds no data between scrapes."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._latest: MetricsData | None = None

    def collect_now(self) -> MetricsData | None:
        """Run one collection and return its data (``None`` if the provider is shut down)."""
        with self._lock:
            self._latest = None
            self.collect()
            data, self._latest = self._latest, None
        return data

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        self._latest = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


def metric_name(name: str, unit: str | None, *, counter: bool) -> str:
    """The Prometheus name of an OTel metric: ``gen_ai.client.operation.duration``, ``s`` →
    ``gen_ai_client_operation_duration_seconds``."""
    base = _sanitize(name, _INVALID_NAME_CHARS)
    suffix = _unit_suffix(unit)
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if counter and not base.endswith("_total"):
        base = f"{base}_total"
    return base


def label_name(key: str) -> str:
    """The Prometheus label of an OTel attribute key: ``specshadow.leg.role`` → ``specshadow_leg_role``."""
    label = _sanitize(key, _INVALID_LABEL_CHARS)
    if label[:1].isdigit():
        label = "key_" + label
    return label


def render(data: MetricsData | None, *, resource: Mapping[str, Any] | None = None) -> bytes:
    """Render collected metrics as Prometheus text exposition format 0.0.4.

    ``resource`` (the provider's resource attributes) becomes ``target_info`` even before any
    metric has been recorded; without it, the resource found in ``data`` is used.
    """
    families: dict[str, _Family] = {}
    target_info: dict[str, str] = _labels(resource) if resource is not None else {}
    for resource_metrics in data.resource_metrics if data is not None else ():
        if resource is None:
            target_info.update(_labels(resource_metrics.resource.attributes))
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                _add_metric(families, metric.name, metric.unit, metric.description, metric.data)
    lines: list[str] = []
    if target_info:
        lines += [
            "# HELP target_info Target metadata",
            "# TYPE target_info gauge",
            f"target_info{_format_labels(target_info)} 1",
        ]
    for family in families.values():
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        lines.extend(family.samples)
    return ("\n".join(lines) + "\n").encode() if lines else b""


class _Family:
    __slots__ = ("help", "name", "samples", "type")

    def __init__(self, name: str, typ: str, help_text: str) -> None:
        self.name = name
        self.type = typ
        self.help = help_text
        self.samples: list[str] = []


def _add_metric(
    families: dict[str, _Family], name: str, unit: str | None, description: str | None, data: object
) -> None:
    if isinstance(data, Sum):
        counter = data.is_monotonic
        typ = "counter" if counter else "gauge"
    elif isinstance(data, Gauge):
        counter, typ = False, "gauge"
    elif isinstance(data, Histogram):
        counter, typ = False, "histogram"
    else:  # exponential histograms are not used by specshadow's instruments
        return
    prom_name = metric_name(name, unit, counter=counter)
    family = families.get(prom_name)
    if family is None:
        family = families[prom_name] = _Family(prom_name, typ, description or name)
    elif family.type != typ:  # same name, different type from another scope: keep the first
        return
    if isinstance(data, Histogram):
        for hpoint in data.data_points:
            family.samples.extend(_histogram_samples(prom_name, hpoint))
    else:
        points: Sequence[NumberDataPoint] = data.data_points
        for point in points:
            labels = _format_labels(_labels(point.attributes))
            family.samples.append(f"{prom_name}{labels} {_format_value(point.value)}")


def _histogram_samples(name: str, point: HistogramDataPoint) -> Iterable[str]:
    labels = _labels(point.attributes)
    cumulative = 0
    for bound, count in zip(point.explicit_bounds, point.bucket_counts, strict=False):
        cumulative += count
        le = {**labels, "le": _format_value(bound)}
        yield f"{name}_bucket{_format_labels(le)} {cumulative}"
    yield f"{name}_bucket{_format_labels({**labels, 'le': '+Inf'})} {point.count}"
    yield f"{name}_sum{_format_labels(labels)} {_format_value(point.sum)}"
    yield f"{name}_count{_format_labels(labels)} {point.count}"


def _labels(attributes: Mapping[str, Any] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for key, value in (attributes or {}).items():
        label = label_name(key)
        text = _attribute_text(value)
        # Two keys that sanitize to one label: join values with ";" (OTel → Prometheus spec).
        labels[label] = f"{labels[label]};{text}" if label in labels else text
    return dict(sorted(labels.items()))


def _attribute_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return "[" + ",".join(_attribute_text(v) for v in value) + "]"
    return str(value)


def _format_labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in labels.items())
    return "{" + inner + "}"


def _format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _sanitize(name: str, invalid: re.Pattern[str]) -> str:
    return _REPEATED_UNDERSCORES.sub("_", invalid.sub("_", name)).strip("_") or "_"


def _unit_suffix(unit: str | None) -> str:
    if not unit:
        return ""
    unit = _UNIT_ANNOTATION.sub("", unit).strip()
    if not unit or unit == "1":
        return ""
    return _UNIT_SUFFIXES.get(unit, _sanitize(unit, _INVALID_LABEL_CHARS))
