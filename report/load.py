"""Load-true speed-ups: estimated at the load production runs at, never at the mirror's (pure).

A shadow sees only the mirrored share of traffic, and speculation pays at low load and loses at
high load, so a speed-up means something only at a stated load. Every record carries, per leg,
the load its backend met at dispatch (the gateway's dispatch rate per replica) and, per shadow
leg, the **load parity**: its backend's per-replica arrival rate over the primary's. This module
turns that into the numbers a verdict may use:

- **Matched pairs**: mirrored exchanges whose candidate ran within :data:`PARITY_BAND` of
  production's per-replica arrival rate (``1/1.25 ≤ parity ≤ 1.25``) — the candidate's batch
  then settles where it would in production (Little's law, with its own latency).
- **Production's load distribution**: the primary's per-replica arrival rate at dispatch over
  *every* record of the window, mirrored or not (Poisson arrivals see time averages), split into
  up to :data:`STRATA` equal-count strata.
- **The estimate at production load**: per stratum the geometric-mean ratio primary / candidate
  of the matched pairs, re-weighted to production's share of each stratum; a stratified
  Student-t interval from per-stratum sufficient statistics (count, sum, sum of squares — what
  an engine's ``GROUP BY`` returns, :mod:`report.population`) gives the 95 % interval. Strata
  with fewer than :data:`MIN_STRATUM` matched pairs are uncovered; when covered strata hold less than :data:`MIN_COVERAGE` of production's
  weight the evidence is **not load-matched** and no speed-up is claimed.
- **Speed-up against load**: pairs grouped by the load the candidate ran at (its sweep step, or
  strata of its per-replica rate), each against a reference *at the same load* — the baseline leg
  (a copy of production's configuration at the same share) where there is one, else the primary
  for matched pairs only; the **crossover** where the speed-up falls through 1 (interpolated in
  log speed-up), and a **speculation schedule** by batch size in vLLM's
  ``num_speculative_tokens_per_batch_size`` form, speculation off above the crossover's batch.
- **Capacity**: a candidate that cannot sustain production's rate — admission drops above
  :data:`MAX_DROP_SHARE` of its sampled legs, or its in-flight count growing through the run —
  is rejected for that, not judged on the requests that survived; KV cache per running request
  on each backend gives the concurrency each can hold in the same memory.

The model assumed is **open loop**: the mirror reproduces production's arrival process, so the
honest comparison is an A/B at the same arrival rate per replica. Closed-loop users would slow
their own arrivals on a slower backend, which no mirror reproduces (said in the report).

Size: the load-true statistics as one unit — stratification, re-weighting, the stratified
interval, the curve against load, the crossover, the schedule and capacity share their data types
and are tested together against ground truth.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.stats import percentile, percentile_sorted, t_quantile
from records.reader import Leg

PARITY_BAND = 1.25  # matched: 1/1.25 <= parity <= 1.25 (±25 %)
STRATA = 4  # equal-count strata of production's per-replica load
MIN_STRATUM = 5  # matched pairs a stratum needs to count as covered
MIN_COVERAGE = 0.9  # production weight the covered strata must hold
MAX_DROP_SHARE = 0.02  # admission drops above this share of a candidate's legs: capacity
GROWTH_FACTOR = 2.0  # candidate in-flight growing this much (last third vs first) …
GROWTH_MIN = 4.0  # … and by at least this many requests per replica: a queue that never drains
MAX_BATCH = 1024  # upper end of a speculation schedule (vLLM's scheduler limit is max_num_seqs)
OPEN_LOOP = (
    "Open loop: the mirror reproduces production's arrival process, so speed-ups are at equal "
    "per-replica arrival rate. Closed-loop users would slow their own arrivals on a slower "
    "backend, which no mirror reproduces."
)


def per_replica_rate(leg: Leg | None) -> float | None:
    """The leg's backend's per-replica arrival rate at dispatch."""
    return None if leg is None else leg.load.per_replica_rate_rps


def per_replica_concurrency(leg: Leg | None) -> float | None:
    """The backend's own running + waiting count when scraped, else this gateway's in-flight."""
    return None if leg is None else leg.load.per_replica_concurrency


def matched(parity: float | None) -> bool:
    return parity is not None and 1 / PARITY_BAND <= parity <= PARITY_BAND


@dataclass(frozen=True, slots=True)
class Pair:
    """One exchange's primary and candidate (or reference and candidate) timings and loads."""

    reference_e2e: float
    candidate_e2e: float
    reference_tpot: float | None
    candidate_tpot: float | None
    production_load: float  # the primary's per-replica arrival rate at dispatch
    candidate_load: float | None  # the candidate's per-replica arrival rate at dispatch
    candidate_concurrency: float | None
    parity: float | None
    sweep_step: int | None
    started_unix_ns: int
    category: str = ""


