"""Report analysis: comparison records and matrix results in, the numbers a decision needs out
(pure; numpy only through :mod:`loadgen.speedup`).

Per candidate backend (several may be mirrored side by side) and per category: the latency of
every leg, the raw paired speed-ups, acceptance three ways, quality against the noise floor — and
the **load-true** speed-up at the load production runs at (:mod:`report.load`), which is
what the verdict uses. The verdict per category, in order:

0. more than half of the candidate's attempted legs failed or were dropped with its breaker open
   (:mod:`report.failures`) → ``candidate_failing``, with the counts by kind and the first error:
   a candidate that does not answer is not judged on speed, load or capacity;
1. the candidate cannot sustain production's rate (admission drops, a queue that does not drain,
   KV cache too small for production's peak) → ``do_not_adopt`` with the capacity reason;
2. fewer than :data:`MIN_PAIRS` paired exchanges → ``not_enough_data``;
3. the pairs do not cover production's load: when most pairs are at production's per-replica
   rate but some load strata hold too few of them → ``not_enough_data`` with the pairs needed;
   when the candidate ran at another per-replica arrival rate → ``not_load_matched``, with the
   parity measured and the share or replica count that would fix it — never ``adopt``;
4. candidate divergence above the noise floor (baseline-vs-primary rate) plus a tolerance →
   ``do_not_adopt`` (quality);
5. the speed-up at production load: CI above 1 → ``adopt``; below 1 → ``do_not_adopt``; within
   ±:data:`NO_GAIN` → ``do_not_adopt`` (no material gain); otherwise ``not_enough_data`` with
   the pairs needed for the CI to exclude 1 at the measured effect.

Then, over the whole analysis: a category the candidate alone cannot decide (too few pairs) while
the candidate as a whole ran off production's load says ``not_load_matched`` with the candidate's
fix; an ``adopt`` whose measured numbers already breach its own rollback trigger (the checklist's:
p99 TPOT or e2e past today's primary's) becomes ``do_not_adopt`` with that trigger as its reason;
and a candidate a rollout rolled back inside the report's window (:mod:`report.rollbacks`) is
``rolled_back`` for every category — never recommended for that window — with when, by which
guard, the reading against its threshold, and what its shadow evidence had said before. Its
load figures and that earlier verdict come from its latest span outside the rollout episodes
its guards rolled back (:mod:`report.episodes`): a bad deploy's legs make no crossover. A
category whose pick on the evidence before that split (or a configuration change) differs from
its pick now is listed with why (:class:`PickChange`).

Two gates on the engines' own configurations (``legs[].engine``) come first and last: the window is
split at the latest configuration change of any leg and only the exchanges after it are judged
(:mod:`report.requalify`; a rollback before that change no longer applies), and a candidate that
differs from production in more than its speculative block is ``confounded`` — unless a baseline
leg runs its configuration without speculation, against which it is then judged
(:mod:`report.confounds`).

Size: the verdict logic for one candidate and the assembly of all of them; the statistics it calls
live in ``load``, ``sections`` and ``candidates``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.quality import DEFAULT_ALPHA, DEFAULT_MARGINS
from core.stats import wilson
from counterfactual.matrix import Matrix
from loadgen.matrix import MatrixRow, stable_regions
from loadgen.results import LoadgenRow
from loadgen.speedup import Speedup, paired_speedup, pairs_needed
from records.reader import Record, read_all
from report import load as lt
from report.aggregates import Population
from report.candidates import (
    HeadToHead,
    Lossless,
    Recommendation,
    Speculation,
    head_to_head,
    lossless_claim,
    policy_fragment,
    recommend,
    speculation,
)
from report.checklist import Tables, breaches, checklist
from report.confounds import Confound, confound
from report.counts import Counts, counts as counts_of
from report.episodes import Episode, Span, judged_span, rolled_back_episodes
from report.failures import Failures, failures
from report.model import Acceptance, KvUsage, RawSpeedups
from report.population import population_of
from report.quality import Equivalence, equivalence
from report.records import ALL
from report.requalify import ConfigChange, split
from report.rollbacks import Rollback, by_backend, guard_breaches, rollbacks
from report.sections import (
    Example,
    LatencyTable,
    Quality,
    Rate,
    acceptance,
    bucket_order,
    examples,
    gate,
    latency,
    quality,
    raw_speedups,
    resources,
)
from report.timeline import Segment, timeline
from report.workflows import Workflows, workflows_of

__all__ = [
    "ALL",
    "Analysis",
    "CandidateAnalysis",
    "Verdict",
    "analyze",
    "bucket_order",
    "wilson",
]

MIN_PAIRS = 10
MATCHED_SHARE = 0.5  # at least this share of pairs at parity: the load is right, the data thin
NO_GAIN = 0.03  # a speedup CI inside [1/1.03, 1.03] is "no material gain"
GATE_SHARE = 0.5

Decision = Literal[
    "adopt",
    "do_not_adopt",
    "not_enough_data",
    "not_load_matched",
    "candidate_failing",
    "rolled_back",
    "confounded",
]
DECISION_LABELS: dict[str, str] = {
    "adopt": "adopt",
    "do_not_adopt": "do not adopt",
    "not_enough_data": "not enough data",
    "not_load_matched": "not load-matched",
    "candidate_failing": "candidate failing",
    "rolled_back": "rolled back",
    "confounded": "confounded",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    category: str
    decision: Decision
    reasons: tuple[str, ...]
    pairs: int  # load-matched pairs
    pairs_needed: int | None  # for not_enough_data
    e2e: Speedup | None  # raw paired speed-up (at whatever load the candidate ran)
    tpot: Speedup | None
    at_load: lt.LoadTrue | None = None  # the speed-ups at production's load
    fix: str | None = None  # not_load_matched: the share or replicas that would give parity
    rollback: Rollback | None = None  # rolled_back: the rollback inside the window
    without_rollback: Decision | None = None  # rolled_back: the window's evidence without it

    @property
    def label(self) -> str:
        return DECISION_LABELS[self.decision]


@dataclass(frozen=True, slots=True)
class CandidateAnalysis:
    """Everything the report says about one candidate backend (computed whole, then frozen)."""

    backend: str
    speedups: Mapping[str, RawSpeedups]  # category → raw paired speed-ups
    acceptance: Acceptance  # by category, output length, concurrency
    quality: dict[str, Quality]  # greedy exact match against the noise floor
    equivalence: dict[str, Equivalence]  # the quality verdict (sampled tests + exact match)
    load: dict[str, lt.LoadTrue]  # category → the speed-ups at production load
    load_points: list[lt.LoadPoint]  # speed-up against load (all categories)
    crossover: lt.Crossover | None
    schedule: list[list[int]]
    capacity: lt.Capacity
    exclusions: dict[str, Counter[str]]  # category → why exchanges did not count
    verdicts: Sequence[Verdict]
    examples: Sequence[Example]
    depth: int | None  # num_speculative_tokens, as the records show it
    speculation: Speculation | None = None  # who the candidate is (method, depth, label, …)
    lossless: Lossless | None = None  # whether the report may call it lossless
    failures: Failures = field(default_factory=Failures)  # its legs and drops, by how they failed
    rollback: Rollback | None = None  # a rollout rolled it back inside the window
    confound: Confound | None = None  # how its configuration differs from production's
    # A rolled-back candidate is judged on its latest span outside its rolled-back rollout
    # episodes (report.episodes); None: on the whole window.
    span: Span | None = None

    @property
    def failing(self) -> bool:
        return self.failures.failing

    @property
    def overall(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.category == ALL), None)

    @property
    def label(self) -> str:
        return self.speculation.label if self.speculation is not None else self.backend


@dataclass(frozen=True, slots=True)
class PickChange:
    """A category's pick differs between two windows of one report: the evidence before the
    window was split (a rolled-back rollout episode, a configuration change) and the window the
    verdicts judge."""

    category: str
    before: str | None  # the backend picked on the earlier window (None: no pick)
    after: str | None  # the backend picked now
    split: str  # where the window was split, in words
    why: str  # why the pick changed, with the number behind it

    def to_json(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "before": self.before,
            "after": self.after,
            "split": self.split,
            "why": self.why,
        }


@dataclass(frozen=True, slots=True)
class Analysis:
    """Everything the report shows: :func:`analyze` computes every part first and constructs it
    once; nothing patches it afterwards."""

    categories: list[str]
    records: int
    latency: LatencyTable
    latency_n: dict[tuple[str, str], int]
    errors: dict[tuple[str, str], Rate]
    gate: dict[str, float | None]  # category → median share of e2e spent generating
    resources: Mapping[str, KvUsage]  # backend → its KV-cache usage
    candidates: dict[str, CandidateAnalysis]
    checklist: Sequence[str]
    notes: Sequence[str]  # what could not be made load-true, and why
    matrix: Sequence[MatrixRow] = field(default_factory=list)  # the benchmark matrix's cells
    stable_regions: list[str] = field(default_factory=list)
    loadgen: Sequence[LoadgenRow] = field(default_factory=list)  # measured client requests
    head_to_head: list[HeadToHead] = field(default_factory=list)
    recommendations: Mapping[str, Recommendation] = field(default_factory=dict)  # category → pick
    policy_fragment: str | None = None  # rules routing each category to its pick
    rollout: list[Segment] = field(default_factory=list)  # stages the records went through
    # Every proposer and depth scored on the records' own token ids (counterfactual.matrix);
    # None when no record carries token ids (the policy's counterfactual section is off).
    counterfactual: Matrix | None = None
    # The detail sections' sample size when the window held more exchanges (report.population);
    # None: they read every exchange.
    sample: int | None = None
    rollbacks: Sequence[Rollback] = field(default_factory=list)  # inside the window, in time order
    # The rollout episodes those rollbacks ended (report.episodes): a rolled-back candidate is
    # judged outside them.
    episodes: Sequence[Episode] = field(default_factory=list)
    # Guard breaches that did not roll back to shadow (a drift guard's back-to-canary), by guard.
    breaches: Sequence[Rollback] = field(default_factory=list)
    # Categories whose pick differs between the window before the split and the judged one.
    pick_changes: Sequence[PickChange] = field(default_factory=list)
    window: tuple[int, int] | None = None  # first and last exchange start (unix ns)
    # Which footing the mirrored legs' token counts were read on (evidence.counts).
    counts: Counts | None = None
    # Every engine configuration change in the window; the verdicts judge from the last one on.
    config_changes: Sequence[ConfigChange] = field(default_factory=list)
    judged_since: int | None = None  # unix ns of that change (None: no change)
    judged: int | None = None  # exchanges judged after it
    # Calls grouped into application runs and runs into workflow types, with each candidate's
    # projected run speed-up (report.workflows); None when no record names a run.
    workflows: Workflows | None = None

    @property
    def gate_overall(self) -> float | None:
        return self.gate.get(ALL)

    @property
    def main(self) -> CandidateAnalysis | None:
        """The candidate the report's top line speaks for: the one recommended for all
        traffic, else the first."""
        pick = self.recommendations.get(ALL)
        if pick is not None and pick.backend in self.candidates:
            return self.candidates[pick.backend]
        return next(iter(self.candidates.values()), None)

    @property
    def several(self) -> bool:
        return len(self.candidates) > 1


# -- pairs and exclusions ----------------------------------------------------------------------


def _pairs(records: Sequence[Record], backend: str) -> tuple[list[lt.Pair], list[lt.Pair]]:
    """(primary/candidate pairs, baseline/candidate pairs) of ``backend`` with their loads."""
    primary_pairs: list[lt.Pair] = []
    baseline_pairs: list[lt.Pair] = []
    for r in records:
        cand, prim, base = r.candidate_leg(backend), r.primary, r.baseline
        if cand is None or not cand.ok:
            continue
        c_e2e = cand.e2e_s
        step = r.sampling.sweep_step
        started = r.started_unix_ns
        for reference, pairs in ((prim, primary_pairs), (base, baseline_pairs)):
            if reference is None or not reference.ok:
                continue
            ref_e2e = reference.e2e_s
            prod = lt.per_replica_rate(prim)
            if ref_e2e is None or c_e2e is None or prod is None:
                continue
            parity = cand.load_parity
            if reference is base:  # candidate and baseline at the same share: the same load
                ref_rate = lt.per_replica_rate(base)
                cand_rate = lt.per_replica_rate(cand)
                parity = cand_rate / ref_rate if cand_rate and ref_rate else None
            pairs.append(
                lt.Pair(
                    reference_e2e=ref_e2e,
                    candidate_e2e=c_e2e,
                    reference_tpot=reference.tpot_s,
                    candidate_tpot=cand.tpot_s,
                    production_load=prod,
                    candidate_load=lt.per_replica_rate(cand),
                    candidate_concurrency=lt.per_replica_concurrency(cand),
                    parity=parity,
                    sweep_step=step,
                    started_unix_ns=started,
                    category=r.category,
                )
            )
    return primary_pairs, baseline_pairs


def _capacity(records: Sequence[Record], backend: str) -> lt.Capacity:
    cap = lt.Capacity()
    concurrency = []
    for r in sorted(records, key=lambda r: r.started_unix_ns):
        cand = r.candidate_leg(backend)
        if cand is not None:
            cap.sampled += 1
            cap.failed += not cand.ok
            c = lt.per_replica_concurrency(cand)
            p = lt.per_replica_concurrency(r.primary)
            if c is not None and p is not None:
                concurrency.append((c, p))
        for drop in r.sampling.dropped:
            if drop.backend == backend:
                cap.sampled += 1
                cap.dropped[drop.reason] += 1
    cap.growth = lt.growth(concurrency)
    cap.kv_per_request = lt.kv_per_request(leg for r in records for leg in r.legs)
    production = [c for r in records if (c := lt.per_replica_concurrency(r.primary)) is not None]
    cap.production_peak_concurrency = max(production) if production else None
    return cap


def _depth(records: Sequence[Record], backend: str) -> int | None:
    """Tokens drafted per drafting step, at most: the candidate's ``num_speculative_tokens``."""
    depth = None
    for r in records:
        leg = r.candidate_leg(backend)
        if leg is None:
            continue
        drafts, tokens = leg.acceptance.num_drafts, leg.acceptance.num_draft_tokens
        if drafts and tokens:
            depth = max(depth or 0, math.ceil(tokens / drafts))
    return depth


