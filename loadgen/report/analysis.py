"""Report analysis: comparison records and matrix results in, the numbers a decision needs out
(pure; numpy only through :mod:`loadgen.speedup`).

Reads record FIELDS only (``schema specshadow.record/1``: ``category``, ``legs[]`` with ``role``,
timings, ``acceptance``; ``comparisons[]`` with ``a``/``b``/``exact_match``…); unknown values are
``None`` and are skipped, never invented. Categories are the record's ``category`` (``None`` →
``"uncategorized"``); ``ALL`` pools every category.

The verdict per category, in order:

1. fewer than :data:`MIN_PAIRS` paired primary/candidate exchanges, or no speedup estimate →
   *not enough data*;
2. candidate divergence rate above the noise floor (baseline-vs-primary rate) plus a tolerance →
   *do not adopt* (quality);
3. e2e speedup CI entirely above 1 → *adopt*; entirely below 1 → *do not adopt* (slower);
4. CI straddles 1 but within ±:data:`NO_GAIN` → *do not adopt* (no material gain); otherwise
   *not enough data*, with the pairs needed for the CI to exclude 1 at the measured effect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.stats import mean, percentiles
from loadgen.speedup import Speedup, paired_speedup, samples_needed

__all__ = [
    "ALL",
    "Analysis",
    "Verdict",
    "analyze",
    "bucket_order",
    "wilson",
]

ALL = "all"
ROLES = ("primary", "candidate", "baseline")
LATENCY_METRICS = ("ttft_s", "tpot_s", "chunk_gap_p50_s", "e2e_s")
MIN_PAIRS = 10
NO_GAIN = 0.03  # a speedup CI inside [1/1.03, 1.03] is "no material gain"
DIVERGENCE_TOLERANCE = 0.02  # absolute, on top of the noise floor's own uncertainty
GATE_SHARE = 0.5

Decision = Literal["adopt", "do not adopt", "not enough data"]


@dataclass(frozen=True, slots=True)
class Rate:
    """k of n with a Wilson 95 % interval."""

    k: int
    n: int

    @property
    def value(self) -> float | None:
        return self.k / self.n if self.n else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return wilson(self.k, self.n)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval for a proportion; ``None`` when n = 0."""
    if n == 0:
        return None
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True, slots=True)
class Quality:
    """Candidate-vs-primary and baseline-vs-primary agreement for one category."""

    candidate_divergence: Rate
    baseline_divergence: Rate
    flagged: int  # greedy candidate comparisons that did not match exactly
    json_equal: Rate  # structured outputs: candidate JSON semantically equal to primary's
    json_valid: Rate  # candidate JSON valid where JSON was expected
    tools_equal: Rate  # tool names and parsed arguments equal
    one_sided_refusals: int
    similarity_p50: float | None

    @property
    def tolerance(self) -> float:
        """How far above the noise floor the candidate may sit before it counts as worse."""
        base = self.baseline_divergence
        spread = 0.0
        if base.n:
            p = base.k / base.n
            spread = 2 * math.sqrt(max(p * (1 - p), 1.0 / base.n) / base.n)
        return DIVERGENCE_TOLERANCE + spread

    @property
    def worse_than_noise(self) -> bool | None:
        cand = self.candidate_divergence.value
        if cand is None:
            return None
        floor = self.baseline_divergence.value or 0.0
        return cand > floor + self.tolerance


@dataclass(frozen=True, slots=True)
class Verdict:
    category: str
    decision: Decision
    reasons: tuple[str, ...]
    pairs: int
    pairs_needed: int | None  # for "not enough data"
    e2e: Speedup | None
    tpot: Speedup | None


@dataclass(frozen=True, slots=True)
class Example:
    exchange_id: str
    category: str
    similarity: float | None
    first_divergence: int | None
    divergence_unit: str | None
    primary_text: str | None
    candidate_text: str | None