@dataclass(frozen=True, slots=True)
class Estimate:
    """A geometric-mean speed-up with a 95 % interval over ``n`` pairs."""

    estimate: float
    low: float
    high: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n}

    @property
    def significant_gain(self) -> bool:
        return self.low > 1.0

    @property
    def significant_loss(self) -> bool:
        return self.high < 1.0


@dataclass(frozen=True, slots=True)
class Stratum:
    low: float  # production per-replica load range [low, high]
    high: float
    weight: float  # production's share of exchanges in it
    pairs: int  # matched pairs in it
    covered: bool


@dataclass(frozen=True, slots=True)
class LoadTrue:
    """The speed-ups at production's load for one candidate and one category (or all)."""

    e2e: Estimate | None
    tpot: Estimate | None
    strata: tuple[Stratum, ...]
    coverage: float  # production weight held by covered strata
    matched_pairs: int
    mirrored_pairs: int  # pairs at any parity
    primary_load_p50: float | None
    candidate_load_p50: float | None
    parity_p50: float | None
    primary_load_p5: float | None = None  # production's operating range
    primary_load_p95: float | None = None

    @property
    def load_matched(self) -> bool:
        return self.coverage >= MIN_COVERAGE and self.e2e is not None

    def load_json(self) -> dict[str, float | None]:
        return {
            "primary_per_replica_p50": self.primary_load_p50,
            "candidate_per_replica_p50": self.candidate_load_p50,
            "parity_p50": self.parity_p50,
        }


def _quantile_edges(values: Sequence[float], k: int) -> list[float]:
    ordered = sorted(values)
    edges = [percentile_sorted(ordered, 100.0 * i / k) or 0.0 for i in range(1, k)]
    return sorted(set(edges))


def stratum_of(value: float, edges: Sequence[float]) -> int:
    """The stratum index of ``value``: how many edges it lies above (SQL: the same sum)."""
    return sum(value > e for e in edges)


def log_ratio(ref: float | None, cand: float | None) -> float | None:
    if ref is None or cand is None or ref <= 0 or cand <= 0:
        return None
    return math.log(ref / cand)


# -- sufficient statistics: what an engine sums, and the estimate from them ----------------------


@dataclass(frozen=True, slots=True)
class Moments:
    """Sufficient statistics of one group's log ratios: count, sum and sum of squares.

    What a database returns for a ``GROUP BY`` (``count()``, ``sum(x)``, ``sum(x*x)``), so the
    estimate below is the same number whether the pairs were summed in Python or in an engine."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    @classmethod
    def of(cls, values: Iterable[float]) -> Moments:
        xs = list(values)
        return cls(len(xs), math.fsum(xs), math.fsum(x * x for x in xs))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def variance(self) -> float:
        """The sample variance (0 below two values: one value says nothing of spread)."""
        if self.n < 2:
            return 0.0
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))


def _estimate(groups: Sequence[tuple[float, Moments]]) -> Estimate | None:
    """Weighted mean of per-group mean log ratios with a 95 % Student-t interval.

    The stratified estimator's variance is Σ (w_s/W)² s_s²/n_s; its degrees of freedom are
    Welch–Satterthwaite's. This is the interval a stratified bootstrap approximates, computed
    from per-group sufficient statistics, so it needs no per-pair data (an engine sums them)."""
    groups = [(w, m) for w, m in groups if m.n > 0]
    total_w = sum(w for w, _ in groups)
    if not groups or total_w <= 0:
        return None
    point = sum(w * m.mean for w, m in groups) / total_w
    parts = [((w / total_w) ** 2 * m.variance / m.n, m.n) for w, m in groups]
    var = sum(a for a, _ in parts)
    n = sum(m.n for _, m in groups)
    if var <= 0:
        return Estimate(math.exp(point), math.exp(point), math.exp(point), n)
    denom = sum(a * a / (k - 1) for a, k in parts if k > 1)
    df = max(1, int(var * var / denom)) if denom > 0 else 1
    half = t_quantile(0.975, df) * math.sqrt(var)
    return Estimate(math.exp(point), math.exp(point - half), math.exp(point + half), n)


@dataclass(frozen=True, slots=True)
class ProductionLoad:
    """Production's per-replica load over every exchange of one category (or all): the strata
    edges, each stratum's count and range, and the operating range (p5, p50, p95)."""

    n: int = 0
    edges: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    lows: tuple[float, ...] = ()
    highs: tuple[float, ...] = ()
    p5: float | None = None
    p50: float | None = None
    p95: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> ProductionLoad:
        ordered = sorted(values)
        if not ordered:
            return cls(counts=(0,), lows=(math.nan,), highs=(math.nan,))
        edges = tuple(_quantile_edges(ordered, STRATA))
        counts, lows, highs = (
            [0] * (len(edges) + 1),
            [math.nan] * (len(edges) + 1),
            [math.nan] * (len(edges) + 1),
        )
        for x in ordered:
            i = stratum_of(x, edges)
            if not counts[i]:
                lows[i] = x
            counts[i] += 1
            highs[i] = x
        p5, p50, p95 = (percentile_sorted(ordered, q) for q in (5, 50, 95))
        return cls(len(ordered), edges, tuple(counts), tuple(lows), tuple(highs), p5, p50, p95)