# -- verdicts --------------------------------------------------------------------------------


def _fix(at: lt.LoadTrue, share: float | None, replicas: int | None) -> str:
    """What would give parity 1: the share to mirror, or the candidate replicas for this share."""
    parity = at.parity_p50
    if parity is None or parity <= 0:
        return "give the candidate the per-replica arrival rate of a production replica"
    if share is not None and share / parity <= 1.0:
        # One number to paste first; load_matched computes a share from the policy's replica
        # counts, which the records cannot check, so it comes second, said as what it does.
        x = f"{share / parity:.2g}"
        parts = [
            f"mirror a share of {x} instead of {share:.2g} (--shadow-ratio {x}, or ratio: {x} "
            "in a policy; ratio: load_matched mirrors candidate replicas / primary replicas)"
        ]
    else:
        parts = ["ratio: load_matched (share = candidate replicas / primary replicas)"]
    # Fewer candidate replicas can only fix a low parity down to one replica; below that the
    # share is the only lever, and advice of "0.07 replicas" would be noise.
    needed = round(replicas * parity) if replicas is not None else None
    if replicas is not None and needed is not None and needed >= 1 and needed != replicas:
        parts.append(f"{needed} candidate replicas instead of {replicas} at this share")
    return ", or ".join(parts)


def _verdict(
    cat: str,
    raw: RawSpeedups,
    eq: Equivalence | None,
    at: lt.LoadTrue | None,
    capacity: list[str],
    *,
    share: float | None,
    replicas: int | None,
    failing: Failures | None = None,
) -> Verdict:
    e2e_raw, tpot_raw = raw.e2e, raw.tpot
    pairs = at.matched_pairs if at is not None else 0
    reasons: list[str] = []

    def make(decision: Decision, needed: int | None = None, fix: str | None = None) -> Verdict:
        return Verdict(cat, decision, tuple(reasons), pairs, needed, e2e_raw, tpot_raw, at, fix)

    if failing is not None and failing.failing:
        reasons.extend(failing.reasons())
        return make("candidate_failing")
    if capacity:
        reasons.extend(f"cannot sustain production's rate: {c}" for c in capacity)
        return make("do_not_adopt")
    if eq is not None and eq.verdict == "not_equivalent":
        reasons.append(f"quality not equivalent ({eq.decided_by}): {eq.summary()}")
        return make("do_not_adopt")
    mirrored = at.mirrored_pairs if at is not None else 0
    if at is None or mirrored < MIN_PAIRS:
        reasons.append(
            f"{mirrored} paired primary/candidate exchanges; at least {MIN_PAIRS} needed"
        )
        return make("not_enough_data", MIN_PAIRS)
    if (not at.load_matched or at.e2e is None) and at.matched_pairs >= mirrored * MATCHED_SHARE:
        # The candidate ran at production's load; there are just too few pairs in some part of
        # production's load range to say what happens there.
        thin = [s for s in at.strata if s.weight > 0 and not s.covered]
        needed = max(MIN_PAIRS, math.ceil(lt.MIN_STRATUM * lt.STRATA * mirrored / at.matched_pairs))
        reasons.append(
            f"{at.matched_pairs} of {mirrored} pairs at production's per-replica load (parity "
            f"within ±{lt.PARITY_BAND - 1:.0%}), but {len(thin)} of {lt.STRATA} load strata hold "
            f"fewer than {lt.MIN_STRATUM}: they cover {at.coverage:.0%} of production's load "
            f"(needs {lt.MIN_COVERAGE:.0%})"
        )
        return make("not_enough_data", needed)
    if not at.load_matched or at.e2e is None:
        parity = f"{at.parity_p50:.2f}×" if at.parity_p50 is not None else "an unknown multiple of"
        reasons.append(
            f"the candidate ran at {parity} production's per-replica arrival rate (p50 over "
            f"{mirrored} pairs): {at.matched_pairs} pairs within ±{lt.PARITY_BAND - 1:.0%}, "
            f"covering {at.coverage:.0%} of production's load (needs {lt.MIN_COVERAGE:.0%})"
        )
        if e2e_raw is not None:
            reasons.append(
                f"its raw speed-up {e2e_raw.point:.2f}× holds at that load, not at production's"
            )
        fix = _fix(at, share, replicas)
        reasons.append(f"to measure it at production's load: {fix}")
        return make("not_load_matched", fix=fix)
    e2e = at.e2e
    gain = (
        f"e2e speed-up at production load {e2e.estimate:.2f}× (95 % CI {e2e.low:.2f}–"
        f"{e2e.high:.2f}, n={e2e.n})"
    )
    reasons.append(gain)
    if eq is not None and eq.partner == "primary":
        reasons.append(
            "no baseline leg: sampled outputs compared with the primary's, greedy ones by exact "
            "match"
        )
    if e2e.significant_gain:
        if eq is None or eq.verdict != "equivalent":
            reasons.append(
                "quality equivalence not yet shown: "
                + (eq.summary() if eq is not None else "no comparable exchanges")
            )
            return make("not_enough_data", eq.needed if eq is not None else None)
        reasons.append(f"quality equivalent ({eq.decided_by}): {eq.summary()}")
        return make("adopt")
    if e2e.significant_loss:
        reasons.append("the candidate is slower at production's load")
        return make("do_not_adopt")
    if e2e.low >= 1 / (1 + NO_GAIN) and e2e.high <= 1 + NO_GAIN:
        reasons.append(f"no material gain: the CI lies within ±{NO_GAIN:.0%}")
        return make("do_not_adopt")
    resolve = pairs_needed(e2e.estimate, e2e.low, e2e.high, e2e.n)
    reasons.append(
        "the CI includes 1"
        + (f"; about {resolve} pairs would resolve the measured effect" if resolve else "")
    )
    return make("not_enough_data", resolve)


