"""Telemetry: the one telemetry API — traces, metrics, records as logs — for one process.

Owns a ``TracerProvider``, a ``MeterProvider`` and a ``LoggerProvider`` (never the global ones),
the instruments and the Prometheus pull reader. The gateway calls the span methods as a request
runs (request span, one leg span per leg); the evidence worker calls :meth:`Telemetry.handle` with
every exchange's :class:`~core.evidence.Evidence` (metrics of every leg, comparison counts, the
``compare`` span with its evaluation events, and the record as an OTLP log record). Which attribute
carries what is decided in :mod:`otel.attributes`.

Every method follows the OTel ``_safe_finalize`` rule: it never raises into the caller (it logs at
debug and returns a harmless value), builds attributes only when ``span.is_recording()``, and is
cheap enough for the event loop: span operations and metric records are in memory, exports happen
on SDK threads. Built by :func:`otel.setup.build_telemetry`.

Size: this is the one telemetry API — every span, metric, event and log the product emits goes
through a method here, so callers never touch the SDK; what has logic of its own lives beside it
(``attributes``, ``instruments``, ``histograms``, ``export``, ``prometheus``, ``setup``).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, ParamSpec, Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from core import jsonx
from core.classify import UNCATEGORIZED
from core.evidence import Evidence
from core.exchange import Exchange, LegResult
from core.timings import EXACT_TOKENS
from otel import attributes as at, instruments as inst, semconv as sc
from otel.attributes import Attributes, EvaluationResult
from otel.prometheus import CONTENT_TYPE, PullMetricReader, render
from otel.settings import TelemetrySettings
from records.reader import read

ROLLOUT_STAGES = {"shadow": 0, "canary": 1, "live": 2}

_log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()

P = ParamSpec("P")
R = TypeVar("R")


def safe(fallback: Callable[[], R]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run a telemetry method; on any exception log at debug, return ``fallback()``."""

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
    """Fallback of telemetry methods that return nothing."""


PolicyStatus = Callable[[], tuple[int, bool]]  # (generation, last reload succeeded)


def _no_span() -> Span:
    return INVALID_SPAN


def _no_headers() -> dict[str, str]:
    return {}


def _no_status() -> tuple[int, bool] | None:
    return None


class GuardReading(Protocol):
    """One rollout guard as telemetry reads it (``rollout.guards.GuardState`` is one; otel does
    not import the gateway, so the seam is this protocol)."""

    @property
    def name(self) -> str: ...
    @property
    def value(self) -> float | None: ...
    @property
    def threshold(self) -> float: ...
    @property
    def status(self) -> str: ...


