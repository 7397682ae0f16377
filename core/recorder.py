"""Recorder: observes one leg's response bytes and turns them into a :class:`~core.timings.Recording`.

Pure and incremental (no I/O): the gateway feeds it every chunk it relayed, the load generator
every chunk it read, each with the ``perf_counter_ns`` receive time — so both measure with one
definition of each timing (see :mod:`core.timings`).

Size: the recorder and the one computation of every timing; the assembly of what the bytes say is
in :mod:`core.assemble`.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from itertools import pairwise
from typing import Any

from core.assemble import Assembler
from core.jsonx import JSONDecodeError, loads
from core.sse import SSEDecoder
from core.stats import percentile_sorted
from core.timings import (
    ChoiceOutput,
    EventKind,
    EventStamp,
    Recording,
    StreamOutcome,
    StreamTimings,
    TokensSource,
)

MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streaming body larger than this is not parsed
_NS_PER_S = 1e9
_CHARS_PER_TOKEN = 4  # the usual rough estimate for English text with BPE tokenizers

# Exceptions that malformed-but-valid JSON can provoke in the assembly code (wrong types where
# objects/strings/lists are expected). Caught per event so one bad event cannot lose the rest.
_SHAPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError)


def _output_chars(choices: tuple[ChoiceOutput, ...]) -> int:
    total = 0
    for c in choices:
        total += len(c.text) + len(c.reasoning) + len(c.refusal or "")
        for t in c.tool_calls:
            total += len(t.name or "") + len(t.arguments)
    return total


def estimate_tokens(choices: tuple[ChoiceOutput, ...], output_events: int) -> int | None:
    """The rough count when nothing exact is known: ``max(output events, ⌈characters / 4⌉)``;
    None when nothing was output. Only ever compared with an estimate made the same way."""
    if output_events == 0:
        return None
    return max(output_events, math.ceil(_output_chars(choices) / _CHARS_PER_TOKEN))


def tpot(ttft: float | None, e2e: float | None, output_tokens: int | None) -> float | None:
    """``(e2e − ttft) / (output_tokens − 1)``, in the unit of ``ttft`` and ``e2e``: the one
    definition (None below 2 tokens)."""
    if ttft is None or e2e is None or output_tokens is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def tokens_per_event(output_tokens: int | None, output_events: int) -> float | None:
    return output_tokens / output_events if output_tokens is not None and output_events else None


def recounted(rec: Recording, tokens: int | None, source: TokensSource | None) -> Recording:
    """``rec`` counted as ``tokens`` from ``source`` instead of its own count: every timing that
    divides by the count follows (tpot, tokens per event); what the leg itself reported stays in
    ``reported_tokens`` / ``reported_source``. The identity when nothing changes."""
    if tokens == rec.output_tokens and source == rec.tokens_source:
        return rec
    t = rec.timings
    first = rec.reported_source is None and rec.reported_tokens is None
    return dataclasses.replace(
        rec,
        output_tokens=tokens,
        tokens_source=source,
        reported_tokens=rec.output_tokens if first else rec.reported_tokens,
        reported_source=rec.tokens_source if first else rec.reported_source,
        timings=dataclasses.replace(
            t,
            tpot_s=tpot(t.ttft_s, t.e2e_s, tokens),
            tokens_per_event=tokens_per_event(tokens, rec.output_events),
        ),
    )


def _seconds(ns: float | None) -> float | None:
    return None if ns is None else ns / _NS_PER_S


def _summary_s(samples_ns: array[int], qs: tuple[float, ...]) -> list[float | None]:
    ordered = sorted(samples_ns)
    return [_seconds(percentile_sorted(ordered, q)) for q in qs]


class StreamRecorder:
    """Observes one leg's response bytes; :meth:`finish` turns them into a :class:`Recording`.

    Feed every network chunk *after* it was written to the client. ``feed`` and ``finish`` never
    raise: an undecodable event or body sets ``Recording.parse_error`` (the first message is
    kept) and recording continues with the next event (OTel's "telemetry must not break the data
    path"). ``finish`` is idempotent.

    Mode: ``text/event-stream`` → SSE, event by event; anything else → one JSON body, parsed at
    finish (bounded by :data:`MAX_BODY_BYTES`).

    Tokens (``Recording.output_tokens`` / ``tokens_source``), best source first:

    - ``"usage"``: ``completion_tokens`` of a final usage object (a usage-only chunk from
      ``stream_options.include_usage``, or the body's ``usage``).
    - ``"continuous_usage"``: no final usage, but chunks carried cumulative usage
      (``continuous_usage_stats``); the last cumulative value.
    - ``"logprobs"``: the number of logprobs entries (one per token).
    - ``"estimated"``: ``max(output_events, ceil(output_chars / 4))`` — a rough guess; never use
      it for tpot comparisons between backends without saying so.
    - ``None``: nothing was output and no usage arrived.

    Per-event tokens (``EventStamp.tokens``) are exact only with continuous usage (the delta of
    the cumulative count) or logprobs (entries in that event); otherwise ``None``.
    """

    __slots__ = (
        "_asm",
        "_body",
        "_body_len",
        "_broken",
        "_decoder",
        "_done",
        "_events",
        "_first_received_ns",
        "_last_received_ns",
        "_max_stamps",
        "_output_ns",
        "_overhead_max_ns",
        "_overhead_ns",
        "_parse_error",
        "_recording",
        "_stamps",
        "_stamps_truncated",
        "_t0_ns",
        "bytes_received",
        "chunks",
    )

    def __init__(
        self,
        *,
        t0_ns: int,
        content_type: str | None = "text/event-stream",
        max_stamps: int = 4096,
    ) -> None:
        self._t0_ns = t0_ns
        self._max_stamps = max(1, max_stamps)
        sse = content_type is not None and content_type.lstrip().lower().startswith(
            "text/event-stream"
        )
        self._decoder: SSEDecoder | None = SSEDecoder() if sse else None
        self._body: list[bytes] = []
        self._body_len = 0
        self.chunks = 0
        self.bytes_received = 0
        self._first_received_ns: int | None = None
        self._last_received_ns: int | None = None
        self._output_ns: array[int] = array("q")  # receive time of every output-bearing event
        self._overhead_ns: array[int] = array("q")  # first max_stamps samples
        self._overhead_max_ns: int | None = None  # over all chunks
        self._stamps: list[tuple[int, EventKind, int | None]] = []  # frozen at finish
        self._stamps_truncated = False
        self._events = 0
        self._done = False
        self._asm = Assembler()
        self._parse_error: str | None = None
        self._broken = False  # the decoder itself failed: stop decoding, keep counting
        self._recording: Recording | None = None

    # -- live peeks (cheap) -------------------------------------------------------------------

    @property
    def output_events(self) -> int:
        return len(self._output_ns)

    @property
    def ttft_ns(self) -> int | None:
        """t0 → first output-bearing event, so far; ``None`` before one arrived."""
        return self._output_ns[0] - self._t0_ns if self._output_ns else None

    @property
    def done(self) -> bool:
        """The stream ended as its protocol says: ``[DONE]``, or a Responses API terminal event."""
        return self._done or self._asm.terminal

    @property
    def incomplete_at_eof(self) -> bool:
        """After :meth:`finish`: the SSE stream ended mid-line or mid-event (it was cut)."""
        return self._decoder is not None and self._decoder.incomplete_at_eof

    # -- feeding --------------------------------------------------------------------------------

    def feed(self, chunk: bytes, received_ns: int, written_ns: int | None = None) -> None:
        """Record one network read. ``received_ns``: read off the socket; ``written_ns``: written
        to the client (gateway only). Never raises."""
        try:
            self.chunks += 1
            self.bytes_received += len(chunk)
            if self._first_received_ns is None:
                self._first_received_ns = received_ns
            self._last_received_ns = received_ns
            if written_ns is not None:
                self._note_overhead(written_ns - received_ns)
            if self._broken or self._recording is not None:
                return
            decoder = self._decoder
            if decoder is None:
                self._buffer_body(chunk)
                return
            for raw in decoder.feed_raw(chunk):
                self._on_event(raw[0], received_ns)
        except _SHAPE_ERRORS as exc:
            self._break(exc)
        except Exception as exc:  # noqa: BLE001 — runs on the primary's data path after the
            # write: any failure must end as a recorded parse_error, never propagate to the client.
            self._break(exc)

    def _note_overhead(self, overhead_ns: int) -> None:
        if len(self._overhead_ns) < self._max_stamps:
            self._overhead_ns.append(overhead_ns)
        if self._overhead_max_ns is None or overhead_ns > self._overhead_max_ns:
            self._overhead_max_ns = overhead_ns

    def _buffer_body(self, chunk: bytes) -> None:
        if self._body_len + len(chunk) > MAX_BODY_BYTES:
            self._note(f"response body exceeds {MAX_BODY_BYTES} bytes; not parsed")
            self._body = []
            self._broken = True
            return
        self._body.append(chunk)
        self._body_len += len(chunk)

    def _note(self, message: str) -> None:
        if self._parse_error is None:
            self._parse_error = message

    def _break(self, exc: BaseException) -> None:
        self._broken = True
        self._note(f"recorder failed: {type(exc).__name__}: {exc}")

    def _on_event(self, data: bytes, received_ns: int) -> None:
        if data == b"[DONE]":
            self._done = True
            return
        self._events += 1
        kind: EventKind = "other"
        tokens: int | None = None
        try:
            obj = loads(data)
        except JSONDecodeError:
            obj = self._loads_replacing(data)
        try:
            if isinstance(obj, dict):
                kind, tokens = self._asm.on_object(obj, True)
            elif obj is not None:
                self._note(f"event {self._events}: JSON is not an object")
        except _SHAPE_ERRORS as exc:
            self._note(f"event {self._events}: unexpected shape: {type(exc).__name__}: {exc}")
        if kind == "output":
            self._output_ns.append(received_ns)
        if len(self._stamps) < self._max_stamps:
            self._stamps.append((received_ns, kind, tokens))
        else:
            self._stamps_truncated = True

    def _loads_replacing(self, data: bytes) -> Any:
        # orjson rejects invalid UTF-8 outright; the event-stream spec decodes it with U+FFFD.
        try:
            return loads(data.decode("utf-8", "replace"))
        except JSONDecodeError as exc:
            self._note(f"event {self._events}: invalid JSON: {exc}")
            return None

    def _parse_body(self, status: int | None) -> None:
        body = b"".join(self._body)
        self._body = []
        if not body.strip():
            return
        try:
            obj = loads(body)
        except JSONDecodeError as exc:
            # An error page on a 4xx/5xx is not a decoding failure; the status says what happened.
            if status is None or status < 400:
                self._note(f"body: invalid JSON: {exc}")
            return
        if not isinstance(obj, dict):
            self._note("body: JSON is not an object")
            return
        self._events = 1
        try:
            kind, tokens = self._asm.on_object(obj, False)
        except _SHAPE_ERRORS as exc:
            self._note(f"body: unexpected shape: {type(exc).__name__}: {exc}")
            kind, tokens = "other", None
        usage = self._asm.usage
        if usage is not None and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]
        received_ns = self._last_received_ns if self._last_received_ns is not None else 0
        if kind == "output":
            self._output_ns.append(received_ns)
        self._stamps.append((received_ns, kind, tokens))

    # -- finishing ----------------------------------------------------------------------------

    def finish(
        self, *, outcome: StreamOutcome = "completed", status: int | None = None
    ) -> Recording:
        """Freeze what was recorded. Idempotent: later calls return the same object.

        ``status`` is the upstream HTTP status, used only to tell an error page (non-JSON body
        on a 4xx/5xx) from a body that failed to decode. Never raises.
        """
        if self._recording is not None:
            return self._recording
        try:
            recording = self._build(outcome, status)
        except _SHAPE_ERRORS as exc:
            self._break(exc)
            recording = self._fallback(outcome)
        except Exception as exc:  # noqa: BLE001 — finish runs in the request's cleanup path;
            # a failure here must become a recorded parse_error, not an exception in the handler.
            self._break(exc)
            recording = self._fallback(outcome)
        self._recording = recording
        return recording

    def _build(self, outcome: StreamOutcome, status: int | None) -> Recording:
        if self._decoder is not None:
            if not self._broken:
                self._decoder.flush()
        elif not self._broken:
            self._parse_body(status)
        asm = self._asm
        choices = asm.freeze()
        output_tokens, source = self._output_tokens(choices)
        usage = asm.usage
        prompt = usage.get("prompt_tokens") if usage is not None else None
        return Recording(
            streaming=self._decoder is not None,
            outcome=outcome,
            timings=self._timings(output_tokens),
            output_tokens=output_tokens,
            tokens_source=source,
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            output_events=len(self._output_ns),
            events=self._events,
            chunks=self.chunks,
            bytes_received=self.bytes_received,
            done=self.done,
            choices=choices,
            usage=usage,
            vllm_metrics=asm.metrics,
            response_model=asm.model if isinstance(asm.model, str) else None,
            response_id=asm.response_id if isinstance(asm.response_id, str) else None,
            error=asm.error,
            parse_error=self._parse_error,
            stamps=tuple(EventStamp(ns, kind, tokens) for ns, kind, tokens in self._stamps),
            stamps_truncated=self._stamps_truncated,
            engine_stats=asm.engine_stats or None,
        )

    def _output_tokens(
        self, choices: tuple[ChoiceOutput, ...]
    ) -> tuple[int | None, TokensSource | None]:
        asm = self._asm
        usage = asm.usage
        completion = usage.get("completion_tokens") if usage is not None else None
        if isinstance(completion, int) and not isinstance(completion, bool):
            return completion, ("usage" if asm.final_usage else "continuous_usage")
        if asm.logprobs_seen:
            return asm.logprob_tokens, "logprobs"
        estimate = estimate_tokens(choices, len(self._output_ns))
        return estimate, ("estimated" if estimate is not None else None)

    def _timings(self, output_tokens: int | None) -> StreamTimings:
        t0 = self._t0_ns
        out = self._output_ns
        ttft_ns: int | None = None
        e2e_ns: int | None = None
        gaps_ns: array[int] = array("q")
        if self._decoder is not None:
            if out:
                ttft_ns, e2e_ns = out[0] - t0, out[-1] - t0
                gaps_ns = array("q", (b - a for a, b in pairwise(out)))
        elif self._last_received_ns is not None:
            e2e_ns = self._last_received_ns - t0
        tpot_s = None
        if ttft_ns is not None:
            assert e2e_ns is not None  # set together with ttft_ns
            per_token_ns = tpot(ttft_ns, e2e_ns, output_tokens)  # in ns: exact arithmetic
            tpot_s = None if per_token_ns is None else per_token_ns / _NS_PER_S
        p50, p90, p99 = _summary_s(gaps_ns, (50.0, 90.0, 99.0))
        o50, o99 = _summary_s(self._overhead_ns, (50.0, 99.0))
        return StreamTimings(
            ttft_s=_seconds(ttft_ns),
            e2e_s=_seconds(e2e_ns),
            tpot_s=tpot_s,
            chunk_gaps_s=tuple(g / _NS_PER_S for g in gaps_ns[: self._max_stamps]),
            chunk_gap_p50_s=p50,
            chunk_gap_p90_s=p90,
            chunk_gap_p99_s=p99,
            chunk_gap_max_s=_seconds(max(gaps_ns)) if gaps_ns else None,
            tokens_per_event=tokens_per_event(output_tokens, len(out)),
            overhead_p50_s=o50,
            overhead_p99_s=o99,
            overhead_max_s=_seconds(self._overhead_max_ns),
        )

    def _fallback(self, outcome: StreamOutcome) -> Recording:
        """The minimal recording used if building the full one failed (counters only)."""
        none_timings = StreamTimings(
            None, None, None, (), None, None, None, None, None, None, None, None
        )
        return Recording(
            streaming=self._decoder is not None,
            outcome=outcome,
            timings=none_timings,
            output_tokens=None,
            tokens_source=None,
            prompt_tokens=None,
            output_events=len(self._output_ns),
            events=self._events,
            chunks=self.chunks,
            bytes_received=self.bytes_received,
            done=self.done,
            choices=(),
            usage=None,
            vllm_metrics=None,
            response_model=None,
            response_id=None,
            error=None,
            parse_error=self._parse_error,
            stamps=(),
            stamps_truncated=bool(self._stamps),
        )
