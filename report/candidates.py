"""Who each candidate is, whether it may be called lossless, how candidates compare with each
other on the same requests, and which one to ship per category (pure).

:func:`speculation` reads the candidate legs' ``speculative`` blocks (docs/records.md): what the
policy declared and what the backend reported — method, depth, label, verification — over all
of that backend's records. Verification is judged conservatively: one record saying ``lossy``
makes the candidate lossy; ``lossless`` needs every record that says anything to say it.

:func:`lossless_claim` is the only place the report decides the word *lossless*:

- ``not_lossless`` when the backend (or the policy) reports a lossy verification mode — whatever
  the outputs look like: matching outputs on the traffic seen prove nothing about the rest;
- ``not_lossless`` when the candidate diverges from the primary beyond the noise floor;
- ``unverified`` when the backend reports a verification mode specshadow does not know
  (:mod:`evidence.verification`), naming it — whatever the outputs or the policy say;
- ``lossless`` when the verification mode is reported lossless and the outputs are within the
  noise floor;
- ``unverified`` otherwise: outputs within the noise floor but no verification mode reported,
  or no comparable outputs.

:func:`head_to_head` pairs every two candidates on the requests mirrored to both, and
:func:`recommend` applies :data:`RULE` per category; :func:`policy_fragment` writes the rules
that keep each category on its pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from evidence.serverinfo import method_key, parse_schedule
from evidence.verification import Reading
from loadgen.speedup import Speedup, paired_speedup
from policies.emit import policy_yaml
from records.reader import Record
from report import load as lt
from report.records import ALL
from report.sections import Quality

Claim = Literal["lossless", "not_lossless", "unverified"]


@dataclass(frozen=True, slots=True)
class Speculation:
    """One candidate's speculative decoding, as its records describe it."""

    backend: str
    label: str  # the policy's label, else "<method> k=<k>", else the backend name
    method: str | None
    num_speculative_tokens: int | None
    verification: Reading | None
    verification_source: str | None
    verification_detail: str | None
    mismatches: tuple[str, ...] = ()
    schedule: tuple[tuple[int, int, int], ...] | None = None
    # The drafter has its own vocabulary (any record said so): the checklist's gate.
    cross_vocabulary: bool | None = None
    adaptive_verification: bool | None = None
    draft_sample_method: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "verification": self.verification,
            "verification_source": self.verification_source,
            "verification_detail": self.verification_detail,
            "mismatches": list(self.mismatches),
            "schedule": [list(s) for s in self.schedule] if self.schedule else None,
            "cross_vocabulary": self.cross_vocabulary,
            "adaptive_verification": self.adaptive_verification,
            "draft_sample_method": self.draft_sample_method,
        }


@dataclass(frozen=True, slots=True)
class Lossless:
    claim: Claim
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"claim": self.claim, "reason": self.reason}


@dataclass(slots=True)
class _Seen:
    label: str | None = None
    method: str | None = None
    depth: int | None = None
    lossy: tuple[str | None, str | None] | None = None
    lossless: tuple[str | None, str | None] | None = None
    unknown: tuple[str | None, str | None] | None = None
    mismatches: dict[str, None] = field(default_factory=dict)
    schedule: tuple[tuple[int, int, int], ...] | None = None
    cross_vocabulary: bool | None = None
    adaptive: bool | None = None
    sampling: str | None = None


def _schedule(reported: Any) -> tuple[tuple[int, int, int], ...] | None:
    """The reported schedule; None when absent or malformed (a record is data, never trusted)."""
    return parse_schedule(reported.get("schedule") if isinstance(reported, dict) else None)


