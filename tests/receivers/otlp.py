"""Real OTLP receivers for tests: OTLP/HTTP (aiohttp) and OTLP/gRPC (grpcio), plus a black hole.

Both decode the real protobuf (``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest``)
into plain :class:`ReceivedSpan` / :class:`ReceivedMetric` values kept in a thread-safe
:class:`Collected` store. The HTTP receiver runs on its own thread and event loop, not the test's:
the SDK exports from its own threads, and code under test may flush *synchronously on the loop*
(e.g. an app's cleanup context calling ``telemetry.shutdown()``), which would deadlock against a
receiver served by that same loop.

Usage::

    with OtlpHttpReceiver() as rx:            # or OtlpGrpcReceiver()
        env = rx.env()                        # OTEL_EXPORTER_OTLP_* for TelemetrySettings.from_env
        ...
        spans = await rx.collected.wait_for_spans(lambda s: len(s) >= 2)
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped]  # grpcio ships no stubs (types-grpcio would)
import pytest
from aiohttp import web
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

KIND_NAMES = {
    0: "UNSPECIFIED",
    1: "INTERNAL",
    2: "SERVER",
    3: "CLIENT",
    4: "PRODUCER",
    5: "CONSUMER",
}


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    name: str
    time_unix_ns: int
    attributes: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    kind: str  # SERVER | CLIENT | …
    trace_id: str  # hex
    span_id: str  # hex
    parent_span_id: str  # hex, "" for a root span
    start_unix_ns: int
    end_unix_ns: int
    attributes: Mapping[str, Any]
    events: tuple[ReceivedEvent, ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: Mapping[str, Any]
    scope: str


@dataclass(frozen=True, slots=True)
class ReceivedPoint:
    attributes: Mapping[str, Any]
    value: float | None  # sums and gauges
    count: int | None  # histograms
    sum: float | None  # histograms


@dataclass(frozen=True, slots=True)
class ReceivedMetric:
    name: str
    unit: str
    kind: str  # histogram | sum | gauge | exponential_histogram
    points: tuple[ReceivedPoint, ...]
    resource: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReceivedLog:
    event_name: str
    time_unix_ns: int
    body: Any
    attributes: Mapping[str, Any]
    resource: Mapping[str, Any]


def any_value(value: AnyValue) -> Any:
    """Python value of an OTLP ``AnyValue``."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which)


