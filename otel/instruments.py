"""Instruments: one factory per metric, each documented "measured from … to …" (Envoy's habit).

Bucket boundaries are explicit (advisory boundaries) and finer than the semconv defaults where
specshadow needs it: gateway overhead starts at 10 µs, chunk gaps resolve 0.5–10 ms in steps a
speculative stream actually shows. Counters and gauges come from the
:class:`~opentelemetry.metrics.Meter` owned by one ``Telemetry``; histograms from a
:class:`HistogramSource` — the ``Telemetry``'s :class:`otel.histograms.HistogramTable` (same data
points, a tenth of the SDK's per-value cost), or the meter itself. Nothing here reads a global
provider.

Size: one factory per instrument, each documenting what it measures from and to, plus the two lock-
guarded tables the hot path uses instead of the SDK's synchronous instruments.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.metrics import (
    CallbackOptions,
    Counter,
    Histogram,
    Meter,
    ObservableGauge,
    Observation,
    _Gauge as Gauge,
)
from opentelemetry.util.types import Attributes

from otel import semconv as sc
from otel.histograms import AttributeKey, attribute_key


class HistogramLike(Protocol):
    """A histogram instrument: the SDK's call shape plus ``record_many`` (one attribute set)."""

    def record(self, amount: float, attributes: Attributes = None) -> None: ...

    def record_many(self, amounts: Iterable[float], attributes: Attributes = None) -> None: ...


class HistogramSource(Protocol):
    """What makes histograms: a :class:`otel.histograms.HistogramTable`, or a Meter via
    :class:`MeterHistograms`."""

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> HistogramLike: ...


class _SdkHistogram:
    __slots__ = ("_histogram",)

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram

    def record(self, amount: float, attributes: Attributes = None) -> None:
        self._histogram.record(amount, attributes)

    def record_many(self, amounts: Iterable[float], attributes: Attributes = None) -> None:
        for amount in amounts:
            self._histogram.record(amount, attributes)


class MeterHistograms:
    """A Meter's own histograms as a :class:`HistogramSource` (the no-op meter of disabled
    telemetry uses this)."""

    def __init__(self, meter: Meter) -> None:
        self._meter = meter

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> HistogramLike:
        return _SdkHistogram(
            self._meter.create_histogram(
                name,
                unit=unit,
                description=description,
                explicit_bucket_boundaries_advisory=explicit_bucket_boundaries_advisory,
            )
        )


# semconv's gen_ai.client.operation.duration boundaries, with 1/2.5/5 ms in front for fast fakes.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
    1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
# semconv's server TTFT boundaries, refined below 100 ms (Envoy's genai.go does the same).
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1,
    0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# Chunk gaps: 0.25 ms … 2.5 s, dense in 1–10 ms (CPU speculative streams live there).
CHUNK_GAP_BUCKETS_S: tuple[float, ...] = (
    0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.01,
    0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Gateway overhead per chunk: 10 µs … 100 ms.
OVERHEAD_BUCKETS_S: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1,
)  # fmt: skip
# semconv's gen_ai.client.token.usage boundaries.
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
# Tokens per event / acceptance length: 1 (no speculation) … 16 (deep drafts).
TOKENS_PER_STEP_BUCKETS: tuple[float, ...] = (
    1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0, 10.0, 16.0,
)  # fmt: skip


def operation_duration(meter: HistogramSource) -> HistogramLike:
    """``gen_ai.client.operation.duration`` (s), one observation per leg.

    Measured from t0 (the gateway starts sending the leg's request upstream) to the receive time
    of the leg's last output-bearing event (``e2e``); for a leg without output, to the moment the
    leg ended (error, timeout, disconnect). Attributes: operation, request model, role, backend,
    error.type on failure.
    """
    return meter.create_histogram(
        sc.METRIC_OPERATION_DURATION,
        unit="s",
        description="GenAI operation duration: t0 to the last output-bearing event (or leg end).",
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
    )


def time_to_first_chunk(meter: HistogramSource) -> HistogramLike:
    """``gen_ai.client.operation.time_to_first_chunk`` (s), one observation per streaming leg.

    Measured from t0 to the receive time of the first SSE event that carries generated output.
    """
    return meter.create_histogram(
        sc.METRIC_TIME_TO_FIRST_CHUNK,
        unit="s",
        description="t0 to the first output-bearing SSE event of a streaming leg.",
        explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S,
    )