class StageChange(Protocol):
    """One rollout stage change as telemetry reads it (``rollout.state.Transition``)."""

    @property
    def rule(self) -> str: ...
    @property
    def from_stage(self) -> str: ...
    @property
    def to_stage(self) -> str: ...
    @property
    def serve_ratio(self) -> float: ...
    @property
    def by(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def guard(self) -> str | None: ...


class Telemetry:
    """Traces and metrics of one gateway process (or one test app)."""

    def __init__(
        self,
        *,
        settings: TelemetrySettings,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
        pull_reader: PullMetricReader | None,
        logger_provider: LoggerProvider | None = None,
        max_chunk_gap_observations: int = 128,
        resource_attributes: Mapping[str, Any] | None = None,
        histograms: inst.HistogramSource | None = None,
    ) -> None:
        self.settings = settings
        self._resource_attributes = resource_attributes
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._logger_provider = logger_provider
        self._record_logger = (
            logger_provider.get_logger(sc.SCOPE_NAME) if logger_provider is not None else None
        )
        self._pull_reader = pull_reader
        self._max_gaps = max_chunk_gap_observations
        self._policy_status: PolicyStatus | None = None
        self._shutdown_done = False
        self.tracer: Tracer = (
            tracer_provider.get_tracer(sc.SCOPE_NAME)
            if tracer_provider is not None
            else trace.NoOpTracerProvider().get_tracer(sc.SCOPE_NAME)
        )
        self.meter: Meter = (meter_provider or NoOpMeterProvider()).get_meter(sc.SCOPE_NAME)
        self.instruments = inst.create_instruments(
            self.meter, histograms, genai_names=settings.genai_names
        )
        self._policy_gauges = (
            inst.policy_generation(self.meter, self._observe_generation),
            inst.policy_last_reload_success(self.meter, self._observe_reload_success),
        )

    @classmethod
    def disabled(cls, settings: TelemetrySettings) -> Telemetry:
        """A Telemetry whose every call is a no-op (``OTEL_SDK_DISABLED=true``)."""
        return cls(settings=settings, tracer_provider=None, meter_provider=None, pull_reader=None)

    @property
    def enabled(self) -> bool:
        """False for :meth:`disabled` telemetry (no spans, no metrics, no exports)."""
        return self._tracer_provider is not None or self._meter_provider is not None

    # --- spans ------------------------------------------------------------------------------------

    @safe(_no_span)
    def start_request_span(self, *, route: str, method: str, carrier: Mapping[str, str]) -> Span:
        """Start the SERVER span of one gateway request, continuing an incoming ``traceparent``.

        ``carrier`` is the request's headers (any case-insensitive mapping works; aiohttp's
        ``CIMultiDictProxy`` does). ``route`` is the route template, e.g. ``/v1/chat/completions``.
        """
        context = _PROPAGATOR.extract(carrier)
        return self.tracer.start_span(
            at.request_span_name(method, route),
            context=context,
            kind=SpanKind.SERVER,
            attributes={sc.HTTP_ROUTE: route, sc.HTTP_REQUEST_METHOD: method},
        )

    @safe(_no_span)
    def start_leg_span(
        self,
        parent: Span,
        *,
        operation: str,
        model: str | None,
        role: str,
        backend: str,
        server_address: str,
        stream: bool,
        start_unix_ns: int | None = None,
        provider: str = sc.PROVIDER_OPENAI,
    ) -> Span:
        """Start the CLIENT span of one upstream leg, named ``{operation} {model}``.

        End it with :meth:`finish_leg_span` when the leg's stream ends (not when headers arrive).
        A shadow leg may end after its parent request span; it stays in the same trace.
        """
        return self.tracer.start_span(
            at.leg_span_name(operation, model),
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            start_time=start_unix_ns,
            attributes=at.leg_start_attributes(
                operation=operation,
                model=model,
                role=role,
                backend=backend,
                server_address=server_address,
                stream=stream,
                provider=provider,
            ),
        )

    @staticmethod
    def traceparent(span: Span) -> str | None:
        """The W3C ``traceparent`` of ``span`` itself (None for a non-recording no-op span).

        Formatted directly from the span context: cheaper than a propagator round trip, for
        values kept rather than sent (e.g. to parent spans created later off the event loop).
        """
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    @staticmethod
    @safe(_no_headers)
    def traceparent_headers(span: Span) -> dict[str, str]:
        """W3C ``traceparent`` (and ``tracestate``) for the upstream request made under ``span``."""
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return headers

    @safe(nothing)
    def finish_leg_span(
        self,
        span: Span,
        leg: LegResult,
        *,
        end_unix_ns: int,
        capture_text: bool,
        max_chunk_events: int = 0,
    ) -> None:
        """Set a leg's result attributes, bounded chunk events and error status; end the span.

        Args:
            end_unix_ns: wall-clock end (the moment the leg's stream ended).
            capture_text: add ``gen_ai.output.messages`` (only when the policy allows capture).
            max_chunk_events: add up to this many ``specshadow.chunk`` events (first output events).
        """
        try:
            if span.is_recording():
                span.set_attributes(at.leg_result_attributes(leg, capture_text=capture_text))
                if max_chunk_events > 0 and leg.recording is not None:
                    _add_chunk_events(span, leg, max_chunk_events)
                if leg.outcome != "completed":
                    span.set_status(Status(StatusCode.ERROR, leg.outcome))
        finally:
            span.end(end_time=end_unix_ns)

    @safe(nothing)
    def annotate_request_span(
        self, span: Span, exchange: Exchange, *, capture_text: bool = False
    ) -> None:
        """Put the exchange's ids, policy and sampling decision (and, if allowed, the prompt) on
        the request span."""
        if not span.is_recording():
            return
        span.set_attributes(at.exchange_span_attributes(exchange))
        if capture_text and exchange.request_json is not None:
            span.set_attribute(
                sc.GEN_AI_INPUT_MESSAGES, at.input_messages_json(exchange.request_json)
            )

    @safe(nothing)
    def end_request_span(
        self,
        span: Span,
        *,
        status_code: int | None,
        error_type: str | None = None,
        end_unix_ns: int | None = None,
    ) -> None:
        """Set the response status (error status for 5xx or an error type, per HTTP semconv) and
        end the request span."""
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
    def record_comparisons(self, evidence: Evidence) -> None:
        """Count match/diverge per role and category, and add the comparison verdicts as
        ``gen_ai.evaluation.result`` events on a ``compare`` span in the exchange's trace.

        The request span has usually ended by now; the compare span is its child through the
        exchange's ``traceparent`` (no span without one: nothing would join it to the request).
        """
        comparisons = evidence.comparisons
        for c in comparisons:
            if c.exact_match is not None:
                outcome = "match" if c.exact_match else "diverge"
                # Labelled by the side that is not the primary, whichever leg served: during a
                # canary the primary may be the shadow of an answering candidate.
                role, backend = (c.a, c.a_backend) if c.b == "primary" else (c.b, c.b_backend)
                self.count_comparison(
                    outcome, role=role, category=evidence.category, backend=backend
                )
        traceparent = evidence.exchange.traceparent
        if not comparisons or traceparent is None:
            return
        span = self.tracer.start_span(
            "compare",
            context=_PROPAGATOR.extract({"traceparent": traceparent}),
            attributes={sc.EXCHANGE_ID: evidence.exchange.exchange_id, **_engines(evidence)},
        )
        try:
            for c in comparisons:
                _add_evaluation_events(span, at.evaluation_results(c))
        finally:
            span.end()

    # --- metrics ------------------------------------------------------------------------------------

    @safe(nothing)
    def record_exchange_metrics(self, exchange: Exchange, *, category: str | None = None) -> None:
        """Record every histogram and counter an exchange feeds, for every leg.

        Per leg: operation duration (e2e, or leg end for legs without output), time to first
        chunk, time per output token, chunk gaps (an even stride of at most
        ``max_chunk_gap_observations``), input/output token usage, tokens per event, vLLM
        acceptance length. Per primary leg: gateway overhead — the recorder keeps only the
        per-chunk p50/p99/max, so those three values are recorded under
        ``specshadow.overhead.stat``. Per shadow leg: ``specshadow.shadow.requests`` ``completed``
        or ``failed`` (reason = outcome); ``sampled``/``sent``/``dropped`` are counted by the
        gateway as they happen (:meth:`count_shadow`). ``category`` (the classifier's answer)
        stands in for ``exchange.category``.
        """
        category = category or exchange.category or UNCATEGORIZED
        for leg in exchange.legs:
            _record_leg(self.instruments, exchange, leg, category, self._max_gaps)

    def handle(self, evidence: Evidence) -> None:
        """An evidence consumer: metrics, comparisons and (when configured) the record as a log."""
        self.record_exchange_metrics(evidence.exchange, category=evidence.category)
        self.record_comparisons(evidence)
        if self._record_logger is not None:
            self.emit_record(evidence.record, unix_ns=evidence.exchange.started_unix_ns)

    @safe(nothing)
    def count_shadow(
        self, outcome: str, *, role: str, backend: str, reason: str | None = None
    ) -> None:
        """Count one shadow leg event: sampled | sent | completed | failed | dropped (with reason)."""
        attributes = {sc.OUTCOME: outcome, sc.LEG_ROLE: role, sc.BACKEND: backend}
        if reason is not None:
            attributes[sc.REASON] = reason
        self.instruments.shadow_requests.add(1, attributes)

    @safe(nothing)
    def set_breaker_state(self, backend: str, state: int) -> None:
        """Record a circuit breaker transition: 0 closed, 1 half-open, 2 open."""
        self.instruments.breaker_state.set(state, {sc.BACKEND: backend})

    # -- rollouts ---------------------------------------------------------------------------------

    @safe(nothing)
    def rollout_stage(self, rule: str, stage: str, serve_ratio: float) -> None:
        ri = self.instruments.rollout
        ri.stage.set(ROLLOUT_STAGES.get(stage, 0), {sc.RULE: rule})
        ri.serve_ratio.set(serve_ratio, {sc.RULE: rule})

    @safe(nothing)
    def rollout_store(self, store: str, up: bool) -> None:
        """Whether the shared rollout store (``serve --state sqlite://…|clickhouse://…``) answers."""
        self.instruments.rollout.store_up.set(1 if up else 0)

    @safe(nothing)
    def rollout_served(self, rule: str, backend: str, served_by: str) -> None:
        self.instruments.rollout.served.add(
            1, {sc.RULE: rule, sc.BACKEND: backend, sc.SERVED_BY: served_by}
        )

    @safe(nothing)
    def rollout_failover(self, rule: str, backend: str, reason: str) -> None:
        self.instruments.rollout.failovers.add(
            1, {sc.RULE: rule, sc.BACKEND: backend, sc.REASON: reason}
        )

    @safe(nothing)
    def rollout_drift(self, rule: str, guard: str, action: str) -> None:
        """One breach of a drift guard (``acceptance_drop``, ``speculation_off``) and what
        ``rollout.on_drift`` did about it (``canary``, ``shadow``, ``alert``)."""
        self.instruments.rollout.drift.add(1, {sc.RULE: rule, sc.GUARD: guard, sc.ACTION: action})

    @safe(nothing)
    def rollout_guards(self, rule: str, guards: Iterable[GuardReading]) -> None:
        """Each guard's value, threshold and breach flag (:class:`GuardReading`: what a
        ``rollout.guards.GuardState`` is to telemetry)."""
        ri = self.instruments.rollout
        for g in guards:
            attributes = {sc.RULE: rule, sc.GUARD: g.name}
            if g.value is not None and math.isfinite(g.value):
                ri.guard_value.set(g.value, attributes)
            ri.guard_threshold.set(g.threshold, attributes)
            ri.guard_breached.set(1 if g.status == "breach" else 0, attributes)

    @safe(nothing)
    def rollout_transition(self, t: StageChange, traceparent: str | None) -> None:
        """One stage change (:class:`StageChange`: what a ``rollout.state.Transition`` is
        to telemetry): counted, and an event on a span in the trace of the exchange that caused
        it (a root span when none did)."""
        ri = self.instruments.rollout
        counted: dict[str, str] = {
            sc.RULE: t.rule,
            sc.STAGE_FROM: t.from_stage,
            sc.STAGE_TO: t.to_stage,
            sc.ACTOR: t.by,
        }
        ri.transitions.add(1, counted)
        if t.to_stage == "shadow" and t.from_stage != "shadow":
            ri.rollbacks.add(1, {sc.RULE: t.rule, sc.GUARD: t.guard or t.by})
        context = None
        if traceparent is not None:
            context = _PROPAGATOR.extract({"traceparent": traceparent})
        span = self.tracer.start_span(
            sc.EVENT_ROLLOUT_TRANSITION, context=context, kind=SpanKind.INTERNAL
        )
        attributes: dict[str, str | float] = {**counted, "specshadow.rollout.reason": t.reason,
                      "specshadow.rollout.serve_ratio": t.serve_ratio}  # fmt: skip
        if t.guard is not None:
            attributes[sc.GUARD] = t.guard
        span.add_event(sc.EVENT_ROLLOUT_TRANSITION, attributes)
        span.end()

    @safe(nothing)
    def count_comparison(
        self, outcome: str, *, role: str, category: str | None, backend: str | None = None
    ) -> None:
        """Count one shadow-vs-primary comparison outcome (match | diverge | …) by the non-primary
        side's role and backend."""
        attributes = {
            sc.OUTCOME: outcome,
            sc.LEG_ROLE: role,
            sc.CATEGORY: category or UNCATEGORIZED,
        }
        if backend is not None:
            attributes[sc.BACKEND] = backend
        self.instruments.compare_results.add(1, attributes)

    @safe(nothing)
    def count_policy_reload(self, result: Literal["ok", "error"]) -> None:
        """Count one policy reload attempt."""
        self.instruments.policy_reload.add(1, {sc.RESULT: result})

    def bind_policy_status(self, status: PolicyStatus) -> None:
        """Serve ``specshadow.policy.generation`` and ``…last_reload_success`` from ``status``.

        ``status`` is called at collection time, possibly from the metric export thread: it must be
        cheap and must only read (e.g. two attributes of the policy holder).
        """
        self._policy_status = status

    def count_telemetry_dropped(self, signal: str, reason: str, count: int) -> None:
        """Exporter drop report (called from SDK export threads)."""
        if count > 0:
            self.instruments.telemetry_dropped.add(count, {sc.SIGNAL: signal, sc.REASON: reason})

    def _observe_generation(self, _options: CallbackOptions) -> Iterable[Observation]:
        status = self._read_policy_status()
        return [Observation(status[0])] if status is not None else []

    def _observe_reload_success(self, _options: CallbackOptions) -> Iterable[Observation]:
        status = self._read_policy_status()
        return [Observation(1 if status[1] else 0)] if status is not None else []

    @safe(_no_status)
    def _read_policy_status(self) -> tuple[int, bool] | None:
        return self._policy_status() if self._policy_status is not None else None

    # --- Prometheus and lifecycle ------------------------------------------------------------------

    def render_prometheus(self) -> tuple[bytes, str]:
        """(body, content type) for ``GET /metrics``: text exposition format 0.0.4."""
        if self._pull_reader is None:
            return b"", CONTENT_TYPE
        return render(
            self._pull_reader.collect_now(), resource=self._resource_attributes
        ), CONTENT_TYPE

    # --- records as log records ---------------------------------------------------------------

    @property
    def exports_records(self) -> bool:
        """True when comparison records also leave as OTLP log records (``OTEL_LOGS_EXPORTER``)."""
        return self._record_logger is not None

    @safe(nothing)
    def emit_record(self, record: Mapping[str, Any], *, unix_ns: int | None = None) -> None:
        """One comparison record as an OTLP log record (event ``specshadow.record``).

        The body is the record's JSON (the same document the embedded store keeps, so whatever
        the collector feeds — ClickHouse, object storage — holds the same schema); a few
        low-cardinality fields are repeated as attributes for routing. Batched and exported on
        the SDK's thread; a full queue drops (bounded memory).
        """
        logger = self._record_logger
        if logger is None:
            return
        r = read(record)
        attributes = {
            sc.RECORD_SCHEMA: r.schema,
            sc.EXCHANGE_ID: r.exchange_id,
            sc.CATEGORY: r.category,
        }
        logger.emit(
            timestamp=unix_ns,
            body=jsonx.dumps(record).decode(),
            attributes=attributes,
            event_name=sc.EVENT_RECORD,
        )

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is buffered; returns False if ``timeout_s`` passed first."""
        return self._bounded("otel-flush", self._flush, timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop both providers within ``timeout_s``; returns False if the bound passed.

        The work runs in a daemon thread: a black-holed collector can keep that thread busy until
        the exporter's own timeout, but not the caller.
        """
        if self._shutdown_done:
            return True
        self._shutdown_done = True
        return self._bounded("otel-shutdown", self._shutdown, timeout_s)

    def _flush(self, deadline_s: float) -> None:
        millis = int(max(0.0, deadline_s - time.monotonic()) * 1000)
        if self._tracer_provider is not None:
            self._tracer_provider.force_flush(millis)
        if self._meter_provider is not None:
            self._meter_provider.force_flush(millis)
        if self._logger_provider is not None:
            self._logger_provider.force_flush(millis)

    def _shutdown(self, deadline_s: float) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            millis = max(0.0, deadline_s - time.monotonic()) * 1000
            self._meter_provider.shutdown(timeout_millis=millis)
        if self._logger_provider is not None:
            self._logger_provider.shutdown()

    def _bounded(self, name: str, work: Callable[[float], None], timeout_s: float) -> bool:
        if (
            self._tracer_provider is None
            and self._meter_provider is None
            and self._logger_provider is None
        ):
            return True
        deadline_s = time.monotonic() + timeout_s

        def run() -> None:
            try:
                work(deadline_s)
            except Exception:  # noqa: BLE001 — telemetry teardown must not fail the process
                _log.debug("%s failed", name, exc_info=True)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            _log.warning("%s did not finish within %.1f s; abandoning it", name, timeout_s)
            return False
        return True


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
        at.put(attributes, sc.CHUNK_TOKENS, stamp.tokens)
        span.add_event(
            sc.EVENT_CHUNK,
            attributes,
            timestamp=leg.started_unix_ns + (stamp.received_ns - leg.t0_ns),
        )
        index += 1


def _add_evaluation_events(span: Span, results: Sequence[EvaluationResult]) -> None:
    """One ``gen_ai.evaluation.result`` event per comparison verdict."""
    if not span.is_recording():
        return
    for result in results:
        span.add_event(sc.EVENT_EVALUATION_RESULT, at.evaluation_attributes(result))


def _record_leg(
    instruments: inst.Instruments,
    exchange: Exchange,
    leg: LegResult,
    category_name: str,
    max_gaps: int,
) -> None:
    base = at.leg_metric_attributes(exchange, leg)
    category = {sc.CATEGORY: category_name}
    duration_attributes = dict(base)
    if leg.outcome != "completed":
        duration_attributes[sc.ERROR_TYPE] = at.leg_error_type(leg)
    rec = leg.recording
    e2e_s = rec.timings.e2e_s if rec is not None else None
    duration_s = e2e_s if e2e_s is not None else max(0.0, (leg.end_ns - leg.t0_ns) / 1e9)
    genai = instruments.genai
    for names in genai:
        names.duration.record(duration_s, _genai_attributes(names, duration_attributes))
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
        for names in genai:
            names.time_to_first_chunk.record(t.ttft_s, _genai_attributes(names, base))
    # Per-token figures only from exact counts (a stream without usage has an estimate, which
    # would sit beside other backends' exact ones on one dashboard; evidence.counts).
    exact = rec.tokens_source in EXACT_TOKENS
    if t.tpot_s is not None and exact:
        instruments.time_per_output_token.record(t.tpot_s, base)
    gaps = t.chunk_gaps_s
    # One Histogram.record per gap is the costliest part of recording (profiled): a long stream
    # contributes an evenly strided sample of at most max_gaps gaps, which keeps the quantiles
    # unbiased over the stream's length (a prefix would over-weight the first tokens).
    step = max(1, -(-len(gaps) // max(1, max_gaps)))
    sampled = gaps[::step]
    for names in genai:
        attributes = _genai_attributes(names, base)
        names.time_per_output_chunk.record_many(sampled, attributes)
        names.record_usage(rec.prompt_tokens, rec.output_tokens if exact else None, attributes)
    if t.tokens_per_event is not None and exact:
        instruments.tokens_per_event.record(t.tokens_per_event, {**base, **category})
    mean_length, _rate = at.vllm_acceptance(rec)
    if mean_length is not None:
        instruments.acceptance_length.record(mean_length, {**base, **category})
    for stat, value in (
        ("p50", t.overhead_p50_s),
        ("p99", t.overhead_p99_s),
        ("max", t.overhead_max_s),
    ):
        if value is not None:
            instruments.gateway_overhead.record(value, {**base, sc.OVERHEAD_STAT: stat})


def _genai_attributes(names: inst.GenAiMetrics, base: at.Attributes) -> at.Attributes:
    """The latest conventions require ``gen_ai.provider.name`` on every GenAI client metric."""
    if isinstance(names, inst.LatestGenAi):
        return {**base, sc.GEN_AI_PROVIDER_NAME: sc.PROVIDER_OPENAI}
    return base


def _engines(evidence: Evidence) -> dict[str, str]:
    """Each leg's engine fingerprints by role (the first leg of each role), when known."""
    out: dict[str, str] = {}
    for leg in read(evidence.record).legs:
        engine = leg.engine
        if engine is None or engine.config_fingerprint is None:
            continue
        out.setdefault(f"{sc.ENGINE_FINGERPRINT}.{leg.role}", engine.config_fingerprint)
        if engine.base_fingerprint is not None:
            out.setdefault(f"{sc.ENGINE_BASE_FINGERPRINT}.{leg.role}", engine.base_fingerprint)
    return out