def _share_and_replicas(records: Sequence[Record], backend: str) -> tuple[float | None, int | None]:
    for r in reversed(records):
        leg = r.candidate_leg(backend)
        if leg is not None and leg.share is not None:
            return leg.share, leg.load.replicas
    return None, None


def analyze_candidate(
    records: Sequence[Record],
    backend: str,
    categories: Sequence[str],
    population: Population | None = None,
    *,
    margins: Mapping[str, float] = DEFAULT_MARGINS,
    alpha: float = DEFAULT_ALPHA,
    tables: Tables | None = None,
    rollback: Rollback | None = None,
    span: Span | None = None,
) -> CandidateAnalysis:
    """One candidate, whole: with ``tables`` (the latency table and error rates of the analysis)
    an ``adopt`` its own rollback triggers would trip becomes ``do_not_adopt``; with ``rollback``
    (a rollout rolled it back inside the window) every verdict is ``rolled_back``; ``span``: the
    part of the window ``records`` were cut to (:func:`report.episodes.judged_span`), named in
    the verdicts' reasons."""
    pop = population if population is not None else population_of(records)
    primary_pairs, baseline_pairs = _pairs([r for r in records if not r.speculation_skip], backend)
    # The load-true estimate and the exclusions count every exchange of the window (the
    # population, summed where the data is); the rest of this analysis reads ``records``.
    load = {cat: pop.load_true(backend, cat) for cat in [*categories, ALL]}
    points = lt.speedup_vs_load(baseline_pairs, primary_pairs)
    cross = lt.crossover(points)
    spec = speculation(records, backend)
    observed = _depth(records, backend)
    depth = spec.num_speculative_tokens if spec.num_speculative_tokens is not None else observed
    if observed is not None and depth is not None and observed > depth:
        spec = dataclasses.replace(
            spec,
            mismatches=(
                *spec.mismatches,
                f"per-request counts show up to {observed} drafts per step; k is said to be {depth}",
            ),
        )
    capacity = _capacity(records, backend)
    problems = capacity.problems(backend)
    # Requests a speculative engine decodes plainly (penalties, min_p) say nothing of speculation's
    # speed: they stay in the quality tests, out of the speed-ups and acceptance (counted).
    speed = [r for r in records if not r.speculation_skip]
    raw = raw_speedups(speed, backend)
    qual = quality(records, backend)
    eqv = equivalence(records, backend, qual, margins=margins, alpha=alpha)
    share, replicas = _share_and_replicas(records, backend)
    exclusions = {cat: Counter(n) for cat, n in pop.exclusions.get(backend, {}).items()}
    failed = failures(records, backend)
    verdicts = [
        _verdict(
            cat, raw.get(cat, RawSpeedups()), eqv.get(cat), load.get(cat), problems,
            share=share, replicas=replicas, failing=failed,
        )
        for cat in [*categories, ALL]
    ]  # fmt: skip
    verdicts = _mismatched_categories(verdicts)
    claim = lossless_claim(spec, qual.get(ALL))
    if spec.verification == "lossy":
        verdicts = [
            dataclasses.replace(v, reasons=(*v.reasons, f"not lossless: {claim.reason}"))
            for v in verdicts
        ]
    if tables is not None:
        leg = f"candidate {backend}" if tables.several else "candidate"
        verdicts = [_breached(v, breaches(tables, leg, v.category)) for v in verdicts]
    conf = confound(records, backend)
    if conf is not None and conf.fields:
        verdicts = _gated(verdicts, conf, speed, backend)
    if rollback is not None:
        verdicts = _rolled_back(verdicts, rollback, span)
    return CandidateAnalysis(
        backend=backend,
        speedups=raw,
        acceptance=acceptance(speed, backend),
        quality=qual,
        equivalence=eqv,
        load=load,
        load_points=points,
        crossover=cross,
        schedule=lt.speculation_schedule(points, cross, depth),
        capacity=capacity,
        exclusions=exclusions,
        verdicts=verdicts,
        examples=examples(records, backend),
        depth=depth,
        speculation=spec,
        lossless=claim,
        failures=failed,
        rollback=rollback,
        confound=conf,
        span=span,
    )


