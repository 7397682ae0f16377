"""The release checklist and its rollback triggers, written from the measured numbers (pure).

One line per recommended configuration (:mod:`report.candidates`) and the categories it
serves, then each category's rollback triggers from *that* candidate's numbers, in absolute
units for a person to read (p99 TPOT and e2e in ms, divergence, tokens per event); a trigger
names the number it came from, so an SRE can see why a line says what it says. The guards a
policy carries are written from the same numbers as ratios by :mod:`report.rollout`
(``rollout.yaml``), with their own rule for each threshold — the two are not the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from core.stats import mean
from report.candidates import Recommendation
from report.model import KvUsage
from report.records import ALL
from report.sections import LatencyTable, Rate

if TYPE_CHECKING:  # analysis calls this module while it builds a CandidateAnalysis
    from report.analysis import CandidateAnalysis

ERROR_MARGIN = 0.01  # the error-rate trigger: more than a point above the primary's


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f} ms"


class Measured(Protocol):
    """What the triggers are written from: the latency table, the error rates and whether
    several candidates were mirrored (an :class:`~report.analysis.Analysis` is one; so is
    :class:`Tables`, while the analysis is still being computed)."""

    @property
    def latency(self) -> LatencyTable: ...
    @property
    def errors(self) -> Mapping[tuple[str, str], Rate]: ...
    @property
    def several(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Tables:
    latency: LatencyTable
    errors: Mapping[tuple[str, str], Rate]
    several: bool


def p99(a: Measured, leg: str, cat: str, metric: str) -> float | None:
    """``leg``'s p99 of ``metric`` in ``cat`` from the latency table."""
    return a.latency.get((leg, cat), {}).get(metric, (None, None, None))[2]


def leg_key(a: Measured, c: CandidateAnalysis) -> str:
    """The latency table's label for ``c``'s legs (``candidate <backend>`` among several)."""
    return f"candidate {c.backend}" if a.several else "candidate"


def breaches(a: Measured, key: str, cat: str) -> list[str]:
    """The rollback triggers of :func:`checklist` that the measured numbers of the candidate
    legs labelled ``key`` (:func:`leg_key`) in ``cat`` already breach (p99 TPOT or e2e past today's primary's p99; an error rate more than a point
    above the primary's): reasons for its verdict, since shipping it would trip them at once."""
    out = []
    for metric, name, trigger in (
        ("tpot_s", "p99 TPOT", "candidate p99 tpot"),
        ("e2e_s", "p99 e2e", "p99 e2e"),
    ):
        mine, prod = p99(a, key, cat, metric), p99(a, "primary", cat, metric)
        if mine is not None and prod is not None and mine > prod:
            out.append(
                f"measured {name} {_ms(mine)} is already past its rollback trigger "
                f"({trigger} above today's primary p99 of {_ms(prod)}): shipping it would trip "
                "that trigger at once"
            )
    cerr, perr = a.errors.get((key, ALL)), a.errors.get(("primary", ALL))
    c_rate = cerr.value if cerr is not None else None
    p_rate = perr.value if perr is not None else None
    if (
        cerr is not None
        and c_rate is not None
        and p_rate is not None
        and c_rate - p_rate > ERROR_MARGIN
    ):
        out.append(
            f"measured error rate {c_rate:.1%} ({cerr.k} of {cerr.n} legs) is already past "
            f"its rollback trigger (more than {ERROR_MARGIN * 100:g} point above the primary's "
            f"{p_rate:.1%}): shipping it would trip that trigger at once"
        )
    return out


def _category_triggers(a: Measured, c: CandidateAnalysis, cat: str) -> list[str]:
    """Rollback triggers for one category served by ``c``, from ``c``'s measured numbers."""
    items: list[str] = []
    key = leg_key(a, c)
    c_tpot, p_tpot = p99(a, key, cat, "tpot_s"), p99(a, "primary", cat, "tpot_s")
    if c_tpot is not None:
        # 20 % worse than measured, or no better than today's primary: whichever comes first.
        limit = min(c_tpot * 1.2, p_tpot) if p_tpot is not None else c_tpot * 1.2
        items.append(
            f"Roll back {cat} if candidate p99 tpot > {_ms(limit)} "
            f"(measured: candidate {_ms(c_tpot)}, primary {_ms(p_tpot)})."
        )
    c_e2e, p_e2e = p99(a, key, cat, "e2e_s"), p99(a, "primary", cat, "e2e_s")
    if c_e2e is not None and p_e2e is not None:
        items.append(
            f"Roll back {cat} if p99 e2e exceeds today's primary p99 of {_ms(p_e2e)} "
            f"(measured candidate: {_ms(c_e2e)})."
        )
    q = c.quality.get(cat)
    if q is not None and q.candidate_divergence.n:
        floor = q.baseline_divergence.value or 0.0
        items.append(
            f"Roll back {cat} if its divergence rate exceeds the noise floor {floor:.1%} + "
            f"{q.tolerance:.1%} = {floor + q.tolerance:.1%} "
            f"(measured candidate: {q.candidate_divergence.value:.1%})."
        )
    m = mean(c.acceptance.of_category(cat).tokens_per_event)
    if m is not None and m > 1:
        items.append(
            f"Roll back {cat} if tokens per event falls below {1 + (m - 1) / 2:.2f} (measured "
            f"{m:.2f}: half the speculative gain gone — traffic mix or proposer drift)."
        )
    return items


