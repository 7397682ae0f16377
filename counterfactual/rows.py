"""The matrix's cells and rows: the sums one configuration × category × output length keeps,
and the JSON row made from them (counterfactual.json's schema: docs/counterfactual.md).

A row is the pooled ratios with their delta-method intervals, acceptance by draft position and by
where in the output a step started, the predicted speed-up through the step-time model and, with
token texts, where drafts were rejected. A batch-size schedule's row is a bound made from the
fixed-k cells of its depths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.stats import RatioStats
from counterfactual.grid import Config, config_json
from counterfactual.live import interval_json
from counterfactual.rejections import shares
from counterfactual.replay import FIRST_TOKENS, Replay
from counterfactual.speed import StepModel

__all__ = ["Cell", "bound_row", "row"]


@dataclass(slots=True)
class Cell:
    """One configuration × category × output-length bucket."""

    k: int
    mal: RatioStats = field(default_factory=RatioStats)  # x: drafts, y: accepted
    tpp: RatioStats = field(default_factory=RatioStats)  # x: passes, y: output tokens
    draft_tokens: int = 0
    by_position: list[int] = field(default_factory=list)
    greedy: int = 0
    # Steps that started in the output's first FIRST_TOKENS tokens: drafts, drafted, accepted.
    early: list[int] = field(default_factory=lambda: [0, 0, 0])
    rejected: dict[str, int] = field(default_factory=dict)  # class → first rejected positions

    def add(self, r: Replay, greedy: bool, classes: list[str] | None = None) -> None:
        for i, v in enumerate(r.early):
            self.early[i] += v
        if classes is not None:
            for pos in r.rejected_at:
                self.rejected[classes[pos]] = self.rejected.get(classes[pos], 0) + 1
        self.mal.add(r.drafts, r.accepted)
        self.tpp.add(r.passes, r.output_tokens)
        self.draft_tokens += r.draft_tokens
        if len(self.by_position) < max(self.k, len(r.accepted_by_position)):
            # A string-level (SLEM) step may accept more target tokens than its depth.
            wanted = max(self.k, len(r.accepted_by_position))
            self.by_position += [0] * (wanted - len(self.by_position))
        for i, v in enumerate(r.accepted_by_position):
            self.by_position[i] += v
        self.greedy += greedy


def bound_row(
    b: Config, category: str, bucket: str, cells: Mapping[tuple[Config, str, str], Cell]
) -> dict[str, Any]:
    """A batch-size schedule: no value, a bound between the fixed-k rows of its smallest and
    largest k (k = 0: plain decoding, one token per pass)."""
    assert b.rule is not None
    ks = list(b.rule.tiers())
    found: dict[str, list[float]] = {"mean_acceptance_length": [], "tokens_per_pass": []}
    requests = 0
    for k in ks:
        if k < 1:
            found["mean_acceptance_length"].append(1.0)
            found["tokens_per_pass"].append(1.0)
            continue
        cell = cells.get((Config(b.proposer, k, b.prompt_lookup_min, b.prompt_lookup_max,
                                 b.drafter), category, bucket))  # fmt: skip
        if cell is None:
            continue
        requests = cell.mal.n
        mal, tpp = cell.mal.estimate(), cell.tpp.estimate()
        if mal is not None:
            found["mean_acceptance_length"].append(mal + 1.0)
        if tpp is not None:
            found["tokens_per_pass"].append(tpp)

    def span(values: list[float]) -> dict[str, Any]:
        return {
            "estimate": None,
            "low": min(values) if values else None,
            "high": max(values) if values else None,
            "n": requests,
        }

    return {
        **config_json(b),
        "category": category,
        "output_length_bucket": bucket,
        "requests": requests,
        "greedy_requests": None,
        "mean_acceptance_length": span(found["mean_acceptance_length"]),
        "draft_acceptance_rate": None,
        "acceptance_by_position": [None] * b.num_speculative_tokens,
        "acceptance_by_output_position": None,
        "tokens_per_pass": span(found["tokens_per_pass"]),
        "drafted_per_pass": None,
        "predicted_tpot_speedup": None,
        "predicted_tpot_speedup_interval": None,
        "rejections": None,
    }


def row(
    c: Config,
    category: str,
    bucket: str,
    cell: Cell,
    model: StepModel | None,
    output_classes: Mapping[str, int] | None,
) -> dict[str, Any]:
    drafts = cell.mal.sx
    tpp = cell.tpp.estimate()
    tpp_ci = cell.tpp.interval()
    passes = cell.tpp.sx
    drafted_per_pass = cell.draft_tokens / passes if passes else 0.0
    speedup: float | None = None
    interval: dict[str, Any] | None = None
    if model is not None and tpp is not None:
        speedup = model.speedup(tpp, drafted_per_pass)
        if tpp_ci is not None:
            lo, hi = (model.speedup(v, drafted_per_pass) for v in tpp_ci)
            interval = {"low": lo, "high": hi}
    return {
        **config_json(c),
        "category": category,
        "output_length_bucket": bucket,
        "requests": cell.mal.n,
        "greedy_requests": cell.greedy,
        "mean_acceptance_length": interval_json(cell.mal, 1.0),
        "draft_acceptance_rate": cell.mal.sy / cell.draft_tokens if cell.draft_tokens else None,
        "acceptance_by_position": [v / drafts if drafts else None for v in cell.by_position]
        or [None] * c.num_speculative_tokens,
        "acceptance_by_output_position": _by_output_position(cell),
        "tokens_per_pass": interval_json(cell.tpp),
        "drafted_per_pass": drafted_per_pass,
        # Predicted, never measured: tokens per pass through the fitted step-time model.
        "predicted_tpot_speedup": speedup,
        "predicted_tpot_speedup_interval": interval,
        # Where drafts were rejected (all-lengths rows, with token texts): per class, its share
        # of first rejected positions against its share of the output tokens.
        "rejections": None if output_classes is None else shares(cell.rejected, output_classes),
    }


def _by_output_position(cell: Cell) -> dict[str, Any]:
    """Drafting steps that started within the output's first FIRST_TOKENS tokens, and the rest."""
    e_drafts, e_drafted, e_acc = cell.early
    drafts, drafted, acc = (
        cell.mal.sx - e_drafts,
        cell.draft_tokens - e_drafted,
        cell.mal.sy - e_acc,
    )

    def part(n: float, d: float, a: float) -> dict[str, Any]:
        return {
            "drafts": int(n),
            "draft_acceptance_rate": a / d if d else None,
            "mean_acceptance_length": 1.0 + a / n if n else None,
        }

    return {
        "first_tokens": FIRST_TOKENS,
        "first": part(e_drafts, e_drafted, e_acc),
        "rest": part(drafts, drafted, acc),
    }