def _gated(
    verdicts: Sequence[Verdict], gate: Confound, records: Sequence[Record], backend: str
) -> list[Verdict]:
    """The confound gate on verdicts: a failing candidate stays failing and a quality or
    capacity failure stands; otherwise ``confounded`` — or, with a baseline that isolates the
    speculation, a verdict on the baseline/candidate pairs (speculation alone)."""
    out = []
    for v in verdicts:
        kept = v.decision == "candidate_failing" or (
            v.decision == "do_not_adopt"
            and any(r.startswith(("cannot sustain", "quality not")) for r in v.reasons)
        )
        if kept:
            out.append(dataclasses.replace(v, reasons=(*v.reasons, gate.reason())))
        elif gate.confounded:
            out.append(
                dataclasses.replace(
                    v, decision="confounded", reasons=(gate.reason(),), pairs_needed=None
                )
            )
        else:
            out.append(_against_baseline(v, gate, records, backend))
    return out


def _against_baseline(
    v: Verdict, gate: Confound, records: Sequence[Record], backend: str
) -> Verdict:
    """The candidate judged on its pairs with the isolating baseline (not load-true: the
    baseline was mirrored alongside it, at the same moment)."""
    e2e_pairs, tpot_pairs = [], []
    for r in records:
        cand, base = r.candidate_leg(backend), r.baseline
        if cand is None or base is None or not (cand.ok and base.ok):
            continue
        if v.category in (r.category, ALL):
            e2e_pairs.append((base.e2e_s, cand.e2e_s))
            tpot_pairs.append((base.tpot_s, cand.tpot_s))
    e2e, tpot = paired_speedup(e2e_pairs, seed=0), paired_speedup(tpot_pairs, seed=0)
    head = gate.reason()
    if e2e is None or e2e.n < MIN_PAIRS:
        n = e2e.n if e2e is not None else 0
        reasons = (head, f"{n} candidate/baseline pairs; at least {MIN_PAIRS} needed")
        return dataclasses.replace(
            v, decision="not_enough_data", reasons=reasons, pairs=n, pairs_needed=MIN_PAIRS,
            e2e=e2e, tpot=tpot,
        )  # fmt: skip
    said = (
        f"e2e speed-up over the baseline {e2e.point:.2f}× (95 % CI {e2e.ci_low:.2f}–"
        f"{e2e.ci_high:.2f}, n={e2e.n})"
    )
    decision: Decision = "not_enough_data"
    if e2e.significant_gain and v.decision in ("adopt", "not_enough_data", "do_not_adopt"):
        decision = "adopt" if not any("equivalence not yet" in r for r in v.reasons) else decision
    elif e2e.significant_loss:
        decision = "do_not_adopt"
    return dataclasses.replace(
        v, decision=decision, reasons=(head, said), pairs=e2e.n, pairs_needed=None, e2e=e2e,
        tpot=tpot,
    )  # fmt: skip