def time_per_output_chunk(meter: HistogramSource) -> HistogramLike:
    """``gen_ai.client.operation.time_per_output_chunk`` (s), one observation per chunk gap.

    Measured from the receive time of one output-bearing SSE event to that of the next (vLLM
    bench's ITL, AIPerf's ICL). Events read in the same network read share a timestamp and give a
    gap of 0. Bounded per leg: an even stride of at most ``max_chunk_gap_observations`` gaps.
    """
    return meter.create_histogram(
        sc.METRIC_TIME_PER_OUTPUT_CHUNK,
        unit="s",
        description="Gap between consecutive output-bearing SSE events of one leg.",
        explicit_bucket_boundaries_advisory=CHUNK_GAP_BUCKETS_S,
    )


def time_per_output_token(meter: HistogramSource) -> HistogramLike:
    """``specshadow.time_per_output_token`` (s), one observation per leg with ≥ 2 output tokens.

    Measured as (e2e − ttft) / (output_tokens − 1): from the first output-bearing event to the last,
    divided over the tokens after the first (vLLM bench TPOT; GuideLLM calls it ITL). Only legs
    whose count is exact (their own usage or logprobs, or matched or tokenized: evidence.counts):
    an estimated count never sits beside an exact one on a dashboard.
    """
    return meter.create_histogram(
        sc.METRIC_TIME_PER_OUTPUT_TOKEN,
        unit="s",
        description="(e2e - ttft) / (output_tokens - 1) of one leg.",
        explicit_bucket_boundaries_advisory=CHUNK_GAP_BUCKETS_S,
    )


def token_usage(meter: HistogramSource) -> HistogramLike:
    """``gen_ai.client.token.usage`` ({token}), per leg and ``gen_ai.token.type`` (input|output).

    Measured from the upstream's ``usage`` (prompt/completion tokens) when present, otherwise the
    recorder's estimate (``specshadow.tokens.source`` on the span says which).
    """
    return meter.create_histogram(
        sc.METRIC_TOKEN_USAGE,
        unit="{token}",
        description="Tokens used per leg, by gen_ai.token.type.",
        explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
    )


def gateway_overhead(meter: HistogramSource) -> HistogramLike:
    """``specshadow.gateway.overhead`` (s), per primary leg and ``specshadow.overhead.stat``.

    Measured per network chunk from the moment the gateway read it from the upstream to the moment
    it was written to the client. The recorder keeps only the per-leg p50, p99 and max of those
    per-chunk values, so each primary leg contributes three observations, one per stat label;
    ``histogram_quantile`` over ``stat="p50"`` is the distribution of per-request medians.
    """
    return meter.create_histogram(
        sc.METRIC_GATEWAY_OVERHEAD,
        unit="s",
        description="Per-chunk gateway hold time (read from upstream to written to client); per-leg p50/p99/max.",
        explicit_bucket_boundaries_advisory=OVERHEAD_BUCKETS_S,
    )


def tokens_per_event(meter: HistogramSource) -> HistogramLike:
    """``specshadow.tokens_per_event`` ({token}), one observation per leg with output and an
    exact count (as ``time_per_output_token``).

    Measured as output tokens / output-bearing SSE events of one leg. On a speculative backend this
    estimates tokens per target forward pass.
    """
    return meter.create_histogram(
        sc.METRIC_TOKENS_PER_EVENT,
        unit="{token}",
        description="Output tokens per output-bearing SSE event of one leg.",
        explicit_bucket_boundaries_advisory=TOKENS_PER_STEP_BUCKETS,
    )


def acceptance_length(meter: HistogramSource) -> HistogramLike:
    """``specshadow.acceptance.length`` ({token}), by role, backend and category.

    Measured as vLLM's per-request ``speculative_decoding.mean_acceptance_length`` (tokens per
    speculative step in which the proposer drafted), one observation per leg that reported it.
    """
    return meter.create_histogram(
        sc.METRIC_ACCEPTANCE_LENGTH,
        unit="{token}",
        description="vLLM per-request mean acceptance length.",
        explicit_bucket_boundaries_advisory=TOKENS_PER_STEP_BUCKETS,
    )


class _Observed:
    """Values kept in a dict under a lock, reported by an observable instrument at collection."""

    def __init__(self) -> None:
        self._values: dict[AttributeKey, float] = {}
        self._lock = threading.Lock()

    def _observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            items = list(self._values.items())
        return [Observation(value, dict(key)) for key, value in items]