def speculation(records: Sequence[Record], backend: str) -> Speculation:
    """The candidate ``backend``'s speculation over ``records`` (latest non-null fields win)."""
    seen = _Seen()
    for r in records:
        leg = r.candidate_leg(backend)
        spec = None if leg is None else leg.speculative
        if spec is None:
            continue
        seen.label = spec.label or seen.label
        seen.method = spec.method or seen.method
        if spec.num_speculative_tokens is not None:
            seen.depth = spec.num_speculative_tokens
        said = (spec.verification_source, spec.verification_detail)
        if spec.verification == "lossy":
            seen.lossy = said
        elif spec.verification == "lossless":
            seen.lossless = said
        elif spec.verification == "unknown":
            seen.unknown = said
        if spec.cross_vocabulary is not None:
            seen.cross_vocabulary = bool(seen.cross_vocabulary) or spec.cross_vocabulary
        if spec.adaptive_verification is not None:
            seen.adaptive = bool(seen.adaptive) or spec.adaptive_verification
        seen.sampling = spec.draft_sample_method or seen.sampling
        for problem in spec.mismatches:
            seen.mismatches[problem] = None
        seen.schedule = _schedule(spec.reported) or seen.schedule
    verification: Reading | None = None
    source = detail = None
    if seen.lossy is not None:
        verification, (source, detail) = "lossy", seen.lossy
    elif seen.unknown is not None:
        verification, (source, detail) = "unknown", seen.unknown
    elif seen.lossless is not None:
        verification, (source, detail) = "lossless", seen.lossless
    label = seen.label
    if label is None and seen.method is not None:
        label = seen.method + (f" k={seen.depth}" if seen.depth is not None else "")
    return Speculation(
        backend=backend,
        label=label or backend,
        method=seen.method,
        num_speculative_tokens=seen.depth,
        verification=verification,
        verification_source=source,
        verification_detail=detail,
        mismatches=tuple(seen.mismatches),
        schedule=seen.schedule,
        cross_vocabulary=seen.cross_vocabulary,
        adaptive_verification=seen.adaptive,
        draft_sample_method=seen.sampling,
    )


def lossless_claim(spec: Speculation, quality: Quality | None) -> Lossless:
    """May the report call this candidate lossless? (rules in the module doc)"""
    if spec.verification == "lossy":
        who = (
            "the policy declares" if spec.verification_source == "policy" else "the backend reports"
        )
        return Lossless(
            "not_lossless",
            f"{who} a lossy verification mode ({spec.verification_detail}): it may accept drafts "
            "the target model would not have produced, so matching outputs here prove nothing "
            "about the rest of the traffic",
        )
    worse = quality.worse_than_noise if quality is not None else None
    if worse:
        return Lossless(
            "not_lossless", "its outputs diverge from the primary beyond the noise floor"
        )
    if spec.verification == "unknown":
        return Lossless(
            "unverified",
            f"the backend reports a verification mode specshadow does not know "
            f"({spec.verification_detail}): it is never called lossless until that mode is "
            "known; declare speculative.verification in the policy if it is lossy",
        )
    if worse is None:
        return Lossless("unverified", "no comparable outputs to judge")
    if spec.verification == "lossless":
        return Lossless(
            "lossless",
            f"verification reported lossless ({spec.verification_detail}) and outputs within "
            "the noise floor",
        )
    return Lossless(
        "unverified",
        "outputs within the noise floor, but the backend does not report how it verifies "
        "drafts (vLLM: VLLM_SERVER_DEV_MODE=1 serves /server_info; or declare "
        "speculative.verification in the policy)",
    )


# -- candidates against each other ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadToHead:
    """``b`` against ``a`` on the same requests: ratio ``a`` / ``b`` (above 1: ``b`` faster).

    Only exchanges where both legs completed at production's load (load parity within the
    band) count, so the comparison is as load-true as each candidate's own verdict.
    """

    category: str
    a: str
    b: str
    e2e: Speedup | None
    tpot: Speedup | None
    mirrored: int  # exchanges with both legs completed, at any load

    @property
    def b_faster(self) -> bool:
        return self.e2e is not None and self.e2e.significant_gain

    @property
    def a_faster(self) -> bool:
        return self.e2e is not None and self.e2e.significant_loss

    def to_json(self) -> dict[str, Any]:
        def sp(s: Speedup | None) -> dict[str, float | int] | None:
            return (
                None
                if s is None
                else {"estimate": s.point, "low": s.ci_low, "high": s.ci_high, "n": s.n}
            )

        return {
            "a": self.a,
            "b": self.b,
            "e2e_b_over_a": sp(self.e2e),
            "tpot_b_over_a": sp(self.tpot),
            "mirrored": self.mirrored,
        }