@dataclass(frozen=True, slots=True)
class Cell:
    """One candidate's pairs in one category, reduced to what the load-true estimate needs:
    per production-load stratum the matched pairs and their log-ratio moments."""

    mirrored: int = 0  # pairs at any parity
    matched: tuple[int, ...] = ()  # matched pairs per stratum
    e2e: tuple[Moments, ...] = ()
    tpot: tuple[Moments, ...] = ()
    parity_p50: float | None = None
    candidate_load_p50: float | None = None

    @classmethod
    def of(cls, pairs: Sequence[Pair], edges: Sequence[float]) -> Cell:
        return cls.of_columns(
            production=[p.production_load for p in pairs],
            parity=[p.parity for p in pairs],
            candidate_load=[p.candidate_load for p in pairs],
            e2e=[log_ratio(p.reference_e2e, p.candidate_e2e) for p in pairs],
            tpot=[log_ratio(p.reference_tpot, p.candidate_tpot) for p in pairs],
            edges=edges,
        )

    @classmethod
    def of_columns(
        cls,
        *,
        production: Sequence[float],
        parity: Sequence[float | None],
        candidate_load: Sequence[float | None],
        e2e: Sequence[float | None],
        tpot: Sequence[float | None],
        edges: Sequence[float],
    ) -> Cell:
        """From one value per pair: production's load, the parity, the candidate's load and the
        two log speed-ups (``None``: unknown)."""
        k = len(edges) + 1
        counts = [0] * k
        e2e_by: list[list[float]] = [[] for _ in range(k)]
        tpot_by: list[list[float]] = [[] for _ in range(k)]
        for i, prod in enumerate(production):
            if not matched(parity[i]):
                continue
            s = stratum_of(prod, edges)
            counts[s] += 1
            if (x := e2e[i]) is not None:
                e2e_by[s].append(x)
            if (y := tpot[i]) is not None:
                tpot_by[s].append(y)
        return cls(
            mirrored=len(production),
            matched=tuple(counts),
            e2e=tuple(Moments.of(g) for g in e2e_by),
            tpot=tuple(Moments.of(g) for g in tpot_by),
            parity_p50=percentile([p for p in parity if p is not None], 50),
            candidate_load_p50=percentile([c for c in candidate_load if c is not None], 50),
        )


def at_production(production: ProductionLoad, cell: Cell) -> LoadTrue:
    """The speed-ups at production's load from production's strata and one candidate's cell —
    the one estimator, whichever engine summed the inputs."""
    total = production.n
    strata = []
    for i, count in enumerate(production.counts):
        n = cell.matched[i] if i < len(cell.matched) else 0
        strata.append(
            Stratum(
                low=production.lows[i],
                high=production.highs[i],
                weight=count / total if total else 0.0,
                pairs=n,
                covered=n >= MIN_STRATUM,
            )
        )
    covered = [i for i, s in enumerate(strata) if s.covered]
    coverage = sum(strata[i].weight for i in covered)
    enough = coverage >= MIN_COVERAGE  # no speed-up is claimed for an uncovered load range

    def groups(moments: Sequence[Moments]) -> list[tuple[float, Moments]]:
        return [(strata[i].weight, moments[i]) for i in covered if i < len(moments)]

    return LoadTrue(
        e2e=_estimate(groups(cell.e2e)) if enough else None,
        tpot=_estimate(groups(cell.tpot)) if enough else None,
        strata=tuple(strata),
        coverage=coverage,
        matched_pairs=sum(cell.matched),
        mirrored_pairs=cell.mirrored,
        primary_load_p50=production.p50,
        candidate_load_p50=cell.candidate_load_p50,
        parity_p50=cell.parity_p50,
        primary_load_p5=production.p5,
        primary_load_p95=production.p95,
    )


