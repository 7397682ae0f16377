"""The report's descriptive sections: latency per leg, raw paired speed-ups, acceptance three
ways, quality against the noise floor, the decision gate, resources, worst examples (pure;
numpy only through :mod:`loadgen.speedup`).

Each function reads records through :mod:`records.reader`'s typed views; those about a candidate take
its backend, so several candidates are reported side by side from the same exchanges. The raw
speed-ups here pair every mirrored exchange at whatever load the candidate ran at; verdicts use
the load-true estimates of :mod:`report.load` instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.stats import mean, percentiles, wilson
from loadgen.matrix import MatrixRow
from loadgen.speedup import paired_speedup
from records.reader import Leg, Record, TimingName
from report.model import (
    ACCEPTANCE_DIMS,
    Acceptance,
    AcceptanceDim,
    AcceptanceValues,
    KvUsage,
    RawSpeedups,
)
from report.records import ALL

LATENCY_METRICS: tuple[TimingName, ...] = ("ttft_s", "tpot_s", "chunk_gap_p50_s", "e2e_s")
DIVERGENCE_TOLERANCE = 0.02  # absolute, on top of the noise floor's own uncertainty

LatencyTable = dict[tuple[str, str], dict[str, tuple[float | None, float | None, float | None]]]


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
class Example:
    exchange_id: str
    category: str
    similarity: float | None
    first_divergence: int | None
    divergence_unit: str | None
    primary_text: str | None
    candidate_text: str | None


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


def leg_labels(latency: Mapping[tuple[str, str], Any]) -> list[str]:
    """The latency table's leg labels in reading order: primary, the candidates, baseline."""
    return sorted(
        {label for label, _ in latency},
        key=lambda label: ({"primary": 0, "baseline": 2}.get(label, 1), label),
    )


def leg_label(leg: Leg, several_candidates: bool) -> str:
    """``primary``, ``baseline``, ``candidate`` — or ``candidate <backend>`` among several."""
    role = str(leg.role)
    return f"{role} {leg.backend}" if role == "candidate" and several_candidates else role


def latency(
    records: Sequence[Record], *, several_candidates: bool = False
) -> tuple[LatencyTable, dict[tuple[str, str], int], dict[tuple[str, str], Rate]]:
    """p50/p95/p99 of every timing per leg and category; errors per leg."""
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    for r in records:
        seen: set[str] = set()
        for leg in r.legs:
            label = leg_label(leg, several_candidates)
            if label in seen:
                continue
            seen.add(label)
            ok = leg.ok
            for cat in (r.category, ALL):
                key = (label, cat)
                tally = counts.setdefault(key, [0, 0])
                tally[0] += 1
                tally[1] += 0 if ok else 1
                if not ok:
                    continue
                bucket = values.setdefault(key, {m: [] for m in LATENCY_METRICS})
                for m in LATENCY_METRICS:
                    if m == "tpot_s" and leg.tokens_source == "estimated":
                        continue  # per-token times only from exact counts (evidence.counts)
                    v = leg.timing(m)
                    if v is not None:
                        bucket[m].append(v)
    table = {
        key: {m: percentiles(vs, (50.0, 95.0, 99.0)) for m, vs in ms.items()}
        for key, ms in values.items()
    }
    n = {key: len(ms["e2e_s"]) for key, ms in values.items()}
    errors = {key: Rate(t[1], t[0]) for key, t in counts.items()}
    return table, n, errors  # type: ignore[return-value]


def raw_speedups(records: Sequence[Record], backend: str | None) -> dict[str, RawSpeedups]:
    """Paired primary/candidate ratios of every mirrored exchange (at the candidate's own load)."""
    Pairs = list[tuple[float | None, float | None]]
    pairs: dict[str, tuple[Pairs, Pairs, Pairs, Pairs]] = {}
    for r in records:
        primary = r.primary
        if primary is None or not primary.ok:
            continue
        cand = r.candidate_leg(backend)
        base = r.baseline
        for cat in (r.category, ALL):
            e2e, tpot, ttft, base_e2e = pairs.setdefault(cat, ([], [], [], []))
            if cand is not None and cand.ok:
                e2e.append((primary.e2e_s, cand.e2e_s))
                tpot.append((primary.tpot_s, cand.tpot_s))
                ttft.append((primary.ttft_s, cand.ttft_s))
            if base is not None and base.ok:
                base_e2e.append((primary.e2e_s, base.e2e_s))
    return {
        cat: RawSpeedups(
            e2e=paired_speedup(e2e, seed=0),
            tpot=paired_speedup(tpot, seed=0),
            ttft=paired_speedup(ttft, seed=0),
            baseline_e2e=paired_speedup(base_e2e, seed=0),
        )
        for cat, (e2e, tpot, ttft, base_e2e) in pairs.items()
    }