def _mismatched_categories(verdicts: list[Verdict]) -> list[Verdict]:
    """A category with too few pairs of its own, of a candidate that as a whole ran off
    production's load, says the load mismatch and its fix — not "not enough data": more pairs at
    the wrong load would not decide it either. Every mismatched category gives the candidate's
    one fix (the share is the candidate's, not a category's)."""
    overall = next((v for v in verdicts if v.category == ALL), None)
    if overall is None or overall.decision != "not_load_matched" or overall.at_load is None:
        return verdicts
    parity = overall.at_load.parity_p50
    out = []
    for v in verdicts:
        at = v.at_load
        matched = at is not None and at.matched_pairs >= at.mirrored_pairs * MATCHED_SHARE > 0
        if v.decision == "not_load_matched" and v.fix != overall.fix:
            fix = f"to measure it at production's load: {overall.fix}"
            reasons = tuple(fix if r.startswith("to measure it at") else r for r in v.reasons)
            out.append(dataclasses.replace(v, reasons=reasons, fix=overall.fix))
            continue
        if v.decision != "not_enough_data" or matched:
            out.append(v)
            continue
        mirrored = at.mirrored_pairs if at is not None else 0
        at_parity = f"{parity:.2f}×" if parity is not None else "an unknown multiple of"
        reasons = (
            f"the candidate ran at {at_parity} production's per-replica arrival rate (p50 over "
            f"all its pairs); {mirrored} pairs of this category, "
            f"{at.matched_pairs if at is not None else 0} of them at production's load",
            f"to measure it at production's load: {overall.fix}",
        )
        out.append(
            dataclasses.replace(
                v, decision="not_load_matched", reasons=reasons, pairs_needed=None,
                fix=overall.fix,
            )
        )  # fmt: skip
    return out


