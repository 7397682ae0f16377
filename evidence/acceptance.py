"""Acceptance: how many drafted tokens a leg accepted, per request, from what it recorded (pure).

Three sources, never conflated (docs/concepts.md, "Acceptance, three ways"); each value carries its origin:

- the engine's own per-request counts (:func:`engine_counts`), named by where they were found:
  ``vllm_metrics`` (vLLM's ``metrics.speculative_decoding``, also inside the Responses API's
  ``response.completed``), ``choice_stats`` (the per-choice stats of earlier vLLM builds and
  TensorRT-LLM's serve), ``sglang_meta_info`` (SGLang's ``choices[].meta_info`` with
  ``return_meta_info``: ``spec_verify_ct``, ``spec_accept_token_num``, …) and
  ``usage_prediction_tokens`` (``accepted``/``rejected_prediction_tokens``: a rate, no length)
  and ``llamacpp_timings`` (llama.cpp's top-level ``timings.draft_n`` / ``draft_n_accepted``, on
  the body or a stream's last chunk: drafted and accepted tokens, no step count — a rate, no
  length; absent when the request drafted nothing).
  ``mean_acceptance_length`` is 1 + accepted drafts per *drafting* step,
  ``draft_acceptance_rate`` accepted / drafted tokens, with the raw counts for pooling.
- ``stream_shape`` — ``tokens_per_pass``: output tokens per output-bearing event of a streamed
  leg. A speculative engine emits one verification step's tokens together, so this estimates
  tokens per *target pass* — including the steps where the proposer had no draft, which is why it
  sits below ``mean_acceptance_length``. Only from exact token counts (usage or logprobs) of a
  completed stream; ``None`` otherwise. A loaded serving process merges passes into one event,
  so where the engine's counts say more passes (output − accepted > events), those set it and
  the source reads ``engine_counts`` (:func:`tokens_per_pass`).
- ``prometheus`` — the backend's ``vllm:spec_decode_*`` counters over a window
  (:mod:`evidence.scrape`): per backend, not per request; recorded next to the per-request values.

``coverage`` = (tokens_per_pass − 1) / (mean_acceptance_length − 1): the share of target passes
that had a draft at all, when both per-request sources are present (see docs/concepts.md: tokens per pass
is what buys latency; acceptance length and coverage explain it).

Attribution keys: category, :func:`output_length_bucket`, :func:`concurrency_bucket`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from core.evidence import (
    NO_ACCEPTANCE,
    EngineAcceptanceSource,
    LegAcceptance,
    TokensPerPassSource,
)
from core.jsonx import as_int, as_number
from core.timings import EXACT_TOKENS, Recording


def _first(stats: Mapping[str, Any], names: tuple[str, ...], kind: Any) -> Any:
    for name in names:
        value = kind(stats.get(name))
        if value is not None:
            return value
    return None


# The names each engine (and each version of it) gave the same counts, best first:
# vLLM's merged per-request metrics and its earlier per-choice stats, an unmerged vLLM revision,
# TensorRT-LLM's serve (``num_spec_steps``, ``total_*``), and SGLang's ``meta_info`` variants.
_STEPS = ("num_spec_steps", "num_drafts", "num_draft_steps", "spec_verify_ct")
_DRAFTED = (
    "num_draft_tokens",
    "num_drafted_tokens",
    "total_draft_tokens",
    "spec_draft_token_num",
    "spec_num_proposed_drafts",
    "spec_proposed_drafts",
)
_ACCEPTED = (
    "num_accepted_draft_tokens",
    "num_accepted_tokens",
    "total_accepted_draft_tokens",
    "spec_accept_token_num",
    "spec_num_correct_drafts",
    "spec_accepted_drafts",
)
_LENGTH = ("mean_acceptance_length", "mean_accepted_length_per_step", "spec_accept_length")
_RATE = ("draft_acceptance_rate", "acceptance_rate", "spec_accept_rate")


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """One engine report's per-request counts, whatever its field names."""

    source: EngineAcceptanceSource
    steps: int | None  # target passes that verified a draft
    drafted: int | None
    accepted: int | None
    length: float | None  # 1 + accepted / steps
    rate: float | None  # accepted / drafted

    @classmethod
    def read(cls, source: EngineAcceptanceSource, stats: Mapping[str, Any]) -> EngineCounts | None:
        counts = cls(
            source,
            _first(stats, _STEPS, as_int),
            _first(stats, _DRAFTED, as_int),
            _first(stats, _ACCEPTED, as_int),
            _first(stats, _LENGTH, as_number),
            _first(stats, _RATE, as_number),
        )
        known = counts.length is not None or counts.rate is not None
        if not known and counts.accepted is not None and (counts.steps or counts.drafted):
            known = True
        return counts if known else None


def engine_counts(rec: Recording) -> EngineCounts | None:
    """The engine's own per-request speculative counts, from wherever this engine puts them."""
    metrics = rec.vllm_metrics
    spec = metrics.get("speculative_decoding") if metrics is not None else None
    if isinstance(spec, Mapping):
        found = EngineCounts.read("vllm_metrics", spec)
        if found is not None:
            return found
    stats = rec.engine_stats or {}
    choice = stats.get("choice_stats")
    if isinstance(choice, Mapping) and (found := EngineCounts.read("choice_stats", choice)):
        return found
    meta = stats.get("meta_info")
    if isinstance(meta, Mapping) and (found := EngineCounts.read("sglang_meta_info", meta)):
        return found
    timings = stats.get("timings")
    if isinstance(timings, Mapping) and (found := _llamacpp_timings(timings)):
        return found
    return _prediction_tokens(rec.usage)


