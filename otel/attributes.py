"""Attributes: the mapping from domain values (exchanges, legs, recordings, comparisons) to span
attributes, metric attributes and evaluation events (pure functions, no SDK objects).

TensorZero's ``genai_conventions`` idea: one module decides which attribute carries what, so
:class:`~otel.telemetry.Telemetry` only says *when* (start a span, finish a leg, record an
exchange). Names come from :mod:`otel.semconv`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.util.types import AttributeValue

from core import jsonx, request_body
from core.evidence import Comparison
from core.exchange import OPERATION_NAMES, Exchange, LegResult
from core.timings import EXACT_TOKENS, Recording
from otel import semconv as sc

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
    put(attributes, sc.GEN_AI_RESPONSE_MODEL, rec.response_model)
    put(attributes, sc.GEN_AI_RESPONSE_ID, rec.response_id)
    reasons = [c.finish_reason for c in rec.choices if c.finish_reason is not None]
    if reasons:
        attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    put(attributes, sc.GEN_AI_USAGE_INPUT_TOKENS, rec.prompt_tokens)
    # Usage is a count, never an estimate: a stream without usage (the official SDK's default)
    # leaves it out, and ``specshadow.tokens.source`` says why (Phoenix showed the estimate as
    # the leg's token count).
    exact = rec.tokens_source in EXACT_TOKENS
    put(attributes, sc.GEN_AI_USAGE_OUTPUT_TOKENS, rec.output_tokens if exact else None)
    put(attributes, sc.TOKENS_SOURCE, rec.tokens_source)
    t = rec.timings
    put(attributes, sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, t.ttft_s)
    put(attributes, sc.TIMING_TTFT_S, t.ttft_s)
    put(attributes, sc.TIMING_TPOT_S, t.tpot_s)
    put(attributes, sc.TIMING_E2E_S, t.e2e_s)
    put(attributes, sc.TIMING_CHUNK_GAP_P50_S, t.chunk_gap_p50_s)
    put(attributes, sc.TIMING_CHUNK_GAP_P99_S, t.chunk_gap_p99_s)
    put(attributes, sc.TIMING_TOKENS_PER_EVENT, t.tokens_per_event)
    put(attributes, sc.TIMING_OVERHEAD_P50_S, t.overhead_p50_s)
    put(attributes, sc.TIMING_OVERHEAD_P99_S, t.overhead_p99_s)
    attributes[sc.TIMING_OUTPUT_EVENTS] = rec.output_events
    mean_length, rate = vllm_acceptance(rec)
    if mean_length is not None or rate is not None:
        put(attributes, sc.ACCEPTANCE_MEAN_LENGTH, mean_length)
        put(attributes, sc.ACCEPTANCE_DRAFT_RATE, rate)
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
    put(attributes, sc.GEN_AI_REQUEST_MODEL, exchange.requested_model)
    put(attributes, sc.CATEGORY, exchange.category)
    put(attributes, sc.POLICY_GENERATION, exchange.policy_generation)
    put(attributes, sc.POLICY_RULE, exchange.policy_rule)
    put(attributes, sc.SHADOW_DROP_REASON, exchange.drop_reason)
    if exchange.rollout_stage is not None:
        attributes[sc.SERVED_BY] = exchange.served_by
        attributes["specshadow.rollout.stage"] = exchange.rollout_stage
        put(attributes, "specshadow.rollout.failover", exchange.failover)
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
    return number(spec.get("mean_acceptance_length")), number(spec.get("draft_acceptance_rate"))


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


def input_messages_json(request: Mapping[str, Any]) -> str:
    """``gen_ai.input.messages`` from an OpenAI request (chat ``messages``, the Responses API's
    ``instructions`` and ``input``, or ``prompt``)."""
    messages: list[dict[str, Any]] = []
    raw_messages = request_body.messages(request)
    if raw_messages is not None:
        for message in raw_messages:
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
    put(attributes, sc.GEN_AI_EVALUATION_SCORE_VALUE, result.score_value)
    put(attributes, sc.GEN_AI_EVALUATION_SCORE_LABEL, result.score_label)
    put(attributes, sc.GEN_AI_EVALUATION_EXPLANATION, result.explanation)
    return attributes


def evaluation_results(c: Comparison) -> list[EvaluationResult]:
    """The ``gen_ai.evaluation.result`` events of one comparison: only the scores that are known."""
    explanation = f"{c.b} vs {c.a}"
    out: list[tuple[str, float | None, str | None]] = []
    if c.exact_match is not None:
        out.append(("exact_match", float(c.exact_match), "match" if c.exact_match else "diverge"))
    if c.first_divergence is not None:
        out.append(("first_divergence", float(c.first_divergence), c.divergence_unit))
    if c.similarity is not None:
        out.append(("similarity", c.similarity, None))
    if c.json_equal is not None:
        out.append(("json_equal", float(c.json_equal), "equal" if c.json_equal else "differ"))
    elif c.json_expected and c.comparable:
        out.append(("json_valid", float(bool(c.json_valid_a and c.json_valid_b)), "invalid"))
    if c.tool_arguments_equal is not None:
        label = "equal" if c.tool_arguments_equal and c.tool_names_equal else "differ"
        out.append(("tool_calls_equal", float(label == "equal"), label))
    if c.one_sided_refusal:
        out.append(("one_sided_refusal", 1.0, "refusal_a" if c.refusal_a else "refusal_b"))
    if c.citations_equal is not None:
        out.append(("citations_equal", float(c.citations_equal), None))
    return [EvaluationResult(name, value, label, explanation) for name, value, label in out]


def put(attributes: Attributes, key: str, value: AttributeValue | None) -> None:
    if value is not None:
        attributes[key] = value


def number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
