"""Quality equivalence on sampled traffic: paired two-sample tests and a TOST decision per
candidate × category (docs/quality.md has the method, its assumptions and its measured error
rates).

For one mirrored exchange the candidate's output and its **partner**'s — the baseline leg (a plain
copy of production), or the primary's output when the exchange has no baseline leg — are two
independent draws for the same prompt. If the candidate is lossless they are *exchangeable*:
swapping the two labels within an exchange changes nothing in distribution. Every test here uses
only that:

- **per-metric difference tests**: a paired sign-flip permutation test of the mean difference
  ``candidate − partner`` (for ratio metrics, of the log ratio of sums under label swaps); exact
  under exchangeability whatever the metric's distribution;
- **MMD** on the outputs themselves: the unbiased MMD² between the candidates' and the partners'
  sketches (a normalised character-4-gram spectrum kernel, :mod:`evidence.quality`), its p-value by
  within-exchange label swaps (``||Σ εᵢ dᵢ||²`` with ``dᵢ`` the exchange's sketch difference) —
  Gao, Liang & Guestrin, *Model Equality Testing* (ICLR 2025), with one draw per prompt;
- **Holm's correction** across the metrics and the MMD: an identical candidate is called
  ``not_equivalent`` with probability ≤ ``alpha`` per candidate × category.

The decision (two one-sided tests, TOST): **equivalent** when no test rejects and every metric
with data has its ``1 − 2α`` interval inside ``±margin``; **not_equivalent** when the MMD rejects or
a metric's test rejects with its interval reaching past the margin (the metric, its effect and
interval decide); else **not_enough_data**, with the exchanges still needed for the widest metric
to fit its margin at 80 % power if the true difference is zero. Intervals: paired rates by
Agresti & Min (2005: a half count added to each cell, which keeps an all-zero table honest — no
refusals in 60 exchanges does not prove a 1-point margin); means by Student's t; ratios by the
delta method (:class:`core.stats.RatioStats`).

Greedy exchanges keep the exact-match path (divergence against the baseline's noise floor,
:class:`report.sections.Quality`) and feed the same verdict: worse than the noise floor is
``not_equivalent`` (``decided_by: exact_match``).

Size: the tests, Holm's correction and the TOST decision they feed share one set of result types,
and collecting the pairs stays beside them because each test's exchangeability argument rests on how
a pair is formed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from core.quality import DEFAULT_ALPHA, DEFAULT_MARGINS, METRICS_BY_NAME, QUALITY_METRICS
from core.stats import RatioStats, t_quantile
from records.reader import Leg, LegQuality, Record
from report.records import ALL
from report.sections import Quality

QualityVerdict = Literal["equivalent", "not_equivalent", "not_enough_data"]
MIN_EXCHANGES = 20  # below this no verdict but not_enough_data (the tests' asymptotics)
PERMUTATIONS = 2000
MAX_PAIRS = 5000  # per group: the tests' sample (see _Pairs)
POWER = 0.8


@dataclass(frozen=True, slots=True)
class MetricTest:
    """One metric's paired comparison: the candidate's and the partner's values, their
    difference with its ``1 − 2α`` interval, the margin and the permutation p-value."""

    name: str
    n: int
    candidate: float
    baseline: float
    difference: float
    low: float
    high: float
    margin: float
    p_value: float
    sd: float  # per-exchange spread of the difference (what ``needed`` scales with)

    @property
    def inside(self) -> bool:
        return -self.margin < self.low and self.high < self.margin

    def text(self) -> str:
        m = METRICS_BY_NAME[self.name]
        scale, unit = {"pts": (100.0, " pts"), "%": (100.0, " %"), "": (1.0, "")}[m.unit]
        return (
            f"{m.label} {self.difference * scale:+.{1 if scale > 1 else 3}f}{unit} "
            f"[{self.low * scale:.{1 if scale > 1 else 3}f}, "
            f"{self.high * scale:.{1 if scale > 1 else 3}f}] (margin ±{self.margin * scale:g}"
            f"{unit}, n={self.n})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "baseline": self.baseline,
            "difference": self.difference,
            "low": self.low,
            "high": self.high,
            "margin": self.margin,
            "p_value": self.p_value,
            "n": self.n,
        }


@dataclass(frozen=True, slots=True)
class Mmd:
    statistic: float
    p_value: float
    n: int


@dataclass(frozen=True, slots=True)
class Equivalence:
    """The quality verdict of one candidate × category (see the module docstring)."""

    verdict: QualityVerdict
    decided_by: str | None
    n: int  # paired sampled exchanges
    needed: int | None  # more exchanges for the margins at 80 % power (not_enough_data)
    metrics: Mapping[str, MetricTest]
    mmd: Mmd | None
    partner: Literal["baseline", "primary"] | None
    alpha: float
    greedy_n: int = 0
    reasons: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        return "; ".join(self.reasons) if self.reasons else self.verdict

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "decided_by": self.decided_by,
            "n": self.n,
            "needed": self.needed,
            "metrics": {k: m.to_json() for k, m in self.metrics.items()},
            "mmd": None
            if self.mmd is None
            else {"statistic": self.mmd.statistic, "p_value": self.mmd.p_value, "n": self.mmd.n},
            "partner": self.partner,
            "alpha": self.alpha,
            "correction": "holm",
            "greedy_exchanges": self.greedy_n,
            "reasons": list(self.reasons),
        }


# --- the statistics -----------------------------------------------------------------------


def _signflip_p(d: np.ndarray, rng: np.random.Generator) -> float:
    """Two-sided p of |Σd| under random sign flips (exact null: d symmetric about 0)."""
    obs = abs(float(d.sum()))
    if obs == 0.0:
        return 1.0
    signs = rng.integers(0, 2, size=(PERMUTATIONS, d.size), dtype=np.int8) * 2 - 1
    perm = np.abs(signs @ d)
    return float((1 + np.count_nonzero(perm >= obs - 1e-12)) / (PERMUTATIONS + 1))


def _swap_ratio_p(c: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> float:
    """Two-sided p of |log(Σc/Σb)| under within-exchange label swaps."""
    if c.sum() <= 0 or b.sum() <= 0:
        return 1.0
    obs = abs(math.log(c.sum() / b.sum()))
    if obs == 0.0:
        return 1.0
    swap = rng.integers(0, 2, size=(PERMUTATIONS, c.size)).astype(bool)
    sc = np.where(swap, b, c).sum(axis=1)
    sb = np.where(swap, c, b).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        perm = np.abs(np.log(sc / sb))
    perm = np.nan_to_num(perm, nan=0.0, posinf=np.inf)
    return float((1 + np.count_nonzero(perm >= obs - 1e-12)) / (PERMUTATIONS + 1))


def mmd_test(diffs: np.ndarray, rng: np.random.Generator) -> Mmd | None:
    """Unbiased MMD² from per-exchange sketch differences ``dᵢ = φ(cᵢ) − φ(bᵢ)``, with the
    label-swap permutation p-value (one-sided: large MMD² rejects)."""
    n = diffs.shape[0]
    if n < 2:
        return None
    self_terms = float((diffs * diffs).sum())

    def stat(total: np.ndarray) -> np.ndarray:
        out: np.ndarray = (np.sum(total * total, axis=-1) - self_terms) / (n * (n - 1))
        return out

    obs = float(stat(diffs.sum(axis=0)))
    signs = (rng.integers(0, 2, size=(PERMUTATIONS, n), dtype=np.int8) * 2 - 1).astype(float)
    perm = stat(signs @ diffs)
    p = float((1 + np.count_nonzero(perm >= obs - 1e-12)) / (PERMUTATIONS + 1))
    return Mmd(statistic=obs, p_value=p, n=n)


def rate_test(
    name: str, c: np.ndarray, b: np.ndarray, margin: float, alpha: float, rng: np.random.Generator
) -> MetricTest:
    """Paired difference of two rates; Agresti–Min interval, sign-flip p-value."""
    n = c.size
    n10 = float(np.count_nonzero((c == 1) & (b == 0)))
    n01 = float(np.count_nonzero((c == 0) & (b == 1)))
    a10, a01, an = n10 + 0.5, n01 + 0.5, n + 2.0
    d_adj = (a10 - a01) / an
    var = max((a10 + a01) - (a10 - a01) ** 2 / an, 0.0) / an**2
    z = NormalDist().inv_cdf(1 - alpha)
    half = z * math.sqrt(var)
    return MetricTest(
        name=name,
        n=n,
        candidate=float(c.mean()),
        baseline=float(b.mean()),
        difference=(n10 - n01) / n,
        low=d_adj - half,
        high=d_adj + half,
        margin=margin,
        p_value=_signflip_p(c - b, rng),
        sd=math.sqrt((a10 + a01) / an),
    )


def mean_test(
    name: str, c: np.ndarray, b: np.ndarray, margin: float, alpha: float, rng: np.random.Generator
) -> MetricTest:
    """Paired difference of means; Student's t interval, sign-flip p-value."""
    d = c - b
    n = d.size
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else math.inf
    half = t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    return MetricTest(
        name=name,
        n=n,
        candidate=float(c.mean()),
        baseline=float(b.mean()),
        difference=mean,
        low=mean - half,
        high=mean + half,
        margin=margin,
        p_value=_signflip_p(d, rng),
        sd=sd,
    )