def _llamacpp_timings(timings: Mapping[str, Any]) -> EngineCounts | None:
    """llama.cpp's ``timings``: ``draft_n`` tokens drafted, ``draft_n_accepted`` accepted. The
    server counts drafting steps only in ``/metrics`` (``llamacpp:spec_decode_num_drafts_total``),
    so a request has a rate and counts but no acceptance length. Absent (a plain server, or a
    request that drafted nothing): None."""
    drafted = as_int(timings.get("draft_n"))
    accepted = as_int(timings.get("draft_n_accepted"))
    if drafted is None or accepted is None or accepted > drafted or accepted < 0:
        return None
    rate = accepted / drafted if drafted else None
    return EngineCounts("llamacpp_timings", None, drafted, accepted, None, rate)


def _prediction_tokens(usage: Mapping[str, Any] | None) -> EngineCounts | None:
    """``completion_tokens_details.{accepted,rejected}_prediction_tokens``: engines that report
    speculation through the OpenAI usage fields. OpenAI itself uses them for Predicted Outputs
    (how much of a client-given ``prediction`` appeared) — all zero without one, so zeros say
    nothing. No step count: an acceptance rate, never a length."""
    details = usage.get("completion_tokens_details") if usage is not None else None
    if not isinstance(details, Mapping):
        return None
    accepted = as_int(details.get("accepted_prediction_tokens"))
    rejected = as_int(details.get("rejected_prediction_tokens"))
    if accepted is None or rejected is None or accepted + rejected == 0:
        return None
    drafted = accepted + rejected
    return EngineCounts(
        "usage_prediction_tokens", None, drafted, accepted, None, accepted / drafted
    )


def tokens_per_pass(
    rec: Recording, accepted: int | None = None
) -> tuple[float, TokensPerPassSource] | None:
    """Tokens per target pass of a completed stream with exact token counts, and which bound set
    it; None when the leg cannot support it (see module doc).

    Both the stream's events and, where the engine counted its accepted drafts, output − accepted
    are lower bounds on the target passes: a serving process that falls behind its engine sends
    several passes as one event, and an engine counts the drafts it accepted past a stop or
    ``max_tokens`` that the output cut. The larger is the better bound, exact unless both
    happened on one leg. (llama.cpp streams one event per token, more than its passes: there the
    events win, 1.0 per event, as the stream shape always said; its counts say the rest.)"""
    if (
        not rec.streaming
        or rec.outcome != "completed"
        or rec.output_events == 0
        or rec.output_tokens is None
        or rec.tokens_source not in EXACT_TOKENS
    ):
        return None
    out, events = rec.output_tokens, rec.output_events
    if accepted is not None and 0 <= accepted < out and out - accepted > events:
        return out / (out - accepted), "engine_counts"
    return out / events, "stream_shape"


def leg_acceptance(rec: Recording | None) -> LegAcceptance:
    """Acceptance evidence of one leg's recording."""
    if rec is None:
        return NO_ACCEPTANCE
    counts = engine_counts(rec)
    mal = rate = None
    drafts = draft_tokens = accepted = None
    if counts is not None:
        drafts, draft_tokens, accepted = counts.steps, counts.drafted, counts.accepted
        mal, rate = counts.length, counts.rate
        if mal is None and drafts and accepted is not None:
            mal = 1.0 + accepted / drafts
        if rate is None and draft_tokens and accepted is not None:
            rate = accepted / draft_tokens
    shape = tokens_per_pass(rec, accepted)
    per_pass, per_pass_source = shape if shape is not None else (None, None)
    coverage = None
    if per_pass is not None and mal is not None and mal > 1.0:
        coverage = min(1.0, max(0.0, (per_pass - 1.0) / (mal - 1.0)))
    return LegAcceptance(
        mean_acceptance_length=mal,
        draft_acceptance_rate=rate,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        source=counts.source if counts is not None else None,
        tokens_per_pass=per_pass,
        tokens_per_pass_source=per_pass_source,
        coverage=coverage,
    )


@dataclass(frozen=True, slots=True)
class AcceptanceSummary:
    """Pooled acceptance of many requests: ratios of sums (vLLM's counter arithmetic)."""

    requests: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    draft_acceptance_rate: float | None  # Σaccepted / Σdraft_tokens
    mean_acceptance_length: float | None  # 1 + Σaccepted / Σdrafts
    tokens_per_pass_mean: float | None  # mean of per-request stream-shape estimates


K = TypeVar("K")


def summarize(items: Iterable[tuple[K, LegAcceptance]]) -> dict[K, AcceptanceSummary]:
    """Pool per-request evidence by key (category, bucket, … — any hashable)."""
    # [requests, drafts, draft tokens, accepted, Σtokens per pass, n, accepted where drafts known]
    sums: dict[K, list[float]] = {}
    for key, acc in items:
        s = sums.setdefault(key, [0, 0, 0, 0, 0.0, 0, 0])
        s[0] += 1
        if acc.num_draft_tokens is not None:
            # llama.cpp reports drafted and accepted tokens but no step count: such a leg joins
            # the rate's sums, never the length's.
            s[2] += acc.num_draft_tokens
            s[3] += acc.num_accepted_tokens or 0
            if acc.num_drafts is not None:
                s[1] += acc.num_drafts
                s[6] += acc.num_accepted_tokens or 0
        if acc.tokens_per_pass is not None:
            s[4] += acc.tokens_per_pass
            s[5] += 1
    return {
        key: AcceptanceSummary(
            requests=int(s[0]),
            num_drafts=int(s[1]),
            num_draft_tokens=int(s[2]),
            num_accepted_tokens=int(s[3]),
            draft_acceptance_rate=s[3] / s[2] if s[2] else None,
            mean_acceptance_length=1.0 + s[6] / s[1] if s[1] else None,
            tokens_per_pass_mean=s[4] / s[5] if s[5] else None,
        )
        for key, s in sums.items()
    }
