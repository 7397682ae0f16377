"""Send one request and measure it with the gateway's own recorder (I/O shell).

Every network read is stamped with ``time.perf_counter_ns()`` as it comes off the socket and fed
to :class:`core.timings.StreamRecorder`, so ``ttft``, ``tpot``, ``chunk_gap``, ``e2e`` and
``tokens_per_event`` mean exactly what they mean in the gateway.

``t0`` here: closed loop, the moment this client starts sending; open loop (rate or trace
timing), the request's *scheduled* send time, so that a server that falls behind shows its
queueing in ttft and e2e instead of hiding it by slowing the client down (coordinated omission).
``send_delay_s`` says how late the request actually left; tpot is unaffected by the choice of t0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from core import jsonx
from core.recorder import StreamRecorder
from core.timings import Recording, StreamOutcome
from core.wire import CATEGORY_HEADER
from loadgen.trace import ROUTE_PATHS, TraceRecord

__all__ = ["RequestResult", "RequestSettings", "prepare_body", "send_request"]

_NS_PER_S = 1e9


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """How every request of a run is shaped and sent."""

    base_url: str  # as the OpenAI SDK takes it, e.g. http://host:port/v1
    stream: bool = True
    model: str | None = None  # override the trace's model
    max_tokens: int | None = None  # override (benchmark matrix output-length buckets)
    headers: Mapping[str, str] | None = None
    category_header: bool = True
    request_timeout_s: float = 600.0  # idle read timeout (between two reads)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One measured request; field names match the comparison records' leg fields."""

    index: int
    record_index: int
    warmup: bool
    category: str | None
    status: int | None  # HTTP status; None when no response arrived
    outcome: StreamOutcome
    error: str | None  # None when fine
    error_type: str | None
    scheduled_offset_s: float | None  # open loop: when it should have left (phase-relative)
    sent_offset_s: float  # when it actually started sending (phase-relative)
    send_delay_s: float  # sent − scheduled (0 in closed loop): the client's own queueing
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    chunk_gap_p50_s: float | None
    chunk_gap_p99_s: float | None
    chunk_gap_max_s: float | None
    output_tokens: int | None
    tokens_source: str | None
    output_events: int
    tokens_per_event: float | None
    prompt_tokens: int | None
    response_model: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prepare_body(record: TraceRecord, settings: RequestSettings) -> bytes:
    """The bytes to send: the trace body with the run's overrides (model, stream, max_tokens)."""
    body = dict(record.body)
    if settings.model is not None:
        body["model"] = settings.model
    if settings.max_tokens is not None:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = settings.max_tokens
    if settings.stream:
        body["stream"] = True
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    else:
        body["stream"] = False
        body.pop("stream_options", None)
    return jsonx.dumps(body)


def _headers(record: TraceRecord, settings: RequestSettings) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    headers.update(settings.headers or {})
    if settings.category_header and record.category:
        headers[CATEGORY_HEADER] = record.category
    return headers


def _error_text(recording: Recording, status: int | None) -> tuple[str | None, str | None]:
    """(error message, error type) for a finished recording; (None, None) when it is fine."""
    if recording.error is not None:
        err = recording.error
        message, kind = err.get("message"), err.get("type")
        return str(message or dict(err)), str(kind or "upstream_error_payload")
    if status is not None and status >= 400:
        return f"HTTP {status}", "upstream_status"
    if recording.parse_error is not None:
        return recording.parse_error, "parse_error"
    if recording.streaming and not recording.done:
        return "stream ended without [DONE]", "incomplete_stream"
    return None, None


async def send_request(
    session: aiohttp.ClientSession,
    record: TraceRecord,
    settings: RequestSettings,
    *,
    index: int,
    phase_start_ns: int,
    scheduled_ns: int | None = None,
    warmup: bool = False,
) -> RequestResult:
    """Send ``record`` now and read the whole response; never raises for HTTP/network failures.

    ``scheduled_ns`` (perf_counter_ns): open loop's intended send time, used as ``t0``.
    """
    url = settings.base_url.rstrip("/") + ROUTE_PATHS[record.route]
    data = prepare_body(record, settings)
    sent_ns = time.perf_counter_ns()
    t0_ns = scheduled_ns if scheduled_ns is not None else sent_ns
    recorder: StreamRecorder | None = None
    status: int | None = None
    outcome: StreamOutcome = "completed"
    error_type: str | None = None
    error: str | None = None
    try:
        async with session.post(url, data=data, headers=_headers(record, settings)) as resp:
            status = resp.status
            recorder = StreamRecorder(t0_ns=t0_ns, content_type=resp.headers.get("Content-Type"))
            async for chunk in resp.content.iter_any():
                recorder.feed(chunk, time.perf_counter_ns())
        if status >= 400:
            outcome = "upstream_status"
    except (TimeoutError, asyncio.TimeoutError) as exc:  # noqa: UP041 — aiohttp may raise either
        outcome, error_type, error = "upstream_timeout", type(exc).__name__, "timed out"
    except aiohttp.ClientError as exc:
        outcome, error_type, error = "upstream_error", type(exc).__name__, str(exc) or None
        error = error or type(exc).__name__
    if recorder is None:
        recorder = StreamRecorder(t0_ns=t0_ns, content_type=None)
    recording = recorder.finish(outcome=outcome, status=status)
    if error is None:
        error, error_type = _error_text(recording, status)
    timings = recording.timings
    return RequestResult(
        index=index,
        record_index=record.index,
        warmup=warmup,
        category=record.category,
        status=status,
        outcome=outcome,
        error=error,
        error_type=error_type,
        scheduled_offset_s=(scheduled_ns - phase_start_ns) / _NS_PER_S
        if scheduled_ns is not None
        else None,
        sent_offset_s=(sent_ns - phase_start_ns) / _NS_PER_S,
        send_delay_s=(sent_ns - t0_ns) / _NS_PER_S,
        ttft_s=timings.ttft_s,
        tpot_s=timings.tpot_s,
        e2e_s=timings.e2e_s,
        chunk_gap_p50_s=timings.chunk_gap_p50_s,
        chunk_gap_p99_s=timings.chunk_gap_p99_s,
        chunk_gap_max_s=timings.chunk_gap_max_s,
        output_tokens=recording.output_tokens,
        tokens_source=recording.tokens_source,
        output_events=recording.output_events,
        tokens_per_event=timings.tokens_per_event,
        prompt_tokens=recording.prompt_tokens,
        response_model=recording.response_model,
    )