def checklist(
    a: Measured,
    candidates: Mapping[str, CandidateAnalysis],
    recommendations: Mapping[str, Recommendation],
    resources: Mapping[str, KvUsage],
) -> list[str]:
    """The release checklist and rollback triggers, from the recommendation per category."""
    picks = {cat: r.backend for cat, r in recommendations.items() if r.backend is not None}
    serve = {cat: b for cat, b in picks.items() if cat != ALL}
    if not serve and ALL in picks:
        serve = {ALL: picks[ALL]}
    items: list[str] = []
    if serve:
        by_backend: dict[str, list[str]] = {}
        for cat, backend in serve.items():
            by_backend.setdefault(backend, []).append(cat)
        for backend, cats in by_backend.items():
            label = candidates[backend].label
            named = label if label == backend else f"{label} (backend {backend})"
            items.append(f"Enable speculative decoding for: {', '.join(cats)} — ship {named}.")
        items.append("Keep shadowing the rest.")
    else:
        items.append("Do not enable speculative decoding yet: no category passed the verdict.")
    for cat, backend in serve.items():
        items.extend(_category_triggers(a, candidates[backend], cat))
    perr = a.errors.get(("primary", ALL))
    for backend in dict.fromkeys(serve.values()):
        c = candidates[backend]
        cerr = a.errors.get((leg_key(a, c), ALL))
        if cerr is not None and perr is not None and cerr.n and perr.n:
            items.append(
                f"Roll back {c.label} if its error rate exceeds the primary's by more than "
                f"{ERROR_MARGIN * 100:g} point (measured: candidate {cerr.value:.1%}, primary {perr.value:.1%})."
            )
    for c in candidates.values():
        who = f" with {c.label}" if a.several else ""
        items.extend(
            f"Before deciding {v.category}{who}: shadow about {v.pairs_needed} paired requests."
            for v in c.verdicts
            if v.decision == "not_enough_data" and v.category != ALL and v.pairs_needed
        )
    if resources:
        peak = max(r.peak for r in resources.values())
        items.append(
            f"Watch KV-cache usage: peak measured {peak:.0%}; roll back above 95 % sustained."
        )
    for backend in dict.fromkeys(serve.values()):
        c = candidates[backend]
        if c.crossover is not None:
            items.append(
                f"{c.label}: speculation stops paying above about {c.crossover.load:.3g} "
                f"requests/s per replica (batch ≈ {c.crossover.concurrency or float('nan'):.3g}): "
                f"num_speculative_tokens_per_batch_size {c.schedule} turns it off there."
            )
    for c in candidates.values():
        items.extend(cross_vocabulary_gate(c))
    items.append(
        "Keep a shadow baseline leg running after the rollout: the noise floor moves with traffic."
    )
    return items


def cross_vocabulary_gate(c: CandidateAnalysis) -> list[str]:
    """The separate gate of a drafter with its own tokenizer (``speculative.cross_vocabulary``):
    the sampling restriction and what it means for the traffic measured, the tokenizer
    translation, and the acceptance it costs — each from what the records measured."""
    s = c.speculation
    if s is None or not s.cross_vocabulary:
        return []
    mal = mean(c.acceptance.of_category(ALL).mean_acceptance_length)
    measured = "no per-request acceptance was recorded" if mal is None else f"measured {mal:.2f}"
    return [
        f"Cross-vocabulary gate for {c.label}: its drafter has its own tokenizer. Sampling: "
        "drafts are greedy only (vLLM refuses draft_sample_method other than greedy with "
        "use_heterogeneous_vocab), so on sampled requests acceptance is that of one-hot drafts "
        "and holds for the mix of greedy and sampled requests measured here, not for another.",
        f"Cross-vocabulary gate for {c.label}: tokenizer translation. Draft tokens are mapped "
        "through the vocabularies' intersection (token-level intersection): a target token "
        "outside it can never be accepted. Count, per category, the output tokens outside the "
        "shared vocabulary before shipping (specshadow counterfactual --drafter-vocab with the "
        "intersection's target ids): each is a guaranteed rejection.",
        f"Cross-vocabulary gate for {c.label}: acceptance cost. Mean acceptance length "
        f"{measured}; roll back if it falls below the value measured in shadow (traffic with "
        "more tokens outside the shared vocabulary loses drafts to the translation).",
    ]