class ObservedCounter(_Observed):
    """A monotonic counter kept in a dict and reported by an ``ObservableCounter`` at collection.

    For counters bumped on the event loop's hot path: ``add`` is a locked dict update (~1 µs),
    where the SDK's ``Counter.add`` re-validates and re-hashes the attributes (~14 µs). Exported
    exactly like a synchronous counter (a cumulative monotonic sum; delta readers get deltas).
    """

    def __init__(self, meter: Meter, name: str, *, unit: str, description: str) -> None:
        super().__init__()
        meter.create_observable_counter(
            name, callbacks=[self._observe], unit=unit, description=description
        )

    def add(self, amount: int, attributes: Attributes = None) -> None:
        key = attribute_key(attributes)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount


class GaugeTable(_Observed):
    """Last-value gauges kept in a dict and reported by an ``ObservableGauge`` at collection:
    set from any thread (the rollout controller runs on the evidence worker)."""

    def __init__(self, meter: Meter, name: str, *, unit: str = "1", description: str) -> None:
        super().__init__()
        meter.create_observable_gauge(
            name, callbacks=[self._observe], unit=unit, description=description
        )

    def set(self, value: float, attributes: Attributes = None) -> None:
        key = attribute_key(attributes)
        with self._lock:
            self._values[key] = value


def shadow_requests(meter: Meter) -> ObservedCounter:
    """``specshadow.shadow.requests`` ({request}), by outcome, role, backend and reason.

    Counted at each step of a shadow leg's life: ``sampled`` (policy chose to mirror), ``sent``
    (request dispatched upstream), ``dropped`` (budget/breaker refused it, with reason),
    ``completed`` / ``failed`` (the leg's stream ended normally / not, reason = stream outcome).
    ``sampled`` and ``sent`` are counted on the event loop, before and as the shadow request
    leaves, hence an :class:`ObservedCounter`.
    """
    return ObservedCounter(
        meter,
        sc.METRIC_SHADOW_REQUESTS,
        unit="{request}",
        description="Shadow legs by outcome: sampled, sent, completed, failed, dropped.",
    )


def breaker_state(meter: Meter) -> Gauge:
    """``specshadow.shadow.breaker.state`` (dimensionless), per backend: 0 closed, 1 half-open, 2 open.

    Measured as the circuit breaker's state at its last transition.
    """
    return meter.create_gauge(
        sc.METRIC_BREAKER_STATE,
        description="Shadow circuit breaker state per backend: 0 closed, 1 half-open, 2 open.",
    )


def policy_generation(
    meter: Meter, callback: Callable[[CallbackOptions], Iterable[Observation]]
) -> ObservableGauge:
    """``specshadow.policy.generation`` (dimensionless): the active policy's generation, read at collection."""
    return meter.create_observable_gauge(
        sc.METRIC_POLICY_GENERATION,
        callbacks=[callback],
        description="Generation number of the policy currently serving.",
    )


def policy_last_reload_success(
    meter: Meter, callback: Callable[[CallbackOptions], Iterable[Observation]]
) -> ObservableGauge:
    """``specshadow.policy.last_reload_success`` (dimensionless): 1 if the last reload attempt succeeded, else 0.

    Read at collection time from the callable the gateway bound.
    """
    return meter.create_observable_gauge(
        sc.METRIC_POLICY_LAST_RELOAD_SUCCESS,
        callbacks=[callback],
        description="1 if the last policy reload attempt succeeded, 0 if it was rejected.",
    )


def policy_reload(meter: Meter) -> Counter:
    """``specshadow.policy.reload`` ({reload}), by result ok|error.

    Counted once per reload attempt, when the new file has been validated (ok) or rejected (error).
    """
    return meter.create_counter(
        sc.METRIC_POLICY_RELOAD,
        unit="{reload}",
        description="Policy reload attempts by result.",
    )


def telemetry_dropped(meter: Meter) -> Counter:
    """``specshadow.telemetry.dropped`` ({item}), by signal (spans|metrics) and reason.

    Counted when a finished span could not enter the export queue (``queue_full``), when a
    finished exchange could not enter the metric worker's queue (``metrics``/``queue_full``: its
    histograms are lost), when an export to the collector failed (``export_failed``, spans or
    metric data points), or when the provider was already shut down (``shutdown``).
    """
    return meter.create_counter(
        sc.METRIC_TELEMETRY_DROPPED,
        unit="{item}",
        description="Spans and metric data points dropped by the exporters.",
    )