@dataclass(slots=True)
class Analysis:
    categories: list[str]
    records: int
    latency: dict[tuple[str, str], dict[str, tuple[float | None, float | None, float | None]]]
    latency_n: dict[tuple[str, str], int]
    errors: dict[tuple[str, str], Rate]
    speedups: dict[str, dict[str, Speedup | None]]  # category → {e2e, tpot, ttft, baseline_e2e}
    acceptance: dict[str, dict[str, dict[str, list[float]]]]  # dim → key → field → values
    quality: dict[str, Quality]
    gate: dict[str, float | None]  # category → median share of e2e spent generating
    resources: dict[str, dict[str, float]]  # backend → {kv_cache_usage_max, _mean}
    verdicts: list[Verdict]
    checklist: list[str]
    examples: list[Example]
    matrix: list[dict[str, Any]] = field(default_factory=list)
    stable_regions: list[str] = field(default_factory=list)
    loadgen: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gate_overall(self) -> float | None:
        return self.gate.get(ALL)


def bucket_order(label: str) -> tuple[float, str]:
    """Sort key for bucket labels such as ``<64``, ``64-256``, ``>=1024``, ``2-4``: by the first
    number (a leading ``<`` sorts before it), then by text for non-numeric labels."""
    digits = ""
    for ch in label:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    if not digits:
        return (math.inf, label)
    value = float(digits) - (0.5 if label.startswith("<") else 0.0)
    return (value, label)


# -- helpers --------------------------------------------------------------------------------------


def _category(record: Mapping[str, Any]) -> str:
    c = record.get("category")
    return str(c) if c else "uncategorized"


