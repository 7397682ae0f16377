"""Spans from hand-built exchanges: names, kinds, parent/child links, attributes, events, status."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from core.exchange import Exchange
from otel import attributes as rec, semconv as sc
from otel.telemetry import Telemetry
from tests.otel.conftest import InMemoryTelemetry
from tests.otel.exchanges import (
    SPEC_METRICS,
    STARTED_UNIX_NS,
    make_exchange,
    make_leg,
    make_recording,
)

ROUTE = "/v1/chat/completions"


def trace_exchange(
    telemetry: Telemetry,
    exchange: Exchange,
    *,
    carrier: dict[str, str] | None = None,
    capture_text: bool = False,
    max_chunk_events: int = 0,
) -> dict[str, str]:
    """Drive the span API the way the gateway does; returns the primary's upstream headers."""
    request = telemetry.start_request_span(route=ROUTE, method="POST", carrier=carrier or {})
    headers: dict[str, str] = {}
    for leg in exchange.legs:
        span = telemetry.start_leg_span(
            request,
            operation="chat",
            model=leg.upstream_model,
            role=leg.role,
            backend=leg.backend,
            server_address=leg.server_address,
            stream=exchange.stream,
            start_unix_ns=leg.started_unix_ns,
        )
        if leg.role == "primary":
            headers = telemetry.traceparent_headers(span)
        telemetry.finish_leg_span(
            span,
            leg,
            end_unix_ns=leg.started_unix_ns + 60_000_000,
            capture_text=capture_text,
            max_chunk_events=max_chunk_events,
        )
    telemetry.annotate_request_span(request, exchange, capture_text=capture_text)
    telemetry.end_request_span(request, status_code=200)
    return headers


def attrs(span: ReadableSpan) -> Mapping[str, Any]:
    return span.attributes or {}