def load_true(production_loads: Sequence[float], pairs: Sequence[Pair]) -> LoadTrue:
    """The speed-ups at production's load from ``pairs`` (all mirrored pairs of one candidate).

    ``production_loads``: the primary's per-replica load of every exchange in the window.
    """
    production = ProductionLoad.of(production_loads)
    return at_production(production, Cell.of(pairs, production.edges))


def _values(p: Pair, metric: str) -> tuple[float | None, float | None]:
    if metric == "e2e":
        return p.reference_e2e, p.candidate_e2e
    return p.reference_tpot, p.candidate_tpot


# -- speed-up against load ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """The candidate's speed-up against a reference at the same load."""

    load: float  # the candidate's median per-replica arrival rate at this level
    concurrency: float | None  # the candidate's median per-replica concurrency (≈ batch)
    e2e_speedup: float
    low: float
    high: float
    n: int
    reference: str  # "baseline" or "primary"
    sweep_step: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "load": self.load,
            "concurrency": self.concurrency,
            "e2e_speedup": self.e2e_speedup,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "reference": self.reference,
            "sweep_step": self.sweep_step,
        }


def speedup_vs_load(
    baseline_pairs: Sequence[Pair], primary_pairs: Sequence[Pair]
) -> list[LoadPoint]:
    """One point per load level, lowest load first (see the module doc)."""
    points: list[LoadPoint] = []
    for reference, pairs in (("baseline", baseline_pairs), ("primary", primary_pairs)):
        usable = [p for p in pairs if p.candidate_load is not None]
        if reference == "primary":
            usable = [p for p in usable if matched(p.parity)]
        if not usable or points:  # the baseline, when there is one, answers at every level
            continue
        for step, group in _levels(usable):
            logs = Moments.of(
                v for p in group if (v := log_ratio(p.reference_e2e, p.candidate_e2e)) is not None
            )
            est = _estimate([(1.0, logs)])
            if est is None or logs.n < MIN_STRATUM:
                continue
            loads = [p.candidate_load for p in group if p.candidate_load is not None]
            conc = [c for p in group if (c := p.candidate_concurrency) is not None]
            points.append(
                LoadPoint(
                    load=percentile(loads, 50) or 0.0,
                    concurrency=percentile(conc, 50),
                    e2e_speedup=est.estimate,
                    low=est.low,
                    high=est.high,
                    n=est.n,
                    reference=reference,
                    sweep_step=step,
                )
            )
    return sorted(points, key=lambda p: p.load)