def head_to_head(
    records: Sequence[Record], backends: Sequence[str], categories: Sequence[str]
) -> list[HeadToHead]:
    """Every pair of candidates (in ``backends`` order) per category and overall."""
    out: list[HeadToHead] = []
    for i, a in enumerate(backends):
        for b in backends[i + 1 :]:
            pairs: dict[str, dict[str, list[tuple[float | None, float | None]]]] = {}
            mirrored: dict[str, int] = {}
            for r in records:
                la, lb = r.candidate_leg(a), r.candidate_leg(b)
                if la is None or lb is None or not (la.ok and lb.ok):
                    continue
                matched = all(lt.matched(leg.load_parity) for leg in (la, lb))
                for cat in (r.category, ALL):
                    mirrored[cat] = mirrored.get(cat, 0) + 1
                    if not matched:
                        continue
                    slot = pairs.setdefault(cat, {"e2e": [], "tpot": []})
                    slot["e2e"].append((la.e2e_s, lb.e2e_s))
                    slot["tpot"].append((la.tpot_s, lb.tpot_s))
            for cat in [*categories, ALL]:
                slot = pairs.get(cat, {"e2e": [], "tpot": []})
                out.append(
                    HeadToHead(
                        cat, a, b,
                        paired_speedup(slot["e2e"], seed=7),
                        paired_speedup(slot["tpot"], seed=7),
                        mirrored.get(cat, 0),
                    )
                )  # fmt: skip
    return out


# -- the recommendation ------------------------------------------------------------------------

# Proposers that need no model of their own (they draft from the prompt or the output so far).
MODEL_FREE = frozenset({"ngram", "suffix", "prompt_lookup", "lookahead"})
_MODEL_FREE_KEYS = frozenset(map(method_key, MODEL_FREE))


def cost_key(spec: Speculation) -> tuple[int, int, str]:
    """Cheaper first: no draft model, then a smaller k (an unknown method counts as a model)."""
    free = method_key(spec.method or "") in _MODEL_FREE_KEYS
    return (0 if free else 1, spec.num_speculative_tokens or 0, spec.backend)


@dataclass(frozen=True, slots=True)
class Recommendation:
    category: str
    backend: str | None  # the configuration to ship for this category, or None
    reason: str
    runner_up: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "reason": self.reason, "runner_up": self.runner_up}


RULE = (
    "Per category: among candidates whose verdict is adopt (speed-up at production load with a "
    "95 % CI above 1, quality within the noise floor, capacity to carry production's rate) and "
    "whose verification is not lossy, the one with the highest speed-up at production load — if "
    "its head-to-head CI against the runner-up on the same requests excludes 1. Otherwise the "
    "tied candidates are equal and the cheaper one ships: no draft model before a draft model, "
    "then the smaller k."
)


