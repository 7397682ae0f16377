"""Acceptance: how many drafted tokens a leg accepted, per request, from what it recorded (pure).

Three sources, never conflated (docs/concepts.md, "Acceptance, three ways"); each value carries its origin:

- ``vllm_metrics`` — vLLM's per-request ``metrics.speculative_decoding``:
  ``mean_acceptance_length`` (1 + accepted drafts per *drafting* step),
  ``draft_acceptance_rate`` (accepted / drafted tokens) and the raw counts.
- ``stream_shape`` — ``tokens_per_pass``: output tokens per output-bearing event of a streamed
  leg. A speculative engine emits one verification step's tokens together, so this estimates
  tokens per *target pass* — including the steps where the proposer had no draft, which is why it
  sits below ``mean_acceptance_length``. Only from exact token counts (usage or logprobs) of a
  completed stream; ``None`` otherwise.
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

from core.evidence import NO_ACCEPTANCE, LegAcceptance
from core.timings import Recording

# Upper bounds (exclusive) and labels; the last label takes everything above.
OUTPUT_LENGTH_BUCKETS: tuple[tuple[int, str], ...] = (
    (64, "<64"),
    (256, "64-256"),
    (1024, "256-1024"),
)
OUTPUT_LENGTH_TOP = ">=1024"
CONCURRENCY_BUCKETS: tuple[tuple[int, str], ...] = (
    (1, "1"),
    (4, "2-4"),
    (16, "5-16"),
    (64, "17-64"),
)
CONCURRENCY_TOP = ">64"
_EXACT_SOURCES = ("usage", "continuous_usage", "logprobs")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _spec_metrics(metrics: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if metrics is None:
        return None
    spec = metrics.get("speculative_decoding")
    return spec if isinstance(spec, Mapping) else None


def tokens_per_pass(rec: Recording) -> float | None:
    """The stream-shape estimate, or None when the leg cannot support it (see module doc)."""
    if (
        not rec.streaming
        or rec.outcome != "completed"
        or rec.output_events == 0
        or rec.output_tokens is None
        or rec.tokens_source not in _EXACT_SOURCES
    ):
        return None
    return rec.output_tokens / rec.output_events


def leg_acceptance(rec: Recording | None) -> LegAcceptance:
    """Acceptance evidence of one leg's recording."""
    if rec is None:
        return NO_ACCEPTANCE
    spec = _spec_metrics(rec.vllm_metrics)
    mal = rate = None
    drafts = draft_tokens = accepted = None
    if spec is not None:
        drafts = _int(spec.get("num_drafts", spec.get("num_spec_steps")))
        draft_tokens = _int(spec.get("num_draft_tokens"))
        accepted = _int(spec.get("num_accepted_draft_tokens", spec.get("num_accepted_tokens")))
        mal = _float(spec.get("mean_acceptance_length"))
        rate = _float(spec.get("draft_acceptance_rate"))
        if mal is None and drafts and accepted is not None:
            mal = 1.0 + accepted / drafts
        if rate is None and draft_tokens and accepted is not None:
            rate = accepted / draft_tokens
    per_pass = tokens_per_pass(rec)
    coverage = None
    if per_pass is not None and mal is not None and mal > 1.0:
        coverage = min(1.0, max(0.0, (per_pass - 1.0) / (mal - 1.0)))
    known = spec is not None and (mal is not None or rate is not None)
    return LegAcceptance(
        mean_acceptance_length=mal,
        draft_acceptance_rate=rate,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        source="vllm_metrics" if known else None,
        tokens_per_pass=per_pass,
        tokens_per_pass_source="stream_shape" if per_pass is not None else None,
        coverage=coverage,
    )


def output_length_bucket(output_tokens: int | None) -> str | None:
    if output_tokens is None:
        return None
    for bound, label in OUTPUT_LENGTH_BUCKETS:
        if output_tokens < bound:
            return label
    return OUTPUT_LENGTH_TOP


def concurrency_bucket(in_flight: int) -> str:
    """Bucket of legs of the same role in flight at dispatch (this one included)."""
    for bound, label in CONCURRENCY_BUCKETS:
        if in_flight <= bound:
            return label
    return CONCURRENCY_TOP


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
    sums: dict[K, list[float]] = {}
    for key, acc in items:
        s = sums.setdefault(key, [0, 0, 0, 0, 0.0, 0])
        s[0] += 1
        if acc.num_drafts is not None and acc.num_draft_tokens is not None:
            s[1] += acc.num_drafts
            s[2] += acc.num_draft_tokens
            s[3] += acc.num_accepted_tokens or 0
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
            mean_acceptance_length=1.0 + s[3] / s[1] if s[1] else None,
            tokens_per_pass_mean=s[4] / s[5] if s[5] else None,
        )
        for key, s in sums.items()
    }
