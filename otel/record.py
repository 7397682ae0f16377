"""Record: the mapping from domain objects (Exchange, LegResult, Recording) to spans and metrics.

TensorZero's ``genai_conventions`` idea: one module decides which attribute carries what, so the
gateway's handlers only say *when* (start a span, finish a leg, record an exchange). Attribute
builders are pure functions; the functions that touch a span or an instrument follow the OTel
``_safe_finalize`` rule — they never raise into the caller (log at debug and continue) and build
attributes only when ``span.is_recording()``. The gateway calls them after the bytes have been
written to the client, off the critical path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from gateway import jsonx
from gateway.exchange import OPERATION_NAMES, Exchange, LegResult
from gateway.timings import Recording
from otel import semconv as sc
from otel.instruments import Instruments

_log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

MAX_CAPTURED_CHARS = 16_384  # per captured text part; spans are not a transcript store
UNKNOWN_MODEL = "unknown"

Attributes = dict[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class EvaluationResult:
    """One comparison verdict, emitted as a ``gen_ai.evaluation.result`` span event."""

    name: str  # e.g. "exact_match", "first_divergence", "json_equal"
    score_value: float | None = None
    score_label: str | None = None  # e.g. "match" / "diverge"
    explanation: str | None = None


def safe(fallback: Callable[[], R]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run a telemetry function; on any exception log at debug, return ``fallback()``."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 — telemetry must never break the data path (OTel rule)
                _log.debug("telemetry call %s failed", fn.__qualname__, exc_info=True)
                return fallback()

        return wrapper

    return decorate


def nothing() -> None:
    """Fallback of telemetry functions that return nothing."""


# --- Pure attribute builders ----------------------------------------------------------------------


def request_span_name(method: str, route: str) -> str:
    """HTTP server span name: ``{method} {route}`` (semconv)."""
    return f"{method} {route}"


def leg_span_name(operation: str, model: str | None) -> str:
    """GenAI client span name: ``{operation} {model}`` (semconv), or the operation alone."""
    return f"{operation} {model}" if model else operation


def split_address(server_address: str) -> tuple[str, int | None]:
    """``host:port`` → (host, port); IPv6 ``[::1]:8000`` works; a bare host gives port None."""
    host, sep, port = server_address.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.startswith("[")):
        return server_address, None
    return host.strip("[]"), int(port)


def leg_start_attributes(
    *,
    operation: str,
    model: str | None,
    role: str,
    backend: str,
    server_address: str,
    stream: bool,
    provider: str,
) -> Attributes:
    """Attributes known when a leg starts (also what samplers see)."""
    host, port = split_address(server_address)
    attributes: Attributes = {
        sc.GEN_AI_OPERATION_NAME: operation,
        sc.GEN_AI_PROVIDER_NAME: provider,
        sc.GEN_AI_REQUEST_STREAM: stream,
        sc.LEG_ROLE: role,
        sc.BACKEND: backend,
        sc.SERVER_ADDRESS: host,
    }
    if model:
        attributes[sc.GEN_AI_REQUEST_MODEL] = model
    if port is not None:
        attributes[sc.SERVER_PORT] = port
    return attributes


def leg_result_attributes(leg: LegResult, *, capture_text: bool) -> Attributes:
    """Attributes known when a leg has ended: response, usage, timing summary, acceptance."""
    attributes: Attributes = {sc.STREAM_OUTCOME: leg.outcome}
    if leg.status is not None:
        attributes[sc.HTTP_RESPONSE_STATUS_CODE] = leg.status
    if leg.outcome != "completed":
        attributes[sc.ERROR_TYPE] = leg_error_type(leg)
    rec = leg.recording
    if rec is None:
        return attributes
    _put(attributes, sc.GEN_AI_RESPONSE_MODEL, rec.response_model)
    _put(attributes, sc.GEN_AI_RESPONSE_ID, rec.response_id)
    reasons = [c.finish_reason for c in rec.choices if c.finish_reason is not None]
    if reasons:
        attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    _put(attributes, sc.GEN_AI_USAGE_INPUT_TOKENS, rec.prompt_tokens)
    _put(attributes, sc.GEN_AI_USAGE_OUTPUT_TOKENS, rec.output_tokens)
    _put(attributes, sc.TOKENS_SOURCE, rec.tokens_source)
    t = rec.timings
    _put(attributes, sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, t.ttft_s)
    _put(attributes, sc.TIMING_TTFT_S, t.ttft_s)
    _put(attributes, sc.TIMING_TPOT_S, t.tpot_s)
    _put(attributes, sc.TIMING_E2E_S, t.e2e_s)
    _put(attributes, sc.TIMING_CHUNK_GAP_P50_S, t.chunk_gap_p50_s)
    _put(attributes, sc.TIMING_CHUNK_GAP_P99_S, t.chunk_gap_p99_s)
    _put(attributes, sc.TIMING_TOKENS_PER_EVENT, t.tokens_per_event)
    _put(attributes, sc.TIMING_OVERHEAD_P50_S, t.overhead_p50_s)
    _put(attributes, sc.TIMING_OVERHEAD_P99_S, t.overhead_p99_s)
    attributes[sc.TIMING_OUTPUT_EVENTS] = rec.output_events
    mean_length, rate = vllm_acceptance(rec)
    if mean_length is not None or rate is not None:
        _put(attributes, sc.ACCEPTANCE_MEAN_LENGTH, mean_length)
        _put(attributes, sc.ACCEPTANCE_DRAFT_RATE, rate)
        attributes[sc.ACCEPTANCE_SOURCE] = sc.ACCEPTANCE_SOURCE_VLLM
    if capture_text:
        attributes[sc.GEN_AI_OUTPUT_MESSAGES] = output_messages_json(rec)
    return attributes


def exchange_span_attributes(exchange: Exchange) -> Attributes:
    """Request-span attributes of a finished exchange (ids are fine on spans, never on metrics)."""
    attributes: Attributes = {
        sc.REQUEST_ID: exchange.request_id,
        sc.EXCHANGE_ID: exchange.exchange_id,
        sc.GEN_AI_OPERATION_NAME: OPERATION_NAMES[exchange.route],
        sc.GEN_AI_REQUEST_STREAM: exchange.stream,
        sc.SHADOW_SAMPLED: exchange.sampled,
    }
    _put(attributes, sc.GEN_AI_REQUEST_MODEL, exchange.requested_model)
    _put(attributes, sc.CATEGORY, exchange.category)
    _put(attributes, sc.POLICY_GENERATION, exchange.policy_generation)
    _put(attributes, sc.POLICY_RULE, exchange.policy_rule)
    _put(attributes, sc.SHADOW_DROP_REASON, exchange.drop_reason)
    return attributes


def leg_metric_attributes(exchange: Exchange, leg: LegResult) -> Attributes:
    """Low-cardinality metric attributes of one leg: operation, model, role, backend."""
    return {
        sc.GEN_AI_OPERATION_NAME: OPERATION_NAMES[exchange.route],
        sc.GEN_AI_REQUEST_MODEL: leg.upstream_model or exchange.requested_model or UNKNOWN_MODEL,
        sc.LEG_ROLE: leg.role,
        sc.BACKEND: leg.backend,
    }


def leg_error_type(leg: LegResult) -> str:
    """``error.type``: the exception class / error code, else the HTTP status, else the outcome."""
    if leg.error_type:
        return leg.error_type
    if leg.outcome == "upstream_status" and leg.status is not None:
        return str(leg.status)
    return leg.outcome


def vllm_acceptance(rec: Recording) -> tuple[float | None, float | None]:
    """(mean_acceptance_length, draft_acceptance_rate) from vLLM's per-request ``metrics``."""
    spec = (rec.vllm_metrics or {}).get("speculative_decoding")
    if not isinstance(spec, Mapping):
        return None, None
    return _number(spec.get("mean_acceptance_length")), _number(spec.get("draft_acceptance_rate"))