def acceptance(records: Sequence[Record], backend: str | None) -> Acceptance:
    """The candidate's acceptance values by category, output length and concurrency."""
    Columns = tuple[list[float], list[float], list[float], list[float]]
    out: dict[AcceptanceDim, dict[str, Columns]] = {dim: {} for dim in ACCEPTANCE_DIMS}
    for r in records:
        leg = r.candidate_leg(backend)
        if leg is None or not leg.ok:
            continue
        acc = leg.acceptance
        values = (
            leg.tokens_per_event,
            acc.mean_acceptance_length,
            acc.draft_acceptance_rate,
            acc.coverage,
        )
        keys: tuple[tuple[AcceptanceDim, object], ...] = (
            ("category", r.category),
            ("output_length", leg.output_length_bucket or r.output_length_bucket),
            ("concurrency", leg.concurrency_bucket or r.concurrency_bucket),
        )
        for dim, key in keys:
            if key is None:
                continue
            slot = out[dim].setdefault(str(key), ([], [], [], []))
            for column, v in zip(slot, values, strict=True):
                if v is not None:
                    column.append(v)

    def cells(dim: AcceptanceDim) -> dict[str, AcceptanceValues]:
        return {
            key: AcceptanceValues(
                tokens_per_event=tuple(tpe),
                mean_acceptance_length=tuple(mal),
                draft_acceptance_rate=tuple(dar),
                coverage=tuple(cov),
            )
            for key, (tpe, mal, dar, cov) in out[dim].items()
        }

    return Acceptance(
        category=cells("category"),
        output_length=cells("output_length"),
        concurrency=cells("concurrency"),
    )


def quality(records: Sequence[Record], backend: str | None) -> dict[str, Quality]:
    acc: dict[str, dict[str, list[int]]] = {}
    sims: dict[str, list[float]] = {}
    for r in records:
        cand = r.comparison("primary", "candidate", b_backend=backend)
        base = r.comparison("primary", "baseline")
        for cat in (r.category, ALL):
            t = acc.setdefault(
                cat,
                {k: [0, 0] for k in ("cand", "base", "json_eq", "json_valid", "tools")}
                | {"flagged": [0, 0], "refusals": [0, 0]},
            )
            for key, c in (("cand", cand), ("base", base)):
                if c is None or not c.comparable or c.exact_match is None:
                    continue
                t[key][1] += 1
                t[key][0] += 0 if c.exact_match else 1
            if cand is None:
                continue
            t["flagged"][0] += cand.flag
            t["refusals"][0] += cand.one_sided_refusal
            if cand.json_expected:
                t["json_valid"][1] += 1
                t["json_valid"][0] += cand.json_valid_b
                if cand.json_equal is not None:
                    t["json_eq"][1] += 1
                    t["json_eq"][0] += cand.json_equal
            if cand.tool_names_equal is not None:
                t["tools"][1] += 1
                t["tools"][0] += bool(cand.tool_names_equal and cand.tool_arguments_equal)
            sim = cand.similarity
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


def gate(records: Sequence[Record]) -> dict[str, float | None]:
    """Per category: the median share of the primary's e2e spent generating (after ttft)."""
    shares: dict[str, list[float]] = {}
    for r in records:
        leg = r.primary
        if leg is None or not leg.ok:
            continue
        e2e, ttft = leg.e2e_s, leg.ttft_s
        if e2e is None or ttft is None or e2e <= 0:
            continue
        for cat in (r.category, ALL):
            shares.setdefault(cat, []).append(max(0.0, (e2e - ttft) / e2e))
    return {cat: percentiles(v, (50.0,))[0] for cat, v in shares.items()}


def resources(records: Sequence[Record], matrix: Sequence[MatrixRow]) -> dict[str, KvUsage]:
    """KV-cache usage per backend: from the legs' load at dispatch, else the scraper's window."""
    usage: dict[str, list[float]] = {}
    for r in records:
        for leg in r.legs:
            scraped = leg.load.scraped
            v = scraped.kv_cache_usage_perc if scraped is not None else None
            if v is None:
                v = leg.acceptance.window_kv_cache_usage_perc
            if v is not None:
                usage.setdefault(leg.backend, []).append(v)
    for row in matrix:
        if row.kv_cache_usage_peak is not None:
            usage.setdefault(str(row.backend), []).append(row.kv_cache_usage_peak)
    return {
        b: KvUsage(peak=max(vs), mean=mean(vs) or 0.0, samples=len(vs)) for b, vs in usage.items()
    }


def examples(records: Sequence[Record], backend: str | None, limit: int = 5) -> list[Example]:
    worst: list[tuple[float, Example]] = []
    for r in records:
        c = r.comparison("primary", "candidate", b_backend=backend)
        if c is None or c.exact_match is not False:
            continue
        sim = c.similarity
        prim, cand = r.primary, r.candidate_leg(backend)
        ex = Example(
            exchange_id=r.exchange_id,
            category=r.category,
            similarity=sim,
            first_divergence=c.first_divergence,
            divergence_unit=c.divergence_unit,
            primary_text=None if prim is None else prim.text,
            candidate_text=None if cand is None else cand.text,
        )
        worst.append((sim if sim is not None else 1.0, ex))
    worst.sort(key=lambda t: t[0])
    return [ex for _, ex in worst[:limit]]