def by_role(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {str(attrs(s).get(sc.LEG_ROLE)): s for s in spans if s.kind is SpanKind.CLIENT}


def server_span(spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    (span,) = [s for s in spans if s.kind is SpanKind.SERVER]
    return span


def test_one_server_span_and_one_client_span_per_leg_share_a_trace(mem: InMemoryTelemetry) -> None:
    trace_exchange(mem.telemetry, make_exchange())
    spans = mem.spans.get_finished_spans()
    server = server_span(spans)
    legs = by_role(spans)
    assert server.name == "POST /v1/chat/completions"
    assert attrs(server)[sc.HTTP_ROUTE] == ROUTE and attrs(server)[sc.HTTP_REQUEST_METHOD] == "POST"
    assert set(legs) == {"primary", "candidate", "baseline"}
    for leg in legs.values():
        assert leg.name == "chat tiny-llama"
        assert leg.parent is not None and leg.parent.span_id == server.context.span_id
        assert leg.context.trace_id == server.context.trace_id


def test_leg_span_carries_genai_and_project_attributes(mem: InMemoryTelemetry) -> None:
    trace_exchange(mem.telemetry, make_exchange())
    candidate = by_role(mem.spans.get_finished_spans())["candidate"]
    a = attrs(candidate)
    assert a[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert a[sc.GEN_AI_PROVIDER_NAME] == "openai"
    assert a[sc.GEN_AI_REQUEST_MODEL] == "tiny-llama"
    assert a[sc.GEN_AI_RESPONSE_MODEL] == "tiny-llama"
    assert a[sc.GEN_AI_REQUEST_STREAM] is True
    assert a[sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(0.02)
    assert a[sc.GEN_AI_USAGE_INPUT_TOKENS] == 7 and a[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 10
    assert tuple(a[sc.GEN_AI_RESPONSE_FINISH_REASONS]) == ("stop",)
    assert a[sc.GEN_AI_RESPONSE_ID] == "chatcmpl-1"
    assert a[sc.SERVER_ADDRESS] == "127.0.0.1" and a[sc.SERVER_PORT] == 8000
    assert a[sc.BACKEND] == "vllm-ngram"
    assert a[sc.TIMING_TPOT_S] == pytest.approx(0.003)
    assert a[sc.TIMING_CHUNK_GAP_P99_S] == pytest.approx(0.006)
    assert a[sc.TIMING_TOKENS_PER_EVENT] == pytest.approx(2.5)
    assert a[sc.TIMING_OUTPUT_EVENTS] == 4
    assert a[sc.ACCEPTANCE_MEAN_LENGTH] == pytest.approx(3.9)
    assert a[sc.ACCEPTANCE_DRAFT_RATE] == pytest.approx(0.61)
    assert a[sc.ACCEPTANCE_SOURCE] == sc.ACCEPTANCE_SOURCE_VLLM
    assert a[sc.STREAM_OUTCOME] == "completed"
    assert candidate.status.status_code is StatusCode.UNSET
    assert (
        candidate.start_time == STARTED_UNIX_NS
        and candidate.end_time == STARTED_UNIX_NS + 60_000_000
    )


def test_request_span_carries_policy_sampling_and_ids(mem: InMemoryTelemetry) -> None:
    exchange = replace(make_exchange(), drop_reason="budget")
    trace_exchange(mem.telemetry, exchange)
    a = attrs(server_span(mem.spans.get_finished_spans()))
    assert a[sc.POLICY_GENERATION] == 3 and a[sc.POLICY_RULE] == "mirror-all"
    assert a[sc.SHADOW_SAMPLED] is True and a[sc.SHADOW_DROP_REASON] == "budget"
    assert a[sc.REQUEST_ID] == "req-1" and a[sc.EXCHANGE_ID] == "ex-1"
    assert a[sc.CATEGORY] == "chat"
    assert a[sc.HTTP_RESPONSE_STATUS_CODE] == 200


def test_text_is_captured_only_when_asked(mem: InMemoryTelemetry) -> None:
    trace_exchange(mem.telemetry, make_exchange())
    for span in mem.spans.get_finished_spans():
        assert sc.GEN_AI_OUTPUT_MESSAGES not in attrs(span)
        assert sc.GEN_AI_INPUT_MESSAGES not in attrs(span)
    mem.spans.clear()
    trace_exchange(mem.telemetry, make_exchange(), capture_text=True)
    spans = mem.spans.get_finished_spans()
    output = json.loads(str(attrs(by_role(spans)["primary"])[sc.GEN_AI_OUTPUT_MESSAGES]))
    assert output == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "Hello world"}],
            "finish_reason": "stop",
        }
    ]
    prompt = json.loads(str(attrs(server_span(spans))[sc.GEN_AI_INPUT_MESSAGES]))
    assert prompt == [{"role": "user", "parts": [{"type": "text", "content": "Hi"}]}]


def test_failed_leg_gets_error_status_and_error_type(mem: InMemoryTelemetry) -> None:
    failed = make_leg("candidate", outcome="upstream_status", status=503, with_recording=False)
    timed_out = make_leg(
        "baseline",
        outcome="upstream_timeout",
        error_type="UpstreamTimeout",
        status=None,
        with_recording=False,
    )
    trace_exchange(mem.telemetry, make_exchange(shadows=(failed, timed_out)))
    legs = by_role(mem.spans.get_finished_spans())
    assert legs["candidate"].status.status_code is StatusCode.ERROR
    assert attrs(legs["candidate"])[sc.ERROR_TYPE] == "503"
    assert attrs(legs["candidate"])[sc.HTTP_RESPONSE_STATUS_CODE] == 503
    assert attrs(legs["baseline"])[sc.ERROR_TYPE] == "UpstreamTimeout"
    assert attrs(legs["baseline"])[sc.STREAM_OUTCOME] == "upstream_timeout"
    assert sc.ERROR_TYPE not in attrs(legs["primary"])


@pytest.mark.parametrize(("limit", "expected"), [(0, 0), (2, 2), (100, 4)])
def test_chunk_events_are_bounded_and_timestamped_on_the_wall_clock(
    mem: InMemoryTelemetry, limit: int, expected: int
) -> None:
    trace_exchange(mem.telemetry, make_exchange(), max_chunk_events=limit)
    primary = by_role(mem.spans.get_finished_spans())["primary"]
    chunks = [e for e in primary.events if e.name == sc.EVENT_CHUNK]
    assert len(chunks) == expected
    if chunks:
        # the first output event arrived 20 ms after t0 (see exchanges.make_recording)
        assert chunks[0].timestamp == STARTED_UNIX_NS + 20_000_000
        assert [(e.attributes or {})[sc.CHUNK_INDEX] for e in chunks] == list(range(expected))


def test_incoming_traceparent_is_continued_and_propagated_upstream(mem: InMemoryTelemetry) -> None:
    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    headers = trace_exchange(mem.telemetry, make_exchange(), carrier=incoming)
    spans = mem.spans.get_finished_spans()
    server = server_span(spans)
    assert format(server.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent is not None and format(server.parent.span_id, "016x") == "b7ad6b7169203331"
    primary = by_role(spans)["primary"]
    version, trace_id, span_id, _flags = headers["traceparent"].split("-")
    assert (version, trace_id) == ("00", "0af7651916cd43dd8448eb211c80319c")
    assert span_id == format(primary.context.span_id, "016x")


def test_comparisons_become_genai_evaluation_events_on_a_compare_span_in_the_trace(
    mem: InMemoryTelemetry,
) -> None:
    from evidence.worker import build_evidence
    from tests.evidence.legs import exchange, leg

    request = mem.telemetry.start_request_span(route=ROUTE, method="POST", carrier={})
    traceparent = mem.telemetry.traceparent(request)
    mem.telemetry.end_request_span(request, status_code=200)
    words = ["Hello", " world", " and", " more"]
    ex = replace(
        exchange(
            primary=leg("primary", words, logprobs=True),
            shadows=[leg("candidate", [*words[:2], " q", *words[3:]], logprobs=True)],
        ),
        traceparent=traceparent,
    )
    mem.telemetry.record_comparisons(build_evidence(ex))
    spans = mem.spans.get_finished_spans()
    (compare,) = [s for s in spans if s.name == "compare"]
    assert (
        compare.parent is not None and compare.parent.span_id == server_span(spans).context.span_id
    )
    events = {
        str((e.attributes or {})["gen_ai.evaluation.name"]): dict(e.attributes or {})
        for e in compare.events
        if e.name == "gen_ai.evaluation.result"
    }
    assert events["exact_match"] == {
        "gen_ai.evaluation.name": "exact_match",
        "gen_ai.evaluation.score.value": 0.0,
        "gen_ai.evaluation.score.label": "diverge",
        "gen_ai.evaluation.explanation": "candidate vs primary",
    }
    assert events["first_divergence"]["gen_ai.evaluation.score.value"] == 2.0
    assert events["first_divergence"]["gen_ai.evaluation.score.label"] == "token"
    assert 0 < float(events["similarity"]["gen_ai.evaluation.score.value"]) < 1  # type: ignore[arg-type]


def test_request_span_with_5xx_status_is_an_error(mem: InMemoryTelemetry) -> None:
    span = mem.telemetry.start_request_span(route=ROUTE, method="POST", carrier={})
    mem.telemetry.end_request_span(span, status_code=502)
    (finished,) = mem.spans.get_finished_spans()
    assert finished.status.status_code is StatusCode.ERROR
    assert attrs(finished)[sc.ERROR_TYPE] == "502"


def test_recording_functions_never_raise_and_still_end_the_span(mem: InMemoryTelemetry) -> None:
    span = mem.telemetry.start_request_span(route=ROUTE, method="POST", carrier={})
    broken = replace(make_leg(), recording=replace(make_recording(), choices=None))  # type: ignore[arg-type]
    mem.telemetry.finish_leg_span(span, broken, end_unix_ns=STARTED_UNIX_NS, capture_text=False)
    assert len(mem.spans.get_finished_spans()) == 1  # ended despite the bad recording
    mem.telemetry.record_exchange_metrics(None)  # type: ignore[arg-type]
    mem.telemetry.record_comparisons(None)  # type: ignore[arg-type]
    mem.telemetry.annotate_request_span(span, None)  # type: ignore[arg-type]


def test_spans_that_are_not_recorded_cost_no_attributes() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel.settings import TelemetrySettings
    from otel.setup import build_telemetry

    exported = InMemorySpanExporter()
    telemetry = build_telemetry(TelemetrySettings(sampler="always_off"), span_exporter=exported)
    span = telemetry.start_request_span(route=ROUTE, method="POST", carrier={})
    assert not span.is_recording()
    leg = telemetry.start_leg_span(
        span,
        operation="chat",
        model="m",
        role="primary",
        backend="b",
        server_address="h:1",
        stream=True,
    )
    telemetry.finish_leg_span(leg, make_leg(), end_unix_ns=STARTED_UNIX_NS, capture_text=True)
    flags = telemetry.traceparent_headers(leg)["traceparent"].rsplit("-", 1)[1]
    assert int(flags, 16) & 0x01 == 0  # propagated, marked not sampled
    assert exported.get_finished_spans() == ()
    assert telemetry.shutdown(5.0)


def test_without_a_trace_exporter_no_span_is_built() -> None:
    from otel.settings import TelemetrySettings
    from otel.setup import build_telemetry

    telemetry = build_telemetry(TelemetrySettings())
    span = telemetry.start_request_span(route=ROUTE, method="POST", carrier={})
    assert not span.is_recording()
    assert telemetry.traceparent_headers(span) == {}
    assert telemetry.enabled  # metrics are still on (GET /metrics)
    assert telemetry.shutdown(5.0)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("vllm", ("vllm", None)),
        ("[::1]:9", ("::1", 9)),
        ("::1", ("::1", None)),
    ],
)
def test_split_address(address: str, expected: tuple[str, int | None]) -> None:
    assert rec.split_address(address) == expected


def test_vllm_acceptance_ignores_missing_or_non_numeric_fields() -> None:
    assert rec.vllm_acceptance(make_recording(vllm_metrics=SPEC_METRICS)) == (3.9, 0.61)
    assert rec.vllm_acceptance(make_recording(vllm_metrics=None)) == (None, None)
    odd = {"speculative_decoding": {"mean_acceptance_length": "3", "draft_acceptance_rate": True}}
    assert rec.vllm_acceptance(make_recording(vllm_metrics=odd)) == (None, None)