def output_messages_json(rec: Recording) -> str:
    """``gen_ai.output.messages`` (semconv JSON shape), text parts truncated to MAX_CAPTURED_CHARS."""
    messages = []
    for choice in rec.choices:
        parts: list[dict[str, Any]] = []
        if choice.reasoning:
            parts.append({"type": "reasoning", "content": choice.reasoning[:MAX_CAPTURED_CHARS]})
        if choice.text:
            parts.append({"type": "text", "content": choice.text[:MAX_CAPTURED_CHARS]})
        parts.extend(
            {
                "type": "tool_call",
                "id": call.id,
                "name": call.name,
                "arguments": call.arguments[:MAX_CAPTURED_CHARS],
            }
            for call in choice.tool_calls
        )
        messages.append(
            {"role": "assistant", "parts": parts, "finish_reason": choice.finish_reason}
        )
    return jsonx.dumps(messages).decode()


def input_messages_json(body: bytes) -> str | None:
    """``gen_ai.input.messages`` from an OpenAI request body (chat ``messages`` or ``prompt``)."""
    request = jsonx.loads(body)
    if not isinstance(request, Mapping):
        return None
    messages: list[dict[str, Any]] = []
    raw_messages = request.get("messages")
    if isinstance(raw_messages, list):
        for message in raw_messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            text = content if isinstance(content, str) else jsonx.dumps(content).decode()
            messages.append(
                {
                    "role": str(message.get("role")),
                    "parts": [{"type": "text", "content": text[:MAX_CAPTURED_CHARS]}],
                }
            )
    elif "prompt" in request:
        prompt = request["prompt"]
        text = prompt if isinstance(prompt, str) else jsonx.dumps(prompt).decode()
        messages.append(
            {"role": "user", "parts": [{"type": "text", "content": text[:MAX_CAPTURED_CHARS]}]}
        )
    return jsonx.dumps(messages).decode()


