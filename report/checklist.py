"""The release checklist and its rollback triggers, written from the measured numbers (pure).

One line per recommended configuration (:mod:`report.candidates`) and the categories it
serves, then each category's rollback triggers from *that* candidate's numbers. The triggers
**are** the rollout guards: :func:`guards_for` computes each category's thresholds once, and
both the checklist (here, in words: a ratio with its value in ms at today's primary p99, the
measured number it came from and the policy key) and ``rollout.yaml`` (:mod:`report.rollout`)
are written from that one :class:`Guards` — they cannot disagree. The rules:

- ``e2e_p99_ratio_max`` / ``tpot_p99_ratio_max``: 1.25 × the measured p99 ratio candidate ÷
  primary, between 1.0 (a candidate slower than today's primary is rolled back; the policy
  allows no lower ratio) and 1.5;
- ``error_rate_delta_max``: the measured difference plus 1 point (at least 1 point);
- ``divergence_rate_max``: the measured greedy divergence above the noise floor plus the
  report's tolerance (two standard errors and 2 points);
- ``tokens_per_event_min``: half the measured speculative gain, ``1 + (tpe − 1) / 2``;
- ``kv_usage_max``: 0.95;
- ``sampled_divergence_max``: 0 (exchangeable outputs) where the measured traffic was sampled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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


KV_USAGE_MAX = 0.95


@dataclass(frozen=True, slots=True)
class Guards:
    """One category's rollback triggers — the rollout guards (see the module doc) — and the
    measured numbers they came from."""

    e2e_p99_ratio_max: float
    tpot_p99_ratio_max: float
    error_rate_delta_max: float
    divergence_rate_max: float
    tokens_per_event_min: float | None
    kv_usage_max: float = KV_USAGE_MAX
    # The measured traffic held sampled exchanges: sampled_divergence judges them (against a
    # baseline leg, or the primary's own answers mirrored behind the candidate's).
    sampled: bool = False
    # What they came from: p99s (s) of the candidate and the primary, error rates, divergence.
    measured: Mapping[str, float | None] = field(default_factory=dict)

    def as_policy(self) -> dict[str, Any]:
        """The policy's ``guards`` block."""
        out: dict[str, Any] = {
            "min_samples": 20,
            "e2e_p99_ratio_max": self.e2e_p99_ratio_max,
            "tpot_p99_ratio_max": self.tpot_p99_ratio_max,
            "error_rate_delta_max": self.error_rate_delta_max,
            "divergence_rate_max": self.divergence_rate_max,
            "tokens_per_event_min": self.tokens_per_event_min,
            "kv_usage_max": self.kv_usage_max,
        }
        if self.sampled:
            out["sampled_divergence_max"] = 0.0
        return out


def _ratio_max(cand: float | None, prim: float | None) -> float:
    if cand is None or prim is None or prim <= 0:
        return 1.5
    return round(min(1.5, max(1.0, 1.25 * cand / prim)), 2)