def _legs(record: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for leg in record.get("legs") or ():
        role = leg.get("role")
        if isinstance(role, str) and role not in out:
            out[role] = leg
    return out


def leg_ok(leg: Mapping[str, Any]) -> bool:
    status = leg.get("status")
    return (
        leg.get("outcome") in (None, "completed")
        and (status is None or status < 400)
        and leg.get("error_type") is None
    )


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _comparison(record: Mapping[str, Any], a: str, b: str) -> Mapping[str, Any] | None:
    for c in record.get("comparisons") or ():
        if c.get("a") == a and c.get("b") == b:
            return c  # type: ignore[no-any-return]
        if c.get("a") == b and c.get("b") == a:
            return c  # type: ignore[no-any-return]
    return None


def _text(leg: Mapping[str, Any] | None) -> str | None:
    out = (leg or {}).get("output")
    return out.get("text") if isinstance(out, Mapping) else None


# -- sections -------------------------------------------------------------------------------------


def _latency(
    records: Sequence[Mapping[str, Any]], categories: Sequence[str]
) -> tuple[
    dict[tuple[str, str], dict[str, tuple[float | None, float | None, float | None]]],
    dict[tuple[str, str], int],
    dict[tuple[str, str], Rate],
]:
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    for r in records:
        for role, leg in _legs(r).items():
            ok = leg_ok(leg)
            for cat in (_category(r), ALL):
                key = (role, cat)
                tally = counts.setdefault(key, [0, 0])
                tally[0] += 1
                tally[1] += 0 if ok else 1
                if not ok:
                    continue
                bucket = values.setdefault(key, {m: [] for m in LATENCY_METRICS})
                for m in LATENCY_METRICS:
                    v = _num(leg.get(m))
                    if v is not None:
                        bucket[m].append(v)
    table = {
        key: {m: percentiles(vs, (50.0, 95.0, 99.0)) for m, vs in ms.items()}
        for key, ms in values.items()
    }
    n = {key: len(ms["e2e_s"]) for key, ms in values.items()}
    errors = {key: Rate(t[1], t[0]) for key, t in counts.items()}
    return table, n, errors  # type: ignore[return-value]


def _speedups(
    records: Sequence[Mapping[str, Any]], categories: Sequence[str]
) -> dict[str, dict[str, Speedup | None]]:
    pairs: dict[str, dict[str, list[tuple[float | None, float | None]]]] = {}
    for r in records:
        legs = _legs(r)
        primary = legs.get("primary")
        if primary is None or not leg_ok(primary):
            continue
        for cat in (_category(r), ALL):
            slot = pairs.setdefault(cat, {"e2e": [], "tpot": [], "ttft": [], "baseline_e2e": []})
            cand = legs.get("candidate")
            if cand is not None and leg_ok(cand):
                for m in ("e2e", "tpot", "ttft"):
                    slot[m].append((_num(primary.get(f"{m}_s")), _num(cand.get(f"{m}_s"))))
            base = legs.get("baseline")
            if base is not None and leg_ok(base):
                slot["baseline_e2e"].append((_num(primary.get("e2e_s")), _num(base.get("e2e_s"))))
    return {
        cat: {m: paired_speedup(ps, seed=0) for m, ps in ms.items()} for cat, ms in pairs.items()
    }


def _acceptance(
    records: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """dim ∈ {category, output_length, concurrency} → key → {tokens_per_event, mal, dar, coverage}."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {
        "category": {},
        "output_length": {},
        "concurrency": {},
    }
    for r in records:
        leg = _legs(r).get("candidate")
        if leg is None or not leg_ok(leg):
            continue
        acc = leg.get("acceptance") or {}
        fields = {
            "tokens_per_event": _num(leg.get("tokens_per_event")),
            "mean_acceptance_length": _num(acc.get("mean_acceptance_length")),
            "draft_acceptance_rate": _num(acc.get("draft_acceptance_rate")),
            "coverage": _num(acc.get("coverage")),
        }
        keys = {
            "category": _category(r),
            "output_length": leg.get("output_length_bucket") or r.get("output_length_bucket"),
            "concurrency": leg.get("concurrency_bucket") or r.get("concurrency_bucket"),
        }
        for dim, key in keys.items():
            if key is None:
                continue
            slot = out[dim].setdefault(str(key), {f: [] for f in fields})
            for f, v in fields.items():
                if v is not None:
                    slot[f].append(v)
    return out


def _quality(records: Sequence[Mapping[str, Any]]) -> dict[str, Quality]:
    acc: dict[str, dict[str, list[int]]] = {}
    sims: dict[str, list[float]] = {}
    for r in records:
        cand = _comparison(r, "primary", "candidate")
        base = _comparison(r, "primary", "baseline")
        for cat in (_category(r), ALL):
            t = acc.setdefault(
                cat,
                {k: [0, 0] for k in ("cand", "base", "json_eq", "json_valid", "tools")}
                | {"flagged": [0, 0], "refusals": [0, 0]},
            )
            for key, c in (("cand", cand), ("base", base)):
                if c is None or c.get("comparable") is False or c.get("exact_match") is None:
                    continue
                t[key][1] += 1
                t[key][0] += 0 if c["exact_match"] else 1
            if cand is None:
                continue
            t["flagged"][0] += bool(cand.get("flag"))
            t["refusals"][0] += bool(cand.get("one_sided_refusal"))
            if cand.get("json_expected"):
                t["json_valid"][1] += 1
                t["json_valid"][0] += bool(cand.get("json_valid_b"))
                if cand.get("json_equal") is not None:
                    t["json_eq"][1] += 1
                    t["json_eq"][0] += bool(cand["json_equal"])
            if cand.get("tool_names_equal") is not None:
                t["tools"][1] += 1
                t["tools"][0] += bool(
                    cand.get("tool_names_equal") and cand.get("tool_arguments_equal")
                )
            sim = _num(cand.get("similarity"))
            if sim is not None:
                sims.setdefault(cat, []).append(sim)
    return {
        cat: Quality(
            candidate_divergence=Rate(*t["cand"]),
            baseline_divergence=Rate(*t["base"]),
            flagged=t["flagged"][0],
            json_equal=Rate(*t["json_eq"]),
            json_valid=Rate(*t["json_valid"]),
            tools_equal=Rate(*t["tools"]),
            one_sided_refusals=t["refusals"][0],
            similarity_p50=percentiles(sims.get(cat, []), (50.0,))[0],
        )
        for cat, t in acc.items()
    }


def _gate(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    shares: dict[str, list[float]] = {}
    for r in records:
        leg = _legs(r).get("primary")
        if leg is None or not leg_ok(leg):
            continue
        e2e, ttft = _num(leg.get("e2e_s")), _num(leg.get("ttft_s"))
        if e2e is None or ttft is None or e2e <= 0:
            continue
        for cat in (_category(r), ALL):
            shares.setdefault(cat, []).append(max(0.0, (e2e - ttft) / e2e))
    return {cat: percentiles(v, (50.0,))[0] for cat, v in shares.items()}


def _resources(
    records: Sequence[Mapping[str, Any]], matrix: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, float]]:
    usage: dict[str, list[float]] = {}
    for r in records:
        for leg in r.get("legs") or ():
            window = (leg.get("acceptance") or {}).get("backend_window") or {}
            v = _num(window.get("kv_cache_usage_perc"))
            if v is not None:
                usage.setdefault(str(leg.get("backend")), []).append(v)
    for row in matrix:
        v = _num(row.get("kv_cache_usage_peak"))
        if v is not None:
            usage.setdefault(str(row.get("backend")), []).append(v)
    return {
        b: {
            "kv_cache_usage_max": max(vs),
            "kv_cache_usage_mean": mean(vs) or 0.0,
            "samples": len(vs),
        }
        for b, vs in usage.items()
    }


def _verdict(cat: str, sp: Mapping[str, Speedup | None], quality: Quality | None) -> Verdict:
    e2e, tpot = sp.get("e2e"), sp.get("tpot")
    pairs = e2e.n if e2e is not None else 0
    reasons: list[str] = []

    def make(decision: Decision, needed: int | None = None) -> Verdict:
        return Verdict(cat, decision, tuple(reasons), pairs, needed, e2e, tpot)

    if e2e is None or pairs < MIN_PAIRS:
        reasons.append(f"{pairs} paired primary/candidate exchanges; at least {MIN_PAIRS} needed")
        return make(
            "not enough data",
            MIN_PAIRS if e2e is None else max(MIN_PAIRS, samples_needed(e2e) or MIN_PAIRS),
        )
    gain = f"e2e speedup {e2e.point:.2f}× (95 % CI {e2e.ci_low:.2f}–{e2e.ci_high:.2f}, n={e2e.n})"
    if quality is not None and quality.worse_than_noise:
        cand = quality.candidate_divergence.value or 0.0
        floor = quality.baseline_divergence.value
        floor_text = f"{floor:.1%}" if floor is not None else "unknown (no baseline)"
        reasons.append(
            f"candidate diverges from primary in {cand:.1%} of comparable exchanges; "
            f"noise floor {floor_text}"
        )
        reasons.append(gain)
        return make("do not adopt")
    reasons.append(gain)
    if quality is not None and quality.baseline_divergence.n == 0:
        reasons.append("no baseline leg: quality judged against exact match, not a noise floor")
    if e2e.significant_gain:
        return make("adopt")
    if e2e.significant_loss:
        reasons.append("the candidate is slower")
        return make("do not adopt")
    if e2e.ci_low >= 1 / (1 + NO_GAIN) and e2e.ci_high <= 1 + NO_GAIN:
        reasons.append(f"no material gain: the CI lies within ±{NO_GAIN:.0%}")
        return make("do not adopt")
    needed = samples_needed(e2e)
    reasons.append(
        "the CI includes 1"
        + (f"; about {needed} pairs would resolve the measured effect" if needed else "")
    )
    return make("not enough data", needed)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f} ms"


def _p99(a: Analysis, role: str, cat: str, metric: str) -> float | None:
    return a.latency.get((role, cat), {}).get(metric, (None, None, None))[2]


def _category_triggers(a: Analysis, cat: str) -> list[str]:
    """Rollback triggers for one adopted category, from its measured numbers."""
    items: list[str] = []
    c_tpot, p_tpot = _p99(a, "candidate", cat, "tpot_s"), _p99(a, "primary", cat, "tpot_s")
    if c_tpot is not None:
        # 20 % worse than measured, or no better than today's primary: whichever comes first.
        limit = min(c_tpot * 1.2, p_tpot) if p_tpot is not None else c_tpot * 1.2
        items.append(
            f"Roll back {cat} if candidate p99 tpot > {_ms(limit)} "
            f"(measured: candidate {_ms(c_tpot)}, primary {_ms(p_tpot)})."
        )
    c_e2e, p_e2e = _p99(a, "candidate", cat, "e2e_s"), _p99(a, "primary", cat, "e2e_s")
    if c_e2e is not None and p_e2e is not None:
        items.append(
            f"Roll back {cat} if p99 e2e exceeds today's primary p99 of {_ms(p_e2e)} "
            f"(measured candidate: {_ms(c_e2e)})."
        )
    q = a.quality.get(cat)
    if q is not None and q.candidate_divergence.n:
        floor = q.baseline_divergence.value or 0.0
        items.append(
            f"Roll back {cat} if its divergence rate exceeds the noise floor {floor:.1%} + "
            f"{q.tolerance:.1%} = {floor + q.tolerance:.1%} "
            f"(measured candidate: {q.candidate_divergence.value:.1%})."
        )
    m = mean(a.acceptance["category"].get(cat, {}).get("tokens_per_event", []))
    if m is not None and m > 1:
        items.append(
            f"Roll back {cat} if tokens per event falls below {1 + (m - 1) / 2:.2f} (measured "
            f"{m:.2f}: half the speculative gain gone — traffic mix or proposer drift)."
        )
    return items


def _checklist(a: Analysis) -> list[str]:
    adopted = [v.category for v in a.verdicts if v.decision == "adopt" and v.category != ALL]
    if not adopted and any(v.category == ALL and v.decision == "adopt" for v in a.verdicts):
        adopted = [ALL]
    items: list[str] = []
    if adopted:
        items.append(
            f"Enable speculative decoding for: {', '.join(adopted)}. Keep shadowing the rest."
        )
    else:
        items.append("Do not enable speculative decoding yet: no category passed the verdict.")
    for cat in adopted:
        items.extend(_category_triggers(a, cat))
    cerr, perr = a.errors.get(("candidate", ALL)), a.errors.get(("primary", ALL))
    if cerr is not None and perr is not None and cerr.n and perr.n:
        items.append(
            f"Roll back if the candidate error rate exceeds the primary's by more than 1 point "
            f"(measured: candidate {cerr.value:.1%}, primary {perr.value:.1%})."
        )
    items.extend(
        f"Before deciding {v.category}: shadow about {v.pairs_needed} paired requests."
        for v in a.verdicts
        if v.decision == "not enough data" and v.category != ALL and v.pairs_needed
    )
    if a.resources:
        peak = max(r["kv_cache_usage_max"] for r in a.resources.values())
        items.append(
            f"Watch KV-cache usage: peak measured {peak:.0%}; roll back above 95 % sustained."
        )
    items.append(
        "Keep a shadow baseline leg running after the rollout: the noise floor moves with traffic."
    )
    return items


def _examples(records: Sequence[Mapping[str, Any]], limit: int = 5) -> list[Example]:
    worst: list[tuple[float, Example]] = []
    for r in records:
        c = _comparison(r, "primary", "candidate")
        if c is None or c.get("exact_match") is not False:
            continue
        legs = _legs(r)
        sim = _num(c.get("similarity"))
        ex = Example(
            exchange_id=str(r.get("exchange_id")),
            category=_category(r),
            similarity=sim,
            first_divergence=c.get("first_divergence"),
            divergence_unit=c.get("divergence_unit"),
            primary_text=_text(legs.get("primary")),
            candidate_text=_text(legs.get("candidate")),
        )
        worst.append((sim if sim is not None else 1.0, ex))
    worst.sort(key=lambda t: t[0])
    return [ex for _, ex in worst[:limit]]


def analyze(
    records: Iterable[Mapping[str, Any]],
    results: Iterable[Mapping[str, Any]] | None = None,
) -> Analysis:
    """Everything the report shows, from records and optional loadgen/matrix result rows."""
    recs = list(records)
    rows = [dict(r) for r in results or ()]
    matrix = [r for r in rows if str(r.get("schema", "")).startswith("specshadow.matrix/")]
    loadgen = [r for r in rows if r not in matrix and "e2e_s" in r and not r.get("warmup")]
    cats = sorted({_category(r) for r in recs})
    latency, latency_n, errors = _latency(recs, cats)
    speedups = _speedups(recs, cats)
    quality = _quality(recs)
    verdicts = [
        _verdict(cat, speedups.get(cat, {}), quality.get(cat)) for cat in [*cats, ALL] if recs
    ]
    from loadgen.matrix import stable_regions

    a = Analysis(
        categories=cats,
        records=len(recs),
        latency=latency,
        latency_n=latency_n,
        errors=errors,
        speedups=speedups,
        acceptance=_acceptance(recs),
        quality=quality,
        gate=_gate(recs),
        resources=_resources(recs, matrix),
        verdicts=verdicts,
        checklist=[],
        examples=_examples(recs),
        matrix=matrix,
        stable_regions=stable_regions(matrix),
        loadgen=loadgen,
    )
    a.checklist = _checklist(a) if recs else []
    return a
