"""The evidence vocabulary: what is learned from a finished exchange, as values.

The evidence pipeline (:mod:`evidence`) computes these once per exchange — category, per-leg
acceptance, comparisons between legs, the comparison record — and hands one :class:`Evidence` to
every consumer (the record store, metrics and spans, OTLP logs, rollout guards). Consumers read
these types only, so none of them depends on how the evidence was computed. Pure values; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from core.exchange import Exchange, Role

DivergenceUnit = Literal["token", "char"]

# Where a per-request acceptance figure came from (docs/concepts.md, "Acceptance, three ways").
AcceptanceSource = Literal["vllm_metrics", "stream_shape", "prometheus"]
# Which engine report the per-request counts were read from (evidence.acceptance):
# vLLM's top-level ``metrics.speculative_decoding``; the per-choice stats vLLM shipped before it
# (and TensorRT-LLM's serve sends in the same place); SGLang's ``meta_info``; or the OpenAI-style
# ``usage.completion_tokens_details.{accepted,rejected}_prediction_tokens``; llama.cpp's
# ``timings.draft_n`` / ``timings.draft_n_accepted``.
EngineAcceptanceSource = Literal[
    "vllm_metrics",
    "choice_stats",
    "sglang_meta_info",
    "usage_prediction_tokens",
    "llamacpp_timings",
]
# Which lower bound on a streamed leg's target passes set its tokens per pass: its output-bearing
# events, or output − accepted from the engine's counts when a loaded server merged passes.
TokensPerPassSource = Literal["stream_shape", "engine_counts"]


@dataclass(frozen=True, slots=True)
class LatencyDelta:
    """One paired latency quantity: ``delta = b − a`` (seconds, or tokens for tokens_per_event)."""

    name: str  # ttft_s, tpot_s, chunk_gap_p50_s, chunk_gap_p99_s, e2e_s, tokens_per_event
    a: float | None
    b: float | None
    delta: float | None
    ratio: float | None  # b / a; None when either is unknown or a is 0


@dataclass(frozen=True, slots=True)
class Comparison:
    """Leg ``b`` judged against leg ``a``. ``None`` means unknown or not applicable."""

    a: Role
    b: Role
    comparable: bool  # both legs completed with a recording; otherwise text fields are None
    greedy: bool
    exact_match: bool | None
    first_divergence: int | None
    divergence_unit: DivergenceUnit | None
    divergence_fraction: float | None
    similarity: float | None
    similarity_capped: bool
    finish_reason_equal: bool | None
    length_ratio: float | None  # b's output units / a's
    json_expected: bool
    json_valid_a: bool | None
    json_valid_b: bool | None
    json_equal: bool | None
    tool_names_equal: bool | None
    tool_arguments_equal: bool | None
    refusal_a: bool | None
    refusal_b: bool | None
    one_sided_refusal: bool | None
    citations_a: tuple[int, ...] | None
    citations_b: tuple[int, ...] | None
    citations_equal: bool | None
    latency: tuple[LatencyDelta, ...]
    flag: bool  # greedy and not an exact match: worth a look one by one
    a_backend: str | None = None  # the backends behind a and b (several candidates share a role)
    b_backend: str | None = None

    def latency_delta(self, name: str) -> LatencyDelta | None:
        return next((d for d in self.latency if d.name == name), None)


@dataclass(frozen=True, slots=True)
class LegAcceptance:
    """One leg's per-request acceptance evidence; ``None`` where a source had nothing."""

    mean_acceptance_length: float | None
    draft_acceptance_rate: float | None
    num_drafts: int | None
    num_draft_tokens: int | None
    num_accepted_tokens: int | None
    source: EngineAcceptanceSource | None  # of the five fields above
    tokens_per_pass: float | None
    tokens_per_pass_source: TokensPerPassSource | None
    coverage: float | None


NO_ACCEPTANCE = LegAcceptance(None, None, None, None, None, None, None, None, None)


