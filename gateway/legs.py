"""One leg's lifecycle, the same for the primary and every shadow leg.

A :class:`LegRun` owns a leg while it is in flight: its CLIENT span (started when the leg is
created, so set-up time is visible), its two clocks (wall clock for records and span times,
``perf_counter_ns`` for every duration; both taken again at :meth:`LegRun.dispatch`, the moment
the request goes upstream — ``t0``), the recorder tee on its response, and its end: :meth:`finish`
freezes the recording, builds the :class:`~core.exchange.LegResult` and ends the span at the time
the leg's stream ended. What differs between legs — who reads the response (the client relay or a
drain), admission and breakers for shadows — stays with the caller.
"""

from __future__ import annotations

import time

import aiohttp
from opentelemetry.trace import Span

from core.exchange import LegLoad, LegResult, Role, SpeculativeSpec
from core.timings import StreamOutcome
from gateway.forward import RecorderTee, recorder_for
from gateway.load import BackendLoad
from otel.telemetry import Telemetry


class LegRun:
    """A leg in flight. Create it, :meth:`dispatch` when the request leaves, :meth:`attach` the
    response, :meth:`finish` exactly once."""

    __slots__ = (
        "backend",
        "book",
        "capture_text",
        "chunk_events",
        "inflight",
        "load",
        "model",
        "role",
        "server_address",
        "share",
        "span",
        "speculative",
        "started_unix_ns",
        "status",
        "t0_ns",
        "tee",
        "telemetry",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        parent_span: Span,
        *,
        role: Role,
        backend: str,
        server_address: str,
        operation: str,
        model: str | None,
        stream: bool,
        capture_text: bool,
        chunk_events: int,
        share: float | None = None,
        speculative: SpeculativeSpec | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.share = share
        self.speculative = speculative
        self.load: LegLoad | None = None
        self.book: BackendLoad | None = None
        self.role: Role = role
        self.backend = backend
        self.server_address = server_address
        self.model = model
        self.capture_text = capture_text
        self.chunk_events = chunk_events
        self.started_unix_ns = time.time_ns()
        self.t0_ns = time.perf_counter_ns()
        self.inflight = 0
        self.status: int | None = None
        self.tee: RecorderTee | None = None
        self.span = telemetry.start_leg_span(
            parent_span,
            operation=operation,
            model=model,
            role=role,
            backend=backend,
            server_address=server_address,
            stream=stream,
            start_unix_ns=self.started_unix_ns,
        )

    def trace_headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) for this leg's upstream request."""
        return self.telemetry.traceparent_headers(self.span)

    def dispatch(self, load: LegLoad, book: BackendLoad | None = None) -> None:
        """The request leaves now (``t0``) and meets ``load``: its backend's book at dispatch.

        ``inflight_at_dispatch`` is that book's in-flight count — one book per backend, shared by
        every kind of leg sent to it (the primary, a canary candidate answering, shadows), so a
        candidate that answers a canary counts what it really carries. ``book`` (that backend's
        :class:`~gateway.load.BackendLoad`) gives the leg, when it finishes, the batch it decoded
        in: the book's in-flight count averaged over its decode interval."""
        self.inflight = load.in_flight
        self.load = load
        self.book = book
        self.started_unix_ns, self.t0_ns = time.time_ns(), time.perf_counter_ns()

    def attach(self, response: aiohttp.ClientResponse) -> RecorderTee:
        """The upstream answered (headers): record its status and tee its body to a recorder."""
        self.status = response.status
        self.tee = recorder_for(response, self.t0_ns)
        return self.tee

    def finish(self, outcome: StreamOutcome, error_type: str | None) -> LegResult:
        """End the leg: freeze the recording, build its LegResult, end its CLIENT span."""
        tee = self.tee
        recording = (
            tee.recorder.finish(outcome=outcome, status=self.status) if tee is not None else None
        )
        end_ns = time.perf_counter_ns()
        decode: float | None = None
        timings = recording.timings if recording is not None else None
        if self.book is not None and timings is not None:
            first, last = timings.ttft_s, timings.e2e_s
            if first is not None and last is not None:  # TPOT's interval: first to last event
                decode = self.book.mean_in_flight(
                    self.t0_ns + round(first * 1e9), self.t0_ns + round(last * 1e9)
                )
        leg = LegResult(
            role=self.role,
            backend=self.backend,
            server_address=self.server_address,
            upstream_model=self.model,
            status=self.status,
            outcome=outcome,
            error_type=error_type,
            recording=recording,
            started_unix_ns=self.started_unix_ns,
            t0_ns=self.t0_ns,
            end_ns=end_ns,
            inflight_at_dispatch=self.inflight,
            load=self.load,
            share=self.share,
            speculative=self.speculative,
            decode_in_flight=decode,
        )
        self.telemetry.finish_leg_span(
            self.span,
            leg,
            end_unix_ns=self.started_unix_ns + (end_ns - self.t0_ns),
            capture_text=self.capture_text,
            max_chunk_events=self.chunk_events,
        )
        return leg