def evaluation_attributes(result: EvaluationResult) -> Attributes:
    """Attributes of one ``gen_ai.evaluation.result`` event."""
    attributes: Attributes = {sc.GEN_AI_EVALUATION_NAME: result.name}
    _put(attributes, sc.GEN_AI_EVALUATION_SCORE_VALUE, result.score_value)
    _put(attributes, sc.GEN_AI_EVALUATION_SCORE_LABEL, result.score_label)
    _put(attributes, sc.GEN_AI_EVALUATION_EXPLANATION, result.explanation)
    return attributes


# --- Span and instrument side (never raise) ---------------------------------------------------------


@safe(nothing)
def finish_leg_span(
    span: Span, leg: LegResult, *, end_unix_ns: int, capture_text: bool, max_chunk_events: int = 0
) -> None:
    """Set a leg's result attributes, bounded chunk events and error status; end the span.

    Args:
        end_unix_ns: wall-clock end (the moment the leg's stream ended).
        capture_text: add ``gen_ai.output.messages`` (only when the policy allows capture).
        max_chunk_events: add up to this many ``specshadow.chunk`` events (first output events).
    """
    try:
        if span.is_recording():
            span.set_attributes(leg_result_attributes(leg, capture_text=capture_text))
            if max_chunk_events > 0 and leg.recording is not None:
                _add_chunk_events(span, leg, max_chunk_events)
            if leg.outcome != "completed":
                span.set_status(Status(StatusCode.ERROR, leg.outcome))
    finally:
        span.end(end_time=end_unix_ns)


def _add_chunk_events(span: Span, leg: LegResult, limit: int) -> None:
    rec = leg.recording
    assert rec is not None
    index = 0
    for stamp in rec.stamps:
        if stamp.kind != "output":
            continue
        if index >= limit:
            break
        attributes: Attributes = {sc.CHUNK_INDEX: index}
        _put(attributes, sc.CHUNK_TOKENS, stamp.tokens)
        span.add_event(
            sc.EVENT_CHUNK,
            attributes,
            timestamp=leg.started_unix_ns + (stamp.received_ns - leg.t0_ns),
        )
        index += 1


@safe(nothing)
def annotate_request_span(span: Span, exchange: Exchange, *, capture_text: bool = False) -> None:
    """Put the exchange's ids, policy, sampling decision (and, if allowed, the prompt) on the span."""
    if not span.is_recording():
        return
    span.set_attributes(exchange_span_attributes(exchange))
    if capture_text and exchange.request_body is not None:
        messages = input_messages_json(exchange.request_body)
        if messages is not None:
            span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, messages)


@safe(nothing)
def end_request_span(
    span: Span,
    *,
    status_code: int | None,
    error_type: str | None = None,
    end_unix_ns: int | None = None,
) -> None:
    """Set the response status (error status for 5xx or an error type, per HTTP semconv) and end."""
    try:
        if span.is_recording():
            if status_code is not None:
                span.set_attribute(sc.HTTP_RESPONSE_STATUS_CODE, status_code)
            if error_type is None and status_code is not None and status_code >= 500:
                error_type = str(status_code)
            if error_type is not None:
                span.set_attribute(sc.ERROR_TYPE, error_type)
                span.set_status(Status(StatusCode.ERROR, error_type))
    finally:
        span.end(end_time=end_unix_ns)