def compare_results(meter: Meter) -> Counter:
    """``specshadow.compare.results`` ({comparison}), by outcome (match|diverge|…), role, category.

    Counted once per shadow leg compared against its primary.
    """
    return meter.create_counter(
        sc.METRIC_COMPARE_RESULTS,
        unit="{comparison}",
        description="Shadow-vs-primary comparison outcomes.",
    )


class LegacyGenAi:
    """The GenAI client metrics under the names of core semconv ≤ 1.36 (the default)."""

    def __init__(self, hist: HistogramSource) -> None:
        self.duration = operation_duration(hist)
        self.time_to_first_chunk = time_to_first_chunk(hist)
        self.time_per_output_chunk = time_per_output_chunk(hist)
        self.token_usage = token_usage(hist)

    def record_usage(
        self, input_tokens: int | None, output_tokens: int | None, base: Mapping[str, Any]
    ) -> None:
        if input_tokens is not None:
            self.token_usage.record(
                input_tokens, {**base, sc.GEN_AI_TOKEN_TYPE: sc.TOKEN_TYPE_INPUT}
            )
        if output_tokens is not None:
            self.token_usage.record(
                output_tokens, {**base, sc.GEN_AI_TOKEN_TYPE: sc.TOKEN_TYPE_OUTPUT}
            )


