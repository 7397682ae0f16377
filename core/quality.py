"""The quality metrics' vocabulary: names, what a difference means, default equivalence margins.

One table read by the policy (``quality.margins`` overrides), the report's equivalence tests
(:mod:`report.quality`) and the docs. Every metric is a per-exchange paired difference
``candidate − baseline`` (both independent draws for the same prompt); a margin ``δ`` says how
large a true mean difference is still "the same quality". ``kind`` says how the difference is
formed: ``rate`` (a 0/1 outcome: the difference of two rates, in absolute points), ``mean`` (a
bounded score: difference of means), ``ratio`` (candidate's mean over the baseline's, minus 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["rate", "mean", "ratio"]


@dataclass(frozen=True, slots=True)
class QualityMetric:
    name: str
    kind: MetricKind
    margin: float  # the default equivalence margin
    label: str  # how the report names it
    unit: str  # how the report prints a difference: "pts" (×100), "" (as is), "%" (×100)


QUALITY_METRICS: tuple[QualityMetric, ...] = (
    QualityMetric("similarity", "mean", 0.05, "similarity to the primary's output", ""),
    QualityMetric("length_ratio", "ratio", 0.05, "output length", "%"),
    QualityMetric("finish_length_rate", "rate", 0.03, "stopped at max_tokens", "pts"),
    QualityMetric("distinct_2", "mean", 0.03, "distinct bigrams", ""),
    QualityMetric("repetition", "mean", 0.03, "repeated 4-grams", ""),
    QualityMetric("longest_repeat_ratio", "ratio", 0.15, "longest repeated span", "%"),
    QualityMetric("refusal_rate", "rate", 0.02, "refusals", "pts"),
    QualityMetric("json_valid_rate", "rate", 0.02, "valid JSON where asked", "pts"),
    QualityMetric("tool_valid_rate", "rate", 0.02, "valid tool calls", "pts"),
    QualityMetric("citation_rate", "rate", 0.03, "outputs citing sources", "pts"),
    QualityMetric("loglik", "mean", 0.1, "target log-likelihood per token (nats)", ""),
)
METRICS_BY_NAME = {m.name: m for m in QUALITY_METRICS}
DEFAULT_MARGINS: dict[str, float] = {m.name: m.margin for m in QUALITY_METRICS}
DEFAULT_ALPHA = 0.05