def _rolled_back(
    verdicts: Sequence[Verdict], rb: Rollback, span: Span | None = None
) -> list[Verdict]:
    """Every verdict becomes ``rolled_back``: what the rollout saw first, then what the shadow
    evidence had said (``span``: the evidence outside the rolled-back episode it was judged on)."""
    out = []
    evidence = "this window's evidence" if span is None else span.text()
    for v in verdicts:
        before = "; ".join(v.reasons)
        reasons = (
            rb.text(),
            "not recommended for this window: the rollout's guard saw it fail in production",
            f"without the rollback, {evidence} says: {v.label}"
            + (f" — {before}" if before else ""),
        )
        if rb.by not in (None, "guard"):
            reasons = (rb.text(), "not recommended for this window", reasons[2])
        out.append(
            dataclasses.replace(
                v, decision="rolled_back", reasons=reasons, pairs_needed=None, rollback=rb,
                without_rollback=v.decision,
            )
        )  # fmt: skip
    return out


def _notes(
    records: Sequence[Record],
    served_by_candidate: int = 0,
    population: int = 0,
    sample: int | None = None,
) -> list[str]:
    """Which numbers could not be made load-true, and why; what was left out."""
    scraped: dict[str, bool] = {}
    for r in records:
        for leg in r.legs:
            has = leg.load.scraped is not None
            scraped[leg.backend] = scraped.get(leg.backend, False) or has
    blind = sorted(b for b, has in scraped.items() if not has)
    out = [lt.OPEN_LOOP]
    if blind:
        out.append(
            f"No load gauges from {', '.join(blind)} (not vLLM or SGLang, or no metrics_url): "
            "their KV-cache capacity and running/waiting counts are unknown; load parity and "
            "production's load distribution come from the gateway's own dispatch rates and "
            "in-flight counts instead."
        )
    if records and not any(leg.load.present for r in records for leg in r.legs):
        out.append("These records carry no load at dispatch: no speed-up can be placed at a load.")
    if sample is not None:
        out.append(
            f"{population} exchanges in the window: the load-true speed-ups, load coverage and "
            "exclusions count every one of them (summed where the records are stored); latency, "
            "raw speed-ups, acceptance, quality, capacity, failure counts, examples, the rollout "
            f"timeline and its rollbacks read a sample of {sample} — the exchanges with the lowest MD5 "
            "of their id, independent of every measured value and the same on every engine."
        )
    if served_by_candidate:
        out.append(
            f"{served_by_candidate} exchanges answered by a candidate during a canary are left out "
            "of the verdicts: they are not shadow pairs (see the rollout timeline)."
        )
    return out