@safe(nothing)
def add_evaluation_events(span: Span, results: Sequence[EvaluationResult]) -> None:
    """One ``gen_ai.evaluation.result`` event per comparison verdict."""
    if not span.is_recording():
        return
    for result in results:
        span.add_event(sc.EVENT_EVALUATION_RESULT, evaluation_attributes(result))


@safe(nothing)
def record_exchange_metrics(
    instruments: Instruments,
    exchange: Exchange,
    *,
    category: str | None = None,
    max_chunk_gap_observations: int = 128,
) -> None:
    """Record every histogram and counter an exchange feeds, for every leg.

    Per leg: operation duration (e2e, or leg end for legs without output), time to first chunk,
    time per output token, chunk gaps (an even stride of at most ``max_chunk_gap_observations``), input/output token usage, tokens per
    event, vLLM acceptance length. Per primary leg: gateway overhead — the recorder keeps only the
    per-chunk p50/p99/max, so those three values are recorded under ``specshadow.overhead.stat``.
    Per shadow leg: ``specshadow.shadow.requests`` ``completed`` or ``failed`` (reason = outcome);
    ``sampled``/``sent``/``dropped`` are counted by the gateway as they happen (``count_shadow``).
    ``category`` (when given) stands in for ``exchange.category``: the classifier's answer.
    """
    category = category or exchange.category or "none"
    for leg in exchange.legs:
        _record_leg(instruments, exchange, leg, category, max_chunk_gap_observations)


def _record_leg(
    instruments: Instruments, exchange: Exchange, leg: LegResult, category_name: str, max_gaps: int
) -> None:
    base = leg_metric_attributes(exchange, leg)
    category = {sc.CATEGORY: category_name}
    duration_attributes = dict(base)
    if leg.outcome != "completed":
        duration_attributes[sc.ERROR_TYPE] = leg_error_type(leg)
    rec = leg.recording
    e2e_s = rec.timings.e2e_s if rec is not None else None
    duration_s = e2e_s if e2e_s is not None else max(0.0, (leg.end_ns - leg.t0_ns) / 1e9)
    instruments.operation_duration.record(duration_s, duration_attributes)
    if leg.role != "primary":
        outcome = "completed" if leg.outcome == "completed" else "failed"
        counted = {sc.OUTCOME: outcome, sc.LEG_ROLE: leg.role, sc.BACKEND: leg.backend}
        if outcome == "failed":
            counted[sc.REASON] = leg.outcome
        instruments.shadow_requests.add(1, counted)
    if rec is None:
        return
    t = rec.timings
    if t.ttft_s is not None:
        instruments.time_to_first_chunk.record(t.ttft_s, base)
    if t.tpot_s is not None:
        instruments.time_per_output_token.record(t.tpot_s, base)
    gaps = t.chunk_gaps_s
    # One Histogram.record per gap is the costliest part of recording (profiled): a long stream
    # contributes an evenly strided sample of at most max_gaps gaps, which keeps the quantiles
    # unbiased over the stream's length (a prefix would over-weight the first tokens).
    step = max(1, -(-len(gaps) // max(1, max_gaps)))
    instruments.time_per_output_chunk.record_many(gaps[::step], base)
    if rec.prompt_tokens is not None:
        instruments.token_usage.record(
            rec.prompt_tokens, {**base, sc.GEN_AI_TOKEN_TYPE: sc.TOKEN_TYPE_INPUT}
        )
    if rec.output_tokens is not None:
        instruments.token_usage.record(
            rec.output_tokens, {**base, sc.GEN_AI_TOKEN_TYPE: sc.TOKEN_TYPE_OUTPUT}
        )
    if t.tokens_per_event is not None:
        instruments.tokens_per_event.record(t.tokens_per_event, {**base, **category})
    mean_length, _rate = vllm_acceptance(rec)
    if mean_length is not None:
        instruments.acceptance_length.record(mean_length, {**base, **category})
    for stat, value in (
        ("p50", t.overhead_p50_s),
        ("p99", t.overhead_p99_s),
        ("max", t.overhead_max_s),
    ):
        if value is not None:
            instruments.gateway_overhead.record(value, {**base, sc.OVERHEAD_STAT: stat})


def _put(attributes: Attributes, key: str, value: AttributeValue | None) -> None:
    if value is not None:
        attributes[key] = value


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