def recommend(
    category: str,
    verdicts: Mapping[str, Any],  # backend → Verdict for this category
    specs: Mapping[str, Speculation],
    pairs: Sequence[HeadToHead],
) -> Recommendation:
    """The configuration to ship for ``category`` (rule: :data:`RULE`)."""
    lossy = {b for b, s in specs.items() if s.verification == "lossy"}
    adopted = [b for b, v in verdicts.items() if v.decision == "adopt" and b not in lossy]
    if not adopted:
        if any(v.decision == "adopt" for v in verdicts.values()):
            return Recommendation(
                category, None, "the only candidates that pass verify drafts lossily"
            )
        rolled = [b for b, v in verdicts.items() if v.decision == "rolled_back"]
        failing = [b for b, v in verdicts.items() if v.decision == "candidate_failing"]
        mixed = [b for b, v in verdicts.items() if v.decision == "confounded"]
        why = [f"{', '.join(rolled)} rolled back in this window"] if rolled else []
        why += [f"{', '.join(mixed)} confounded (more than speculation changed)"] if mixed else []
        why += [f"{', '.join(failing)} failing"] if failing else []
        return Recommendation(
            category,
            None,
            "no candidate passed the verdict" + (f" ({'; '.join(why)})" if why else ""),
        )

    def speed(b: str) -> float:
        at = verdicts[b].at_load
        return at.e2e.estimate if at is not None and at.e2e is not None else 0.0

    ranked = sorted(adopted, key=speed, reverse=True)
    best = ranked[0]
    if len(ranked) == 1:
        return Recommendation(
            category, best, f"the only candidate that passes ({speed(best):.2f}×)"
        )
    tied = [best]
    for other in ranked[1:]:
        h = _between(pairs, category, best, other)
        if h is None or not _faster(h, best):
            tied.append(other)
    runner_up = ranked[1]
    if len(tied) == 1:
        h = _between(pairs, category, best, runner_up)
        assert h is not None
        assert h.e2e is not None
        ratio = h.e2e.point if h.b == best else 1 / h.e2e.point  # runner-up e2e / best e2e
        return Recommendation(
            category, best,
            f"{speed(best):.2f}× at production load; measurably faster than {runner_up} on the "
            f"same requests ({ratio:.2f}×, n={h.e2e.n})",
            runner_up,
        )  # fmt: skip
    cheapest = min(tied, key=lambda b: cost_key(specs[b]))
    others = "; ".join(
        _tie_text(_between(pairs, category, cheapest, b), cheapest, b)
        for b in tied
        if b != cheapest
    )
    return Recommendation(
        category, cheapest,
        f"indistinguishable on the same requests ({others}); the cheaper configuration "
        f"({specs[cheapest].label})",
        runner_up if cheapest == best else best,
    )  # fmt: skip


def _tie_text(h: HeadToHead | None, x: str, y: str) -> str:
    if h is None or h.e2e is None:
        return f"{y}: too few pairs"
    point, low, high = h.e2e.point, h.e2e.ci_low, h.e2e.ci_high
    if h.a == x:  # the ratio is x/y's e2e: y's speed relative to x; say it as x against y
        point, low, high = 1 / point, 1 / high, 1 / low
    return f"vs {y}: {point:.2f}× [{low:.2f}, {high:.2f}] includes 1"


def _between(pairs: Sequence[HeadToHead], category: str, x: str, y: str) -> HeadToHead | None:
    for h in pairs:
        if h.category == category and {h.a, h.b} == {x, y}:
            return h
    return None


def _faster(h: HeadToHead, who: str) -> bool:
    """``who`` is measurably faster than the other in ``h``."""
    return h.b_faster if h.b == who else h.a_faster


def policy_fragment(recommendations: Sequence[Recommendation]) -> str | None:
    """Policy rules that keep each recommended candidate on its categories (YAML, validated by
    the tests against the policy schema); None when nothing is recommended per category."""
    chosen = [r for r in recommendations if r.backend is not None and r.category != ALL]
    if not chosen:
        return None
    by_backend: dict[str, list[str]] = {}
    for r in chosen:
        assert r.backend is not None
        by_backend.setdefault(r.backend, []).append(r.category)
    rules = [
        {
            "name": f"recommended-{backend}",
            "match": {"categories": cats},
            "ratio": "load_matched",
            "legs": [{"backend": backend, "role": "candidate"}],
        }
        for backend, cats in by_backend.items()
    ]
    return policy_yaml({"rules": rules})