class LatestGenAi:
    """The GenAI client metrics under the latest names (semantic-conventions-genai
    :data:`~otel.semconv.GENAI_SEMCONV_VERSION`; opt-in).

    Same measurements as :class:`LegacyGenAi` — duration, time to first chunk, time per output
    chunk, measured from and to the same moments — and usage as the spec now splits it: monotonic
    counters of input and output tokens (``gen_ai.token.modality`` = ``unknown``: OpenAI usage
    has no per-modality split) and one histogram of each per operation.
    """

    def __init__(self, hist: HistogramSource, meter: Meter) -> None:
        self.duration = hist.create_histogram(
            sc.METRIC_INFERENCE_DURATION,
            unit="s",
            description="GenAI inference duration: t0 to the last output-bearing event (or leg end).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )
        self.time_to_first_chunk = hist.create_histogram(
            sc.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK,
            unit="s",
            description="t0 to the first output-bearing SSE event of a streaming leg.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S,
        )
        self.time_per_output_chunk = hist.create_histogram(
            sc.METRIC_INFERENCE_TIME_PER_OUTPUT_CHUNK,
            unit="s",
            description="Gap between consecutive output-bearing SSE events of one leg.",
            explicit_bucket_boundaries_advisory=CHUNK_GAP_BUCKETS_S,
        )
        self.input_tokens = ObservedCounter(
            meter,
            sc.METRIC_INFERENCE_USAGE_INPUT_TOKENS,
            unit="{token}",
            description="Input tokens of every inference, from the upstream's usage.",
        )
        self.output_tokens = ObservedCounter(
            meter,
            sc.METRIC_INFERENCE_USAGE_OUTPUT_TOKENS,
            unit="{token}",
            description="Output tokens of every inference, from the upstream's usage.",
        )
        self.operation_input_tokens = hist.create_histogram(
            sc.METRIC_INFERENCE_OPERATION_INPUT_TOKENS,
            unit="{token}",
            description="Input tokens per inference.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self.operation_output_tokens = hist.create_histogram(
            sc.METRIC_INFERENCE_OPERATION_OUTPUT_TOKENS,
            unit="{token}",
            description="Output tokens per inference.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )

    def record_usage(
        self, input_tokens: int | None, output_tokens: int | None, base: Mapping[str, Any]
    ) -> None:
        counted = {**base, sc.GEN_AI_TOKEN_MODALITY: sc.TOKEN_MODALITY_UNKNOWN}
        if input_tokens is not None:
            self.input_tokens.add(input_tokens, counted)
            self.operation_input_tokens.record(input_tokens, base)
        if output_tokens is not None:
            self.output_tokens.add(output_tokens, counted)
            self.operation_output_tokens.record(output_tokens, base)


GenAiMetrics = LegacyGenAi | LatestGenAi


@dataclass(frozen=True, slots=True)
class RolloutInstruments:
    """``specshadow.rollout.*``: where each rule stands, who answers, the guards, the changes."""

    stage: GaugeTable
    serve_ratio: GaugeTable
    served: ObservedCounter
    guard_value: GaugeTable
    guard_threshold: GaugeTable
    guard_breached: GaugeTable
    rollbacks: ObservedCounter
    transitions: ObservedCounter
    failovers: ObservedCounter
    store_up: GaugeTable
    drift: ObservedCounter

    @classmethod
    def create(cls, meter: Meter) -> RolloutInstruments:
        return cls(
            stage=GaugeTable(meter, sc.METRIC_ROLLOUT_STAGE,
                             description="Rollout stage per rule: 0 shadow, 1 canary, 2 live."),
            serve_ratio=GaugeTable(meter, sc.METRIC_ROLLOUT_SERVE_RATIO,
                                   description="Share of the rule's requests the candidate answers."),
            served=ObservedCounter(meter, sc.METRIC_ROLLOUT_SERVED, unit="{request}",
                                   description="Answers of rolling-out rules, by backend and who served."),
            guard_value=GaugeTable(meter, sc.METRIC_ROLLOUT_GUARD_VALUE,
                                   description="Each rollout guard's current value over its window."),
            guard_threshold=GaugeTable(meter, sc.METRIC_ROLLOUT_GUARD_THRESHOLD,
                                       description="Each rollout guard's threshold."),
            guard_breached=GaugeTable(meter, sc.METRIC_ROLLOUT_GUARD_BREACHED,
                                      description="1 while a rollout guard's confidence bound is past its threshold."),
            rollbacks=ObservedCounter(meter, sc.METRIC_ROLLOUT_ROLLBACKS, unit="{rollback}",
                                      description="Automatic and operator rollbacks, by rule and guard."),
            transitions=ObservedCounter(meter, sc.METRIC_ROLLOUT_TRANSITIONS, unit="{transition}",
                                        description="Rollout stage changes, by rule, stages and actor."),
            failovers=ObservedCounter(meter, sc.METRIC_ROLLOUT_FAILOVERS, unit="{request}",
                                      description="Candidate answers that failed before their first byte and were served by the primary."),
            store_up=GaugeTable(meter, sc.METRIC_ROLLOUT_STORE_UP,
                                description="1 while the shared rollout store answers, 0 while this replica serves its last decision without it."),
            drift=ObservedCounter(meter, sc.METRIC_ROLLOUT_DRIFT, unit="{breach}",
                                  description="Breaches of acceptance_drop and speculation_off, by rule, guard and what rollout.on_drift did."),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Instruments:
    """The synchronous instruments of one Telemetry (observable gauges are held by Telemetry).

    ``genai`` holds one set of GenAI client metrics per naming generation the settings ask for
    (``legacy``, ``latest``, or both); every measurement is recorded into each.
    """

    genai: tuple[GenAiMetrics, ...]
    time_per_output_token: HistogramLike
    gateway_overhead: HistogramLike
    tokens_per_event: HistogramLike
    acceptance_length: HistogramLike
    shadow_requests: ObservedCounter
    breaker_state: Gauge
    policy_reload: Counter
    telemetry_dropped: Counter
    compare_results: Counter
    rollout: RolloutInstruments


def create_instruments(
    meter: Meter,
    histograms: HistogramSource | None = None,
    *,
    genai_names: sc.GenAiNames = "legacy",
) -> Instruments:
    """Create every synchronous instrument: counters and gauges on ``meter``, histograms from
    ``histograms`` (default: ``meter``'s own); the GenAI metrics under ``genai_names``."""
    hist = histograms if histograms is not None else MeterHistograms(meter)
    genai: list[GenAiMetrics] = []
    if genai_names in ("legacy", "both"):
        genai.append(LegacyGenAi(hist))
    if genai_names in ("latest", "both"):
        genai.append(LatestGenAi(hist, meter))
    return Instruments(
        genai=tuple(genai),
        time_per_output_token=time_per_output_token(hist),
        gateway_overhead=gateway_overhead(hist),
        tokens_per_event=tokens_per_event(hist),
        acceptance_length=acceptance_length(hist),
        shadow_requests=shadow_requests(meter),
        breaker_state=breaker_state(meter),
        policy_reload=policy_reload(meter),
        telemetry_dropped=telemetry_dropped(meter),
        compare_results=compare_results(meter),
        rollout=RolloutInstruments.create(meter),
    )
