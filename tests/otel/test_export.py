"""OTLP export against real receivers (HTTP and gRPC), and a collector that never answers."""

from __future__ import annotations

import asyncio
import time

import pytest

from otel import semconv as sc
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from otel.telemetry import Telemetry
from tests.otel.exchanges import make_exchange
from tests.otel.test_record import trace_exchange
from tests.receivers.otlp import (
    BlackHole,
    OtlpGrpcReceiver,
    OtlpHttpReceiver,
    ReceivedMetric,
    ReceivedSpan,
)

FAST = {
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_SERVICE_NAME": "specshadow-test",
}


def has_trace(spans: list[ReceivedSpan]) -> bool:
    return sum(s.kind == "CLIENT" for s in spans) >= 3 and any(s.kind == "SERVER" for s in spans)


async def assert_delivery(
    telemetry: Telemetry, receiver: OtlpHttpReceiver | OtlpGrpcReceiver
) -> None:
    trace_exchange(telemetry, make_exchange())
    telemetry.record_exchange_metrics(make_exchange())
    spans = await receiver.collected.wait_for_spans(has_trace)
    server = next(s for s in spans if s.kind == "SERVER")
    clients = [s for s in spans if s.kind == "CLIENT"]
    assert server.name == "POST /v1/chat/completions" and server.parent_span_id == ""
    assert {s.parent_span_id for s in clients} == {server.span_id}
    assert {s.trace_id for s in spans} == {server.trace_id}
    assert {s.attributes[sc.LEG_ROLE] for s in clients} == {"primary", "candidate", "baseline"}
    assert all(
        s.name == "chat tiny-llama" and s.attributes[sc.GEN_AI_REQUEST_MODEL] == "tiny-llama"
        for s in clients
    )
    assert server.resource[sc.SERVICE_NAME] == "specshadow-test" and server.scope == sc.SCOPE_NAME
    metrics = await receiver.collected.wait_for_metrics(
        lambda ms: (
            {sc.METRIC_TIME_TO_FIRST_CHUNK, sc.METRIC_OPERATION_DURATION} <= {m.name for m in ms}
        )
    )
    ttft = next(m for m in metrics if m.name == sc.METRIC_TIME_TO_FIRST_CHUNK)
    assert ttft.kind == "histogram" and ttft.unit == "s"
    assert {p.attributes[sc.LEG_ROLE] for p in ttft.points} == {"primary", "candidate", "baseline"}
    assert all(p.count == 1 for p in ttft.points)


async def test_otlp_http_exporter_delivers_spans_and_metrics(
    otlp_http_receiver: OtlpHttpReceiver,
) -> None:
    env = otlp_http_receiver.env(OTEL_EXPORTER_OTLP_HEADERS="x-tenant=team-a", **FAST)
    telemetry = build_telemetry(TelemetrySettings.from_env(env))
    try:
        await assert_delivery(telemetry, otlp_http_receiver)
        assert all(h.get("x-tenant") == "team-a" for h in otlp_http_receiver.collected.headers)
    finally:
        assert await asyncio.to_thread(telemetry.shutdown, 5.0)


async def test_otlp_grpc_exporter_delivers_spans_and_metrics(
    otlp_grpc_receiver: OtlpGrpcReceiver,
) -> None:
    env = otlp_grpc_receiver.env(OTEL_EXPORTER_OTLP_HEADERS="x-tenant=team-b", **FAST)
    telemetry = build_telemetry(TelemetrySettings.from_env(env))
    try:
        await assert_delivery(telemetry, otlp_grpc_receiver)
        assert all(h.get("x-tenant") == "team-b" for h in otlp_grpc_receiver.collected.headers)
    finally:
        assert await asyncio.to_thread(telemetry.shutdown, 5.0)


def test_shutdown_flushes_spans_still_queued(otlp_http_receiver: OtlpHttpReceiver) -> None:
    env = otlp_http_receiver.env(OTEL_BSP_SCHEDULE_DELAY="60000", OTEL_METRICS_EXPORTER="none")
    telemetry = build_telemetry(TelemetrySettings.from_env(env))
    trace_exchange(telemetry, make_exchange())
    assert otlp_http_receiver.collected.snapshot_spans() == []  # still in the batch queue
    assert telemetry.shutdown(5.0)  # synchronous, as an app's cleanup context calls it
    assert len(otlp_http_receiver.collected.snapshot_spans()) == 4