def _split_note(window: int, judged: int, since: int | None) -> list[str]:
    if since is None:
        return []
    return [
        f"An engine configuration changed inside the window: the verdicts judge the {judged} "
        f"exchanges after the latest change and leave out the {window - judged} before it (the "
        "rollout timeline still shows them all; docs/confounds.md)."
    ]


def _breached(v: Verdict, triggers: Sequence[str]) -> Verdict:
    """An ``adopt`` whose measured numbers are already past its own rollback triggers: a rollout
    would roll it back at once, so it is ``do_not_adopt``, those triggers its reasons."""
    if v.decision != "adopt" or not triggers:
        return v
    return dataclasses.replace(v, decision="do_not_adopt", reasons=(*triggers, *v.reasons))


def _candidate(
    everything: Sequence[Record],
    recs: Sequence[Record],
    backend: str,
    categories: Sequence[str],
    pop: Population,
    episodes: Sequence[Episode],
    *,
    margins: Mapping[str, float],
    alpha: float,
    tables: Tables,
    rollback: Rollback | None,
) -> CandidateAnalysis:
    """:func:`analyze_candidate` on the records the candidate is judged on: the whole window, or,
    when a rollout episode of its was rolled back, its latest span outside such episodes — its
    population, latency and error rates summed again over that span."""
    own, span = judged_span(everything, backend, episodes)
    if span is None:
        return analyze_candidate(
            recs, backend, categories, pop, margins=margins, alpha=alpha, tables=tables,
            rollback=rollback,
        )  # fmt: skip
    served = [r for r in own if r.served_by == "primary"]
    table, _, errors = latency(served, several_candidates=tables.several)
    return analyze_candidate(
        served, backend, categories, population_of(own), margins=margins, alpha=alpha,
        tables=Tables(latency=table, errors=errors, several=tables.several), rollback=rollback,
        span=span,
    )  # fmt: skip


def _pick_changes(
    whole: Sequence[Record],
    candidates: Mapping[str, CandidateAnalysis],
    now: Mapping[str, Recommendation],
    episodes: Sequence[Episode],
    since: int | None,
    categories: Sequence[str],
    *,
    margins: Mapping[str, float],
    alpha: float,
) -> list[PickChange]:
    """Each category whose pick on the evidence before the window's first split — the earliest
    rolled-back episode's start, else the latest configuration change — differs from its pick
    now, and why (the verdict that lost it, whose first reason carries the number)."""
    if episodes:
        first = episodes[0]
        split, cut = f"before {first.text()}", first.start_unix_ns
    elif since is not None:
        split, cut = "before the configuration change", since
    else:
        return []
    earlier = [r for r in whole if r.started_unix_ns < cut]
    served = [r for r in earlier if r.served_by == "primary"]
    backends = [b for b in candidates if any(r.candidate_leg(b) is not None for r in served)]
    if not backends:
        return []
    several = len(candidates) > 1
    table, _, errors = latency(served, several_candidates=several)
    tables = Tables(latency=table, errors=errors, several=several)
    pop = population_of(earlier)
    then = {
        b: analyze_candidate(served, b, categories, pop, margins=margins, alpha=alpha,
                             tables=tables)
        for b in backends
    }  # fmt: skip
    h2h = head_to_head(served, backends, categories)
    specs = {b: c.speculation for b, c in then.items() if c.speculation is not None}
    out = []
    for cat in [*categories, ALL]:
        verdicts = {b: v for b, c in then.items() for v in c.verdicts if v.category == cat}
        after = now.get(cat)
        if not verdicts or after is None:
            continue
        before = recommend(cat, verdicts, specs, h2h)
        if before.backend == after.backend:
            continue
        lost = candidates.get(before.backend) if before.backend is not None else None
        v = next((x for x in lost.verdicts if x.category == cat), None) if lost else None
        if lost is not None and v is not None and v.rollback is not None:
            why = f"{lost.label} was rolled back at {v.rollback.at()} (above)"
        elif lost is not None and v is not None and v.decision != "adopt":
            why = f"{lost.label}: {v.label} now — {v.reasons[0] if v.reasons else v.label}"
        else:
            why = after.reason
        out.append(PickChange(cat, before.backend, after.backend, split, why))
    return out