def ratio_test(
    name: str, c: np.ndarray, b: np.ndarray, margin: float, alpha: float, rng: np.random.Generator
) -> MetricTest | None:
    """Σc/Σb − 1 with the delta-method interval; label-swap p-value."""
    rs = RatioStats()
    for x, y in zip(b.tolist(), c.tolist(), strict=True):
        rs.add(x, y)
    r = rs.estimate()
    if r is None:
        return None
    z = NormalDist().inv_cdf(1 - alpha)
    ci = rs.interval(z)
    low, high = (ci[0] - 1, ci[1] - 1) if ci is not None else (-math.inf, math.inf)
    resid = c - r * b
    sd = float(resid.std(ddof=1) / b.mean()) if c.size > 1 and b.mean() > 0 else math.inf
    return MetricTest(
        name=name,
        n=c.size,
        candidate=float(c.mean()),
        baseline=float(b.mean()),
        difference=r - 1,
        low=low,
        high=high,
        margin=margin,
        p_value=_swap_ratio_p(c, b, rng),
        sd=sd,
    )


def holm(p_values: Mapping[str, float], alpha: float) -> set[str]:
    """The names Holm's step-down procedure rejects at family-wise level ``alpha``."""
    rejected: set[str] = set()
    ordered = sorted(p_values.items(), key=lambda kv: kv[1])
    m = len(ordered)
    for i, (name, p) in enumerate(ordered):
        if p > alpha / (m - i):
            break
        rejected.add(name)
    return rejected