def attributes_of(pairs: Sequence[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


@dataclass
class Collected:
    """Everything a receiver decoded, plus the request headers it saw. Thread-safe."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    metrics: list[ReceivedMetric] = field(default_factory=list)
    logs: list[ReceivedLog] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(
        self, request: trace_service_pb2.ExportTraceServiceRequest, headers: Mapping[str, str]
    ) -> None:
        decoded = [
            ReceivedSpan(
                name=span.name,
                kind=KIND_NAMES.get(span.kind, str(span.kind)),
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(),
                start_unix_ns=span.start_time_unix_nano,
                end_unix_ns=span.end_time_unix_nano,
                attributes=attributes_of(span.attributes),
                events=tuple(
                    ReceivedEvent(e.name, e.time_unix_nano, attributes_of(e.attributes))
                    for e in span.events
                ),
                status_code=span.status.code,
                resource=attributes_of(rs.resource.attributes),
                scope=ss.scope.name,
            )
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        with self._lock:
            self.spans.extend(decoded)
            self.headers.append(dict(headers))

    def add_metrics(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, headers: Mapping[str, str]
    ) -> None:
        decoded = []
        for rm in request.resource_metrics:
            resource = attributes_of(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = metric.WhichOneof("data") or ""
                    data = getattr(metric, kind)
                    points = tuple(
                        ReceivedPoint(
                            attributes=attributes_of(p.attributes),
                            value=(
                                p.as_double
                                if p.WhichOneof("value") == "as_double"
                                else float(p.as_int)
                            )
                            if kind in ("sum", "gauge")
                            else None,
                            count=p.count if kind.endswith("histogram") else None,
                            sum=p.sum if kind.endswith("histogram") else None,
                        )
                        for p in data.data_points
                    )
                    decoded.append(ReceivedMetric(metric.name, metric.unit, kind, points, resource))
        with self._lock:
            self.metrics.extend(decoded)
            self.headers.append(dict(headers))

    def add_logs(
        self, request: logs_service_pb2.ExportLogsServiceRequest, headers: Mapping[str, str]
    ) -> None:
        decoded = [
            ReceivedLog(
                event_name=record.event_name,
                time_unix_ns=record.time_unix_nano,
                body=any_value(record.body),
                attributes=attributes_of(record.attributes),
                resource=attributes_of(rl.resource.attributes),
            )
            for rl in request.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]
        with self._lock:
            self.logs.extend(decoded)
            self.headers.append(dict(headers))

    def snapshot_logs(self) -> list[ReceivedLog]:
        with self._lock:
            return list(self.logs)

    async def wait_for_logs(
        self, predicate: Callable[[list[ReceivedLog]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedLog]:
        """Poll until ``predicate(all log records so far)`` holds; return them."""
        return await _wait(self.snapshot_logs, predicate, timeout_s, "logs")

    def snapshot_spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def snapshot_metrics(self) -> list[ReceivedMetric]:
        with self._lock:
            return list(self.metrics)

    async def wait_for_spans(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """Poll until ``predicate(all spans so far)`` holds; return the spans. Fails the test on timeout."""
        return await _wait(self.snapshot_spans, predicate, timeout_s, "spans")

    async def wait_for_metrics(
        self, predicate: Callable[[list[ReceivedMetric]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedMetric]:
        """Poll until ``predicate(all metrics so far)`` holds; return the metrics."""
        return await _wait(self.snapshot_metrics, predicate, timeout_s, "metrics")


async def _wait(
    snapshot: Callable[[], list[Any]],
    predicate: Callable[[list[Any]], bool],
    timeout_s: float,
    what: str,
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        items = snapshot()
        if predicate(items):
            return items
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s} s waiting for {what}; have {len(items)}: {items[:5]!r}"
            )
        await asyncio.sleep(0.02)


class OtlpHttpReceiver:
    """OTLP/HTTP receiver (``POST /v1/traces``, ``/v1/metrics``, ``application/x-protobuf``) on 127.0.0.1:0."""

    def __init__(self) -> None:
        self.collected = Collected()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment that points an exporter here over http/protobuf."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            **extra,
        }

    async def _handle(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="expected application/x-protobuf")
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        headers = {k.lower(): v for k, v in request.headers.items()}
        if request.path == "/v1/traces":
            traces = trace_service_pb2.ExportTraceServiceRequest()
            traces.ParseFromString(body)
            self.collected.add_traces(traces, headers)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        elif request.path == "/v1/logs":
            logs = logs_service_pb2.ExportLogsServiceRequest()
            logs.ParseFromString(body)
            self.collected.add_logs(logs, headers)
            reply = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
        else:
            metrics = metrics_service_pb2.ExportMetricsServiceRequest()
            metrics.ParseFromString(body)
            self.collected.add_metrics(metrics, headers)
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._handle)
        app.router.add_post("/v1/metrics", self._handle)
        app.router.add_post("/v1/logs", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self._runner.cleanup()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    def __enter__(self) -> OtlpHttpReceiver:
        self._thread = threading.Thread(target=self._run, name="otlp-http-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("OTLP/HTTP receiver did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collected: Collected) -> None:
        self._collected = collected

    def Export(self, request: Any, context: Any) -> Any:
        self._collected.add_traces(request, dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, collected: Collected) -> None:
        self._collected = collected

    def Export(self, request: Any, context: Any) -> Any:
        self._collected.add_metrics(request, dict(context.invocation_metadata()))
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsServicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, collected: Collected) -> None:
        self._collected = collected

    def Export(self, request: Any, context: Any) -> Any:
        self._collected.add_logs(request, dict(context.invocation_metadata()))
        return logs_service_pb2.ExportLogsServiceResponse()


class OtlpGrpcReceiver:
    """OTLP/gRPC receiver (TraceService + MetricsService + LogsService) on 127.0.0.1:0, served by grpcio threads."""

    def __init__(self) -> None:
        self.collected = Collected()
        self.port = 0
        self._server: grpc.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment that points an exporter here over grpc (insecure, from the http scheme)."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            **extra,
        }

    def __enter__(self) -> OtlpGrpcReceiver:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-grpc-rx")
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceServicer(self.collected), server
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _MetricsServicer(self.collected), server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _LogsServicer(self.collected), server
        )
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)


class BlackHole:
    """A TCP listener that accepts connections and never answers (a collector that hangs)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)  # read nothing, answer nothing

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._thread.join(5)
        for conn in self._held:
            conn.close()
        self._sock.close()


@pytest.fixture
def otlp_http_receiver() -> Iterator[OtlpHttpReceiver]:
    with OtlpHttpReceiver() as receiver:
        yield receiver


@pytest.fixture
def otlp_grpc_receiver() -> Iterator[OtlpGrpcReceiver]:
    with OtlpGrpcReceiver() as receiver:
        yield receiver


@contextmanager
def black_hole() -> Iterator[BlackHole]:
    with BlackHole() as hole:
        yield hole