def analyze(
    records: Iterable[Record | Mapping[str, Any]],
    results: Iterable[Mapping[str, Any]] | None = None,
    *,
    margins: Mapping[str, float] = DEFAULT_MARGINS,
    alpha: float = DEFAULT_ALPHA,
    population: Population | None = None,
    transitions: Iterable[Mapping[str, Any]] = (),
    counterfactual: Matrix | None = None,
    spans: Mapping[str, tuple[int, int]] | None = None,
) -> Analysis:
    """Everything the report shows, from records and optional loadgen/matrix result rows.

    ``population``: the window's aggregates when ``records`` is only its sample
    (:func:`report.gather.gather`); by default they are summed from ``records``.
    ``transitions``: rollout transitions (:func:`report.rollbacks.load_transitions`) naming who
    rolled a rule back and why; without them, the records still show that it happened.
    ``counterfactual``: the proposer/depth matrix scored on the records' token ids, when built.
    ``spans``: the application's own spans' bounds per trace id (:mod:`report.spans`)."""
    whole = read_all(records)
    # Re-qualification: the verdicts judge the latest engine configuration of every leg.
    everything, changed, since = split(whole)
    if since is not None:
        population = None  # the window's sums span the change: summed again after it
    pop = population if population is not None else population_of(everything)
    sample = len(everything) if len(everything) < pop.records else None
    # Verdicts come from shadow pairs: the primary answered, the candidate was mirrored. During a
    # canary the candidate answers some requests (the primary is then its shadow); those
    # exchanges tell the rollout's story (the timeline), not the adoption decision.
    recs = [r for r in everything if r.served_by == "primary"]
    rows = list(results or ())
    matrix = [MatrixRow.from_json(r) for r in rows if MatrixRow.is_matrix(r)]
    loadgen = [
        LoadgenRow.from_json(r)
        for r in rows
        if not MatrixRow.is_matrix(r) and LoadgenRow.is_request(r)
    ]
    cats = list(pop.categories)
    backends = list(pop.backends)
    table, n, errors = latency(recs, several_candidates=len(backends) > 1)
    tables = Tables(latency=table, errors=errors, several=len(backends) > 1)
    rolled = rollbacks(whole, transitions)
    standing = [rb for rb in rolled if since is None or rb.at_unix_ns >= since]
    rolled_back = by_backend(standing)
    # A rolled-back candidate is judged outside its rolled-back episodes (report.episodes).
    episodes = rolled_back_episodes(everything, standing)
    candidates = {
        b: _candidate(
            everything, recs, b, cats, pop, episodes, margins=margins, alpha=alpha,
            tables=tables, rollback=rolled_back.get(b),
        )
        for b in backends
    }  # fmt: skip
    h2h = head_to_head(recs, backends, cats)
    specs = {b: c.speculation for b, c in candidates.items() if c.speculation is not None}
    recommendations: dict[str, Recommendation] = {}
    for cat in [*cats, ALL]:
        verdicts = {b: v for b, c in candidates.items() for v in c.verdicts if v.category == cat}
        if verdicts:
            recommendations[cat] = recommend(cat, verdicts, specs, h2h)
    resources_ = resources(recs, matrix)
    starts = [r.started_unix_ns for r in whole]
    return Analysis(
        categories=cats,
        records=pop.records,
        latency=table,
        latency_n=n,
        errors=errors,
        gate=gate(recs),
        resources=resources_,
        candidates=candidates,
        checklist=checklist(tables, candidates, recommendations, resources_) if recs else [],
        notes=(_notes(recs, pop.records - pop.shadow, pop.records, sample) if pop.records else [])
        + _split_note(len(whole), len(everything), since),
        sample=sample,
        matrix=matrix,
        stable_regions=stable_regions(matrix),
        loadgen=loadgen,
        head_to_head=h2h,
        recommendations=recommendations,
        policy_fragment=policy_fragment(list(recommendations.values())),
        rollout=timeline(whole),
        counterfactual=counterfactual,
        rollbacks=rolled,
        episodes=episodes,
        breaches=guard_breaches(whole, transitions),
        pick_changes=_pick_changes(
            whole,
            candidates,
            recommendations,
            episodes,
            since,
            cats,
            margins=margins,
            alpha=alpha,
        ),
        window=(min(starts), max(starts)) if starts else None,
        counts=counts_of(everything),
        config_changes=changed,
        judged_since=since,
        judged=len(everything) if since is not None else None,
        workflows=workflows_of(
            everything,
            pick=pick.backend if (pick := recommendations.get(ALL)) is not None else None,
            spans=spans,
        ),
    )