def needed_for(test: MetricTest, alpha: float) -> int | None:
    """Exchanges for a ``1 − 2α`` interval to fit ``±margin`` at 80 % power, true difference 0."""
    if not math.isfinite(test.sd):
        return None
    z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(1 - (1 - POWER) / 2)
    return max(math.ceil((z * test.sd / test.margin) ** 2), MIN_EXCHANGES)


# --- from records -------------------------------------------------------------------------

Extract = Callable[[LegQuality, LegQuality], tuple[float, float] | None]


def _value(get: Callable[[LegQuality], float | None]) -> Extract:
    def pair(c: LegQuality, b: LegQuality) -> tuple[float, float] | None:
        x, y = get(c), get(b)
        return None if x is None or y is None else (x, y)

    return pair


def _flag(get: Callable[[LegQuality], bool | None]) -> Extract:
    def pair(c: LegQuality, b: LegQuality) -> tuple[float, float] | None:
        x, y = get(c), get(b)
        return None if x is None or y is None else (float(x), float(y))

    return pair


def _tool(c: LegQuality, b: LegQuality) -> tuple[float, float] | None:
    if not (c.tool_calls or b.tool_calls):
        return None
    return float(c.tool_valid is True), float(b.tool_valid is True)


def _cites(c: LegQuality, b: LegQuality) -> tuple[float, float] | None:
    return float(c.citations > 0), float(b.citations > 0)


EXTRACT: dict[str, Extract] = {
    "similarity": _value(lambda q: q.similarity),
    "length_ratio": _value(lambda q: q.units),
    "finish_length_rate": _flag(lambda q: q.finish_length),
    "distinct_2": _value(lambda q: q.distinct_2),
    "repetition": _value(lambda q: q.repetition),
    "longest_repeat_ratio": _value(lambda q: q.longest_repeat),
    "refusal_rate": _flag(lambda q: q.refusal),
    "json_valid_rate": _flag(lambda q: q.json_valid),
    "tool_valid_rate": _tool,
    "citation_rate": _cites,
}