# Wall-clock bounds (median and slowest record call, shutdown): the timing tier (docs/testing.md).
@pytest.mark.timing
def test_a_black_holed_collector_adds_no_latency_and_shutdown_keeps_its_bound() -> None:
    """Record calls must not wait on the collector: a blocked path would take the 10 s export timeout.

    Bounds are loose on purpose (the CI machine is 2 shared cores): the median call stays in the
    low milliseconds and no call comes near the exporter timeout.
    """
    with BlackHole() as hole, BlackHole() as grpc_hole:
        for endpoint, protocol in ((hole.endpoint, "http/protobuf"), (grpc_hole.endpoint, "grpc")):
            env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_EXPORTER_OTLP_TIMEOUT": "10000",
                "OTEL_BSP_SCHEDULE_DELAY": "10",
                "OTEL_BSP_MAX_QUEUE_SIZE": "32",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8",
                "OTEL_METRIC_EXPORT_INTERVAL": "100",
            }
            telemetry = build_telemetry(TelemetrySettings.from_env(env))
            durations_s = []
            for _ in range(50):  # 200 spans into a 32-span queue while the exporter hangs
                started = time.perf_counter()
                trace_exchange(telemetry, make_exchange())
                telemetry.record_exchange_metrics(make_exchange())
                durations_s.append(time.perf_counter() - started)
            durations_s.sort()
            assert durations_s[len(durations_s) // 2] < 0.02, (
                f"{protocol}: median {durations_s[25] * 1000:.1f} ms"
            )
            assert durations_s[-1] < 0.5, (
                f"{protocol}: slowest record call took {durations_s[-1] * 1000:.1f} ms"
            )
            body, _ = telemetry.render_prometheus()
            dropped = [
                line
                for line in body.decode().splitlines()
                if line.startswith("specshadow_telemetry_dropped_total")
                and 'specshadow_reason="queue_full"' in line
            ]
            assert dropped and float(dropped[0].rsplit(" ", 1)[1]) >= 100, body.decode()[-2000:]
            started = time.perf_counter()
            finished = telemetry.shutdown(timeout_s=0.5)
            elapsed_s = time.perf_counter() - started
            assert not finished and elapsed_s < 1.0, f"{protocol}: shutdown took {elapsed_s:.2f} s"


def test_failed_exports_are_counted_as_dropped() -> None:
    with BlackHole() as hole:
        closed_port = hole.port
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
    }
    telemetry = build_telemetry(TelemetrySettings.from_env(env))
    trace_exchange(telemetry, make_exchange())
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = telemetry.render_prometheus()[0].decode()
        if 'specshadow_reason="export_failed",specshadow_signal="spans"} 4' in text:
            break
        time.sleep(0.05)
    assert 'specshadow_reason="export_failed",specshadow_signal="spans"} 4' in text, text[-1500:]
    assert telemetry.shutdown(5.0)


LEGACY_GENAI = {
    sc.METRIC_OPERATION_DURATION,
    sc.METRIC_TIME_TO_FIRST_CHUNK,
    sc.METRIC_TIME_PER_OUTPUT_CHUNK,
    sc.METRIC_TOKEN_USAGE,
}
LATEST_GENAI = {
    sc.METRIC_INFERENCE_DURATION,
    sc.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK,
    sc.METRIC_INFERENCE_TIME_PER_OUTPUT_CHUNK,
    sc.METRIC_INFERENCE_USAGE_INPUT_TOKENS,
    sc.METRIC_INFERENCE_USAGE_OUTPUT_TOKENS,
    sc.METRIC_INFERENCE_OPERATION_INPUT_TOKENS,
    sc.METRIC_INFERENCE_OPERATION_OUTPUT_TOKENS,
}


async def _genai_metrics(
    receiver: OtlpHttpReceiver, opt_in: str | None, service: str
) -> list[ReceivedMetric]:
    """The gen_ai.* metrics one Telemetry (its own service.name) delivered to ``receiver``."""
    env = {**FAST, "OTEL_SERVICE_NAME": service}
    if opt_in is not None:
        env[sc.OPT_IN_ENV] = opt_in
    telemetry = build_telemetry(TelemetrySettings.from_env(receiver.env(**env)))

    def mine(ms: list[ReceivedMetric]) -> list[ReceivedMetric]:
        return [m for m in ms if m.resource.get(sc.SERVICE_NAME) == service]

    try:
        telemetry.record_exchange_metrics(make_exchange())
        await receiver.collected.wait_for_metrics(
            lambda ms: sc.METRIC_TIME_PER_OUTPUT_TOKEN in {m.name for m in mine(ms)}
        )
    finally:
        assert await asyncio.to_thread(telemetry.shutdown, 5.0)
    return [m for m in mine(receiver.collected.snapshot_metrics()) if m.name.startswith("gen_ai.")]


async def test_genai_metric_names_follow_the_semconv_opt_in_at_a_real_receiver(
    otlp_http_receiver: OtlpHttpReceiver,
) -> None:
    default = await _genai_metrics(otlp_http_receiver, None, "default")
    assert {m.name for m in default} == LEGACY_GENAI
    latest = await _genai_metrics(otlp_http_receiver, f"http,{sc.OPT_IN_LATEST}", "latest")
    assert {m.name for m in latest} == LATEST_GENAI
    metrics = await _genai_metrics(otlp_http_receiver, sc.OPT_IN_BOTH, "both")
    assert {m.name for m in metrics} == LEGACY_GENAI | LATEST_GENAI
    counted = next(m for m in metrics if m.name == sc.METRIC_INFERENCE_USAGE_OUTPUT_TOKENS)
    histogram = next(m for m in metrics if m.name == sc.METRIC_TOKEN_USAGE)
    assert counted.kind == "sum" and histogram.kind == "histogram"
    # The same usage, two shapes: the counter's total is the legacy histogram's output sum.
    legacy_output = sum(
        p.sum or 0.0 for p in histogram.points if p.attributes[sc.GEN_AI_TOKEN_TYPE] == "output"
    )
    assert sum(p.value or 0 for p in counted.points) == legacy_output
    assert all(p.attributes[sc.GEN_AI_TOKEN_MODALITY] == "unknown" for p in counted.points)
    assert all(p.attributes[sc.GEN_AI_PROVIDER_NAME] == "openai" for p in counted.points)