# Why a speculative engine served a request with plain decoding (vLLM skips speculation for
# requests with these sampling parameters): the candidate's speed-up and acceptance leave them out.
SpeculationSkip = Literal["penalty", "min_p", "no_drafts"]


@dataclass(frozen=True, slots=True)
class LegQuality:
    """One completed leg's output, as the quality tests see it (docs/quality.md).

    Scalars a two-sample test compares across legs of the same exchange, without the text:
    ``units`` (output tokens, or words when the stream carried no token counts), whether it
    stopped at ``max_tokens`` (``finish_length``), ``distinct_2`` (distinct word bigrams / all),
    ``repetition`` (share of word 4-grams seen before in the same output), ``longest_repeat``
    (words in the longest span that occurs twice), ``refusal``, ``json_valid`` (where JSON was
    asked, else None), ``tool_calls`` and ``tool_valid`` (every call named, its arguments a JSON
    object; None without calls), ``citations`` (distinct ``[n]`` markers), ``similarity`` to the
    primary's output (None on the primary). ``sketch``: the output's character 4-grams hashed into
    signed buckets, L2-normalised — the explicit feature map of the string kernel the MMD test
    uses; None for greedy exchanges (exact match is the sharper test there) and empty outputs.
    """

    units: int
    finish_length: bool
    distinct_2: float | None
    repetition: float | None
    longest_repeat: int
    refusal: bool
    json_valid: bool | None
    tool_calls: int
    tool_valid: bool | None
    citations: int
    similarity: float | None
    sketch: tuple[float, ...] | None


class Evidence:
    """Everything learned from one exchange; built once, read by every consumer.

    ``acceptance`` and ``quality`` have one entry per leg, in ``exchange.legs`` order (``quality``
    is None for a leg that did not complete; empty when nothing was measured).
    ``speculation_skip``: the request's parameters make a speculative engine decode plainly.
    ``engines``: each leg's backend → the fingerprint of its engine configuration, when known
    (``evidence.engine_config``; the rollout restarts a canary when its candidate's changes).
    The comparison record (a JSON-ready mapping, schema in docs/records.md) is built on first
    access of :attr:`record`: consumers that never read it (metrics, guards) never pay for it.
    """

    __slots__ = (
        "_record",
        "_record_factory",
        "acceptance",
        "category",
        "category_source",
        "comparisons",
        "engines",
        "exchange",
        "greedy",
        "quality",
        "speculation_skip",
    )

    def __init__(
        self,
        exchange: Exchange,
        *,
        category: str | None,
        category_source: str,
        greedy: bool,
        comparisons: tuple[Comparison, ...],
        acceptance: tuple[LegAcceptance, ...],
        record: Callable[[Evidence], Mapping[str, Any]],
        quality: tuple[LegQuality | None, ...] = (),
        speculation_skip: SpeculationSkip | None = None,
        engines: Mapping[str, str] | None = None,
    ) -> None:
        self.exchange = exchange
        self.category = category
        self.category_source = category_source
        self.greedy = greedy
        self.comparisons = comparisons
        self.acceptance = acceptance
        self.quality = quality
        self.speculation_skip = speculation_skip
        self.engines: Mapping[str, str] = engines or {}
        self._record_factory = record
        self._record: Mapping[str, Any] | None = None

    @property
    def record(self) -> Mapping[str, Any]:
        """The comparison record of this exchange (built once, on first use)."""
        if self._record is None:
            self._record = self._record_factory(self)
        return self._record


@runtime_checkable
class EvidenceConsumer(Protocol):
    """Receives every exchange's evidence on the evidence worker's thread, in order.

    ``handle`` must not block for long (the worker serves every consumer in turn) and may raise:
    the worker counts the failure and goes on with the next consumer. Optional steps, called when
    the consumer defines them: ``flush()`` whenever the worker's queue has run empty (a consumer
    that batches commits there) and ``close()`` once, at shutdown, after the last ``flush``. A
    plain callable taking the evidence is a consumer too.
    """

    def handle(self, evidence: Evidence) -> None: ...
