"""Timings: the one definition of each timing, and the value types a recording is made of.

The recorder that fills them in is :mod:`core.recorder`.

Definitions — one each, shared by the gateway and ``loadgen``:

- ``t0``: the moment the gateway (or loadgen client) starts sending that leg's request upstream.
- ``ttft``: t0 → receive time of the first SSE event that carries generated output (text,
  reasoning, tool-call delta). Non-streaming responses have no ttft (``None``).
- ``chunk_gap``: gaps between receive times of consecutive output-bearing events. Events that
  arrived in the same network read share one timestamp (gap 0) — vLLM bench and GuideLLM live
  with the same limitation.
- ``tpot``: (e2e − ttft) / (output_tokens − 1), only for responses with ≥ 2 output tokens.
- ``e2e``: t0 → receive time of the last output-bearing event (a trailing usage-only chunk does not
  extend it). Non-streaming: t0 → last body byte.
- ``tokens_per_event``: output_tokens / output-bearing events.
- ``overhead``: per network chunk, read from upstream → written to the client (gateway only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

StreamOutcome = Literal[
    "completed",  # the stream/body ended normally
    "client_disconnected",  # the client went away; the upstream request was closed
    "upstream_error",  # connection refused/reset, or the upstream died mid-stream
    "upstream_timeout",  # connect or idle-read timeout
    "upstream_status",  # the upstream answered with a 4xx/5xx status
    "parse_error",  # bytes arrived but could not be decoded as SSE/JSON
    "cancelled",  # a shadow leg cancelled by policy (e.g. client disconnect → cancel)
    "deadline",  # a shadow leg still running when the exchange deadline passed
]

EventKind = Literal["output", "role", "usage", "error", "other"]

# Where ``output_tokens`` came from. What the leg itself said: the final usage object, per-chunk
# continuous usage, counted logprobs entries (see StreamRecorder); what the evidence worker put in
# its place so every leg of one exchange is counted on the same footing (evidence.counts): the
# exact count of another leg that answered the very same output (``matched``), the engine's own
# tokenizer over the output text (``tokenize``); or a rough estimate, characters / 4
# (``estimated``), which is only ever compared with estimates made the same way.
TokensSource = Literal["usage", "continuous_usage", "logprobs", "matched", "tokenize", "estimated"]
# The sources that count tokens exactly (as the engine's tokenizer does).
EXACT_TOKENS: frozenset[TokensSource] = frozenset(
    ("usage", "continuous_usage", "logprobs", "matched", "tokenize")
)


@dataclass(frozen=True, slots=True)
class EventStamp:
    """One decoded SSE event: when its last byte was read, what it carried."""

    received_ns: int
    kind: EventKind
    tokens: int | None  # output tokens this event carried, when known exactly


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call assembled from streamed deltas (merged by ``index``) or a message."""

    index: int
    id: str | None
    type: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """Assembled output of one choice."""

    index: int
    text: str  # chat ``content`` or completions ``text``, concatenated
    reasoning: str  # ``reasoning_content`` / ``reasoning`` deltas, concatenated
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    refusal: str | None
    tokens: tuple[str, ...] | None  # token strings from logprobs, when the response carried them
    # Generated token ids, when the engine sent them (vLLM's ``return_token_ids``: the gateway
    # asks shadow legs for them when the policy scores counterfactuals).
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class StreamTimings:
    """Timing summary of one leg (seconds). ``None`` where the quantity is undefined."""

    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    chunk_gaps_s: tuple[float, ...]
    chunk_gap_p50_s: float | None
    chunk_gap_p90_s: float | None
    chunk_gap_p99_s: float | None
    chunk_gap_max_s: float | None
    tokens_per_event: float | None
    overhead_p50_s: float | None
    overhead_p99_s: float | None
    overhead_max_s: float | None


@dataclass(frozen=True, slots=True)
class Recording:
    """Everything the recorder learned about one leg's response. Never raises; see ``parse_error``."""

    streaming: bool
    outcome: StreamOutcome
    timings: StreamTimings
    output_tokens: int | None
    tokens_source: TokensSource | None
    prompt_tokens: int | None
    output_events: int  # output-bearing events
    events: int  # all decoded events except [DONE]
    chunks: int  # network reads fed
    bytes_received: int
    done: bool  # saw ``data: [DONE]``
    choices: tuple[ChoiceOutput, ...]
    usage: Mapping[str, Any] | None
    vllm_metrics: Mapping[str, Any] | None  # vLLM per-request ``metrics`` object, verbatim
    response_model: str | None
    response_id: str | None
    error: Mapping[str, Any] | None  # an ``{"error": …}`` payload seen in the body/stream
    parse_error: str | None
    stamps: tuple[EventStamp, ...]  # bounded (max_stamps); ``stamps_truncated`` says if cut
    stamps_truncated: bool
    # Per-request speculative stats other engines put elsewhere, verbatim, by where they were
    # found: "meta_info" (SGLang), "choice_stats" (vLLM's earlier per-choice form).
    engine_stats: Mapping[str, Any] | None = None
    # When the evidence worker counted this leg on another footing (evidence.counts): the count
    # and source the leg itself gave. None: ``output_tokens`` is the leg's own count.
    reported_tokens: int | None = None
    reported_source: TokensSource | None = None