def _levels(pairs: Sequence[Pair]) -> list[tuple[int | None, list[Pair]]]:
    """Sweep steps when the run swept; else strata of the candidate's load."""
    if any(p.sweep_step is not None for p in pairs):
        steps: dict[int | None, list[Pair]] = {}
        for p in pairs:
            steps.setdefault(p.sweep_step, []).append(p)
        return sorted(steps.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
    loads = [p.candidate_load for p in pairs if p.candidate_load is not None]
    edges = _quantile_edges(loads, STRATA) if len(loads) >= STRATA * MIN_STRATUM * 4 else []
    levels: dict[int, list[Pair]] = {}
    for p in pairs:
        assert p.candidate_load is not None
        levels.setdefault(stratum_of(p.candidate_load, edges), []).append(p)
    return [(None, levels[k]) for k in sorted(levels)]


@dataclass(frozen=True, slots=True)
class Crossover:
    load: float  # per-replica arrival rate where the speed-up falls through 1
    concurrency: float | None  # the candidate's per-replica concurrency there (≈ batch)
    below_index: int  # the first load level whose speed-up is below 1


def crossover(points: Sequence[LoadPoint]) -> Crossover | None:
    """Where the speed-up (lowest load first) first falls below 1, interpolated; None: never."""
    for i, p in enumerate(points):
        if p.e2e_speedup >= 1.0:
            continue
        if i == 0:  # below 1 already at the lowest load measured
            return Crossover(p.load, p.concurrency, 0)
        q = points[i - 1]
        lq, lp = math.log(q.e2e_speedup), math.log(p.e2e_speedup)
        f = lq / (lq - lp) if lq != lp else 0.5
        load = q.load + f * (p.load - q.load)
        conc = None
        if q.concurrency is not None and p.concurrency is not None:
            conc = q.concurrency + f * (p.concurrency - q.concurrency)
        return Crossover(load, conc, i)
    return None


def speculation_schedule(
    points: Sequence[LoadPoint], cross: Crossover | None, k: int | None
) -> list[list[int]]:
    """``[[lo, hi, k], …]`` by batch size (vLLM's ``num_speculative_tokens_per_batch_size``):
    the configured depth up to the crossover's batch, 0 (no speculation) above it."""
    depth = k if k is not None and k > 0 else 1
    if cross is None:
        return [[1, MAX_BATCH, depth]] if points else []
    if cross.concurrency is None:
        return []
    edge = max(0, math.floor(cross.concurrency))
    if edge < 1:
        return [[1, MAX_BATCH, 0]]
    return [[1, edge, depth], [edge + 1, MAX_BATCH, 0]]


# -- capacity --------------------------------------------------------------------------------


@dataclass(slots=True)
class Capacity:
    """Can the candidate carry production's load, and how much fits in its memory?"""

    sampled: int = 0  # candidate legs the policy chose
    dropped: Counter[str] = field(default_factory=Counter)  # by admission reason
    failed: int = 0  # legs that ran and failed
    growth: float | None = None  # last third's median concurrency over the first third's
    kv_per_request: dict[str, float] = field(default_factory=dict)  # backend → KV share per running
    production_peak_concurrency: float | None = None

    @property
    def drop_share(self) -> float:
        return sum(self.dropped.values()) / self.sampled if self.sampled else 0.0

    @property
    def admission_drops(self) -> int:
        """Drops for the shadow budget: not those of an open breaker, which only the
        candidate's failures open (:mod:`report.failures`), not its speed."""
        return sum(n for r, n in self.dropped.items() if r != "breaker_open")

    def max_concurrency(self, backend: str) -> float | None:
        per = self.kv_per_request.get(backend)
        return 1.0 / per if per else None

    def problems(self, candidate: str) -> list[str]:
        """Why the candidate cannot sustain production's rate (empty: it can)."""
        out = []
        share = self.admission_drops / self.sampled if self.sampled else 0.0
        if share > MAX_DROP_SHARE:
            reasons = ", ".join(
                f"{n} {r}" for r, n in self.dropped.most_common() if r != "breaker_open"
            )
            out.append(
                f"admission dropped {share:.0%} of the candidate's legs ({reasons}): it "
                "fell behind production's rate, and the survivors' latency is not production's"
            )
        if self.growth is not None and self.growth >= GROWTH_FACTOR:
            out.append(
                f"the candidate's concurrency grew {self.growth:.1f}× through the run relative to "
                "production's: its queue does not drain at production's rate"
            )
        cap, peak = self.max_concurrency(candidate), self.production_peak_concurrency
        if cap is not None and peak is not None and cap < peak:
            out.append(
                f"its KV cache holds about {cap:.0f} requests per replica; production peaks at "
                f"{peak:.0f}"
            )
        return out


def kv_per_request(legs: Iterable[Leg]) -> dict[str, float]:
    """Median KV-cache share per running request, per backend, from the scraped gauges."""
    shares: dict[str, list[float]] = {}
    for leg in legs:
        scraped = leg.load.scraped
        if scraped is None:
            continue
        kv, running = scraped.kv_cache_usage_perc, scraped.num_requests_running
        if kv is not None and running and running > 0:
            shares.setdefault(leg.backend, []).append(kv / running)
    return {b: statistics.median(v) for b, v in shares.items() if v}


def growth(concurrency: Sequence[tuple[float, float]]) -> float | None:
    """How much the candidate's concurrency grew through the run *relative to production's*:
    (candidate ÷ primary concurrency) over the last third over the first third, from
    (candidate, primary) per-replica concurrency pairs in time order. Load rising for both (a
    ramp, a busier hour) cancels; a candidate whose queue does not drain does not. 1.0 when the
    candidate's concurrency grew by less than :data:`GROWTH_MIN`; None with too few pairs.
    """
    n = len(concurrency)
    if n < 30:
        return None
    first, last = concurrency[: n // 3], concurrency[-(n // 3) :]
    cand_first = statistics.median(c for c, _ in first)
    cand_last = statistics.median(c for c, _ in last)
    if cand_last - cand_first < GROWTH_MIN:
        return 1.0
    prim_first = max(statistics.median(p for _, p in first), 1.0)
    prim_last = max(statistics.median(p for _, p in last), 1.0)
    return (cand_last / max(cand_first, 1.0)) / (prim_last / prim_first)