def guards_for(a: Measured, c: CandidateAnalysis, cat: str) -> Guards:
    """The rollback triggers — the guards — for ``c`` serving ``cat``, from its measured numbers
    (the module doc): what the checklist says and ``rollout.yaml`` carries."""
    key = leg_key(a, c)
    c_e2e, p_e2e = p99(a, key, cat, "e2e_s"), p99(a, "primary", cat, "e2e_s")
    c_tpot, p_tpot = p99(a, key, cat, "tpot_s"), p99(a, "primary", cat, "tpot_s")
    cerr, perr = a.errors.get((key, cat)), a.errors.get(("primary", cat))
    c_rate = cerr.value if cerr is not None else None
    p_rate = perr.value if perr is not None else None
    error = 0.02
    if c_rate is not None and p_rate is not None:
        error = round(max(ERROR_MARGIN, c_rate - p_rate + ERROR_MARGIN), 3)
    divergence = 0.05
    q = c.quality.get(cat)
    c_div = q.candidate_divergence.value if q is not None else None
    floor = (q.baseline_divergence.value or 0.0) if q is not None else None
    if q is not None and c_div is not None and floor is not None:
        divergence = round(min(1.0, max(0.01, c_div - floor + q.tolerance)), 3)
    tpe = mean(c.acceptance.of_category(cat).tokens_per_event)
    if cat == ALL:
        tpe = mean(list(c.acceptance.pooled_tokens_per_event()))
    eq = c.equivalence.get(cat)
    return Guards(
        _ratio_max(c_e2e, p_e2e),
        _ratio_max(c_tpot, p_tpot),
        error,
        divergence,
        round(1 + (tpe - 1) / 2, 2) if tpe is not None and tpe > 1.05 else None,
        sampled=eq is not None and eq.n > 0,
        measured={
            "candidate_e2e_p99_s": c_e2e, "primary_e2e_p99_s": p_e2e,
            "candidate_tpot_p99_s": c_tpot, "primary_tpot_p99_s": p_tpot,
            "candidate_error_rate": c_rate, "primary_error_rate": p_rate,
            "candidate_divergence": c_div, "noise_floor": floor,
            "measured_tokens_per_event": tpe,
        },
    )  # fmt: skip


def _ratio_line(cat: str, what: str, key: str, ratio: float, c: float | None,
                p: float | None) -> str:  # fmt: skip
    at = f" = {_ms(ratio * p)} at today's primary p99 of {_ms(p)}" if p is not None else ""
    return (
        f"Roll back {cat} if candidate p99 {what} > {ratio}× the primary's p99{at} "
        f"(measured candidate {_ms(c)}; rollout.yaml's {key})."
    )


def _category_triggers(a: Measured, c: CandidateAnalysis, cat: str) -> list[str]:
    """Rollback triggers for one category served by ``c``: :func:`guards_for`'s, in words."""
    g = guards_for(a, c, cat)
    m = g.measured
    items = [
        _ratio_line(cat, "tpot", "tpot_p99_ratio_max", g.tpot_p99_ratio_max,
                    m["candidate_tpot_p99_s"], m["primary_tpot_p99_s"]),
        _ratio_line(cat, "e2e", "e2e_p99_ratio_max", g.e2e_p99_ratio_max,
                    m["candidate_e2e_p99_s"], m["primary_e2e_p99_s"]),
    ]  # fmt: skip
    c_rate, p_rate = m["candidate_error_rate"], m["primary_error_rate"]
    if c_rate is not None and p_rate is not None:
        items.append(
            f"Roll back {cat} if the candidate's error rate exceeds the primary's by more than "
            f"{g.error_rate_delta_max:.1%} (measured: candidate {c_rate:.1%}, primary "
            f"{p_rate:.1%}; error_rate_delta_max)."
        )
    c_div, floor = m["candidate_divergence"], m["noise_floor"]
    if c_div is not None and floor is not None:
        items.append(
            f"Roll back {cat} if its divergence rate exceeds the noise floor by more than "
            f"{g.divergence_rate_max:.1%} (measured: candidate {c_div:.1%}, noise floor "
            f"{floor:.1%}; divergence_rate_max)."
        )
    if g.sampled:
        items.append(
            f"Roll back {cat} if its sampled outputs stop being exchangeable with the "
            "reference's (a baseline leg, else the primary's own answers mirrored behind the "
            "candidate's; sampled_divergence_max 0)."
        )
    tpe = m["measured_tokens_per_event"]
    if g.tokens_per_event_min is not None and tpe is not None:
        items.append(
            f"Roll back {cat} if tokens per event falls below {g.tokens_per_event_min:.2f} "
            f"(measured {tpe:.2f}: half the speculative gain gone — traffic mix or proposer "
            "drift; tokens_per_event_min)."
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
            f"Watch KV-cache usage: peak measured {peak:.0%}; roll back above "
            f"{KV_USAGE_MAX:.0%} sustained (kv_usage_max)."
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