Row = tuple[dict[str, tuple[float, float]], "np.ndarray | None"]
Partner = Literal["baseline", "primary"]


@dataclass(slots=True)
class _Pairs:
    """One group's paired exchanges: ``n`` seen, and a uniform sample of at most
    :data:`MAX_PAIRS` of them (reservoir sampling, seeded) that the tests run on — memory and the
    permutations stay bounded at any record count; a uniform sample keeps exchangeability, so the
    tests stay exact (their power is that of ``MAX_PAIRS`` exchanges)."""

    partner: Literal["baseline", "primary"] | None = None
    n: int = 0
    rows: list[Row] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def add(self, row: Row) -> None:
        self.n += 1
        if len(self.rows) < MAX_PAIRS:
            self.rows.append(row)
        else:
            j = self.rng.randrange(self.n)
            if j < MAX_PAIRS:
                self.rows[j] = row

    @property
    def values(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for row, _ in self.rows:
            for name, v in row.items():
                out.setdefault(name, []).append(v)
        return out

    @property
    def sketches(self) -> list[np.ndarray]:
        return [d for _, d in self.rows if d is not None]


def _pair(record: Record, backend: str | None) -> tuple[Leg, Leg, Partner] | None:
    """The candidate leg and its partner (the baseline, else the primary) of a sampled exchange
    where both completed with quality scalars."""
    if record.greedy:
        return None
    cand = record.candidate_leg(backend)
    partner_leg, partner = record.baseline, "baseline"
    if partner_leg is None or not partner_leg.ok:
        partner_leg, partner = record.primary, "primary"
    if cand is None or partner_leg is None or not cand.ok or not partner_leg.ok:
        return None
    if cand.quality is None or partner_leg.quality is None:
        return None
    return cand, partner_leg, partner  # type: ignore[return-value]


def collect(records: Sequence[Record], backend: str | None) -> dict[str, _Pairs]:
    """Per category (and ``all``): the paired metric values and sketch differences."""
    out: dict[str, _Pairs] = {}
    for r in records:
        got = _pair(r, backend)
        if got is None:
            continue
        c_leg, b_leg, partner = got
        c, b = c_leg.quality, b_leg.quality
        assert c is not None
        assert b is not None
        row: dict[str, tuple[float, float]] = {}
        for name, get in EXTRACT.items():
            if name == "similarity" and partner != "baseline":
                continue
            v = get(c, b)
            if v is not None:
                row[name] = v
        lc, lb = r.mean_logprob(c_leg.backend), r.mean_logprob(b_leg.backend)
        if lc is not None and lb is not None:
            row["loglik"] = (lc, lb)
        sk_c, sk_b = c.sketch, b.sketch
        diff = (
            np.asarray(sk_c, dtype=float) - np.asarray(sk_b, dtype=float)
            if sk_c is not None and sk_b is not None and len(sk_c) == len(sk_b)
            else None
        )
        for cat in (r.category, ALL):
            slot = out.setdefault(cat, _Pairs())
            # One partner kind per group: a baseline, once seen, is the partner for the group.
            if slot.partner == "baseline" and partner == "primary":
                continue
            if slot.partner == "primary" and partner == "baseline":
                slot.n, slot.rows = 0, []
            slot.partner = partner
            slot.add((row, diff))
    return out


def judge(
    pairs: _Pairs | None,
    greedy: Quality | None,
    *,
    margins: Mapping[str, float] = DEFAULT_MARGINS,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> Equivalence:
    """The verdict for one group (see the module docstring)."""
    rng = np.random.default_rng(seed)
    greedy_n = greedy.candidate_divergence.n if greedy is not None else 0
    greedy_worse = bool(greedy is not None and greedy.worse_than_noise)
    tests: dict[str, MetricTest] = {}
    mmd: Mmd | None = None
    n = pairs.n if pairs is not None else 0
    if pairs is not None and n >= 2:
        values = pairs.values
        for m in QUALITY_METRICS:
            vals = values.get(m.name)
            if not vals or len(vals) < 2:
                continue
            arr = np.asarray(vals, dtype=float)
            c, b = arr[:, 0], arr[:, 1]
            margin = margins.get(m.name, m.margin)
            t: MetricTest | None
            if m.kind == "rate":
                t = rate_test(m.name, c, b, margin, alpha, rng)
            elif m.kind == "mean":
                t = mean_test(m.name, c, b, margin, alpha, rng)
            else:
                t = ratio_test(m.name, c, b, margin, alpha, rng)
            if t is not None:
                tests[m.name] = t
        if len(pairs.sketches) >= 2:
            mmd = mmd_test(np.stack(pairs.sketches), rng)
    partner = pairs.partner if pairs is not None else None

    def make(
        verdict: QualityVerdict, by: str | None, needed: int | None, *reasons: str
    ) -> Equivalence:
        return Equivalence(
            verdict, by, n, needed, tests, mmd, partner, alpha, greedy_n, tuple(reasons)
        )

    if greedy_worse:
        assert greedy is not None
        cand, floor = greedy.candidate_divergence.value or 0.0, greedy.baseline_divergence.value
        return make(
            "not_equivalent",
            "exact_match",
            None,
            f"greedy outputs: the candidate diverges from the primary in {cand:.1%} of {greedy_n}; "
            "noise floor " + (f"{floor:.1%}" if floor is not None else "unknown (no baseline)"),
        )
    p_values = {name: t.p_value for name, t in tests.items()}
    if mmd is not None:
        p_values["mmd"] = mmd.p_value
    rejected = holm(p_values, alpha) if n >= MIN_EXCHANGES else set()
    if "mmd" in rejected:
        assert mmd is not None
        worst = [tests[k] for k in sorted(rejected - {"mmd"}) if not tests[k].inside]
        return make(
            "not_equivalent",
            "mmd",
            None,
            f"outputs differ in distribution from the {partner}'s: MMD² {mmd.statistic:.4f}, "
            f"p = {mmd.p_value:.4f} (n={mmd.n})",
            *(t.text() for t in worst),
        )
    beyond = [tests[k] for k in rejected if k in tests and not tests[k].inside]
    if beyond:
        worst_t = min(beyond, key=lambda t: t.p_value)
        return make(
            "not_equivalent", worst_t.name, None, *(t.text() for t in sorted(beyond, key=_by_p))
        )
    if n == 0:
        if greedy_n >= MIN_EXCHANGES:
            return make(
                "equivalent",
                "exact_match",
                None,
                f"greedy outputs within the noise floor over {greedy_n} exchanges",
            )
        have = max(n, greedy_n)
        return make(
            "not_enough_data",
            None,
            MIN_EXCHANGES - have,
            f"{have} comparable exchanges; at least {MIN_EXCHANGES} needed",
        )
    outside = [t for t in tests.values() if not t.inside]
    if n >= MIN_EXCHANGES and not outside and tests:
        return make(
            "equivalent",
            "tost",
            None,
            f"every metric within its margin over {n} sampled exchanges"
            + (f" (MMD p = {mmd.p_value:.2f})" if mmd is not None else ""),
        )
    needs = {t.name: needed_for(t, alpha) for t in outside}
    known = {k: v for k, v in needs.items() if v is not None}
    by = max(known, key=lambda k: known[k]) if known else None
    total = max([MIN_EXCHANGES, *known.values()])
    needed = max(total - n, 1)
    reasons = [f"{n} sampled exchanges; about {needed} more needed"]
    if by is not None:
        reasons.append(f"widest: {tests[by].text()}")
    return make("not_enough_data", by, needed, *reasons)


def _by_p(t: MetricTest) -> float:
    return t.p_value


def equivalence(
    records: Sequence[Record],
    backend: str | None,
    greedy: Mapping[str, Quality],
    *,
    margins: Mapping[str, float] = DEFAULT_MARGINS,
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, Equivalence]:
    """Per category and ``all``: the candidate's quality verdict."""
    pairs = collect(records, backend)
    cats = set(pairs) | set(greedy)
    return {
        cat: judge(pairs.get(cat), greedy.get(cat), margins=margins, alpha=alpha, seed=i)
        for i, cat in enumerate(sorted(cats))
    }
