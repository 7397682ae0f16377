"""Small, generic summary statistics shared by the recorder, ``loadgen`` and the report (pure).

One percentile definition for the whole project: linear interpolation between closest ranks,
the same as numpy's default (``method="linear"``) and ``statistics.quantiles(method="inclusive")``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "RatioStats",
    "interpolate",
    "mean",
    "paired_ratio_test",
    "percentile",
    "percentile_ranks",
    "percentile_sorted",
    "percentiles",
    "t_quantile",
    "wilson",
]


def percentile_sorted(sorted_values: Sequence[float], q: float) -> float | None:
    """Percentile ``q`` (0–100) of values already sorted ascending; ``None`` when empty.

    Raises:
        ValueError: ``q`` is outside [0, 100] or NaN.
    """
    if not 0.0 <= q <= 100.0:  # also rejects NaN
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    n = len(sorted_values)
    if n == 0:
        return None
    lo, hi = percentile_ranks(n, q)
    return interpolate(n, q, float(sorted_values[lo]), float(sorted_values[hi]))


def percentile_ranks(n: int, q: float) -> tuple[int, int]:
    """The two 0-based ranks percentile ``q`` of ``n`` sorted values interpolates between (what
    an engine must fetch to give the same percentile: ``arraySort(groupArray(x))[rank + 1]``)."""
    lo = math.floor((n - 1) * q / 100.0)
    return lo, min(lo + 1, n - 1)


def interpolate(n: int, q: float, low: float, high: float) -> float:
    """Percentile ``q`` of ``n`` values from the values at :func:`percentile_ranks`."""
    lo, hi = percentile_ranks(n, q)
    frac = (n - 1) * q / 100.0 - lo
    if frac == 0.0 or hi == lo:
        return low
    return low + (high - low) * frac


def percentile(values: Iterable[float], q: float) -> float | None:
    """Percentile ``q`` (0–100) with linear interpolation (numpy's default); ``None`` when empty."""
    return percentile_sorted(sorted(values), q)


def percentiles(values: Iterable[float], qs: Sequence[float]) -> tuple[float | None, ...]:
    """Several percentiles of the same values, sorting once."""
    ordered = sorted(values)
    return tuple(percentile_sorted(ordered, q) for q in qs)


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean; ``None`` when empty."""
    return math.fsum(values) / len(values) if values else None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval for ``k`` successes in ``n`` trials; ``None`` when n = 0."""
    if n == 0:
        return None
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


Z95 = 1.959963984540054


@dataclass(slots=True)
class RatioStats:
    """Σy / Σx over units (requests, say), with a delta-method interval; only sums are kept.

    ``Var(R) ≈ n Σ(yᵢ − R xᵢ)² / ((n − 1) (Σxᵢ)²)``: the ratio-of-means estimator's variance with
    the unit as the independent draw (what a ratio of pooled counts needs when a unit's own
    events are correlated). Coverage measured in ``tests/counterfactual/test_matrix.py``."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.syy += y * y
        self.sxy += x * y

    def estimate(self) -> float | None:
        return self.sy / self.sx if self.sx > 0 else None

    def interval(self, z: float = Z95) -> tuple[float, float] | None:
        r = self.estimate()
        if r is None or self.n < 2:
            return None
        resid = max(self.syy - 2 * r * self.sxy + r * r * self.sxx, 0.0)  # Σ(y − r·x)²
        se = math.sqrt(resid / (self.n - 1) * self.n) / self.sx
        return r - z * se, r + z * se


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Hill's 1970 expansion; exact enough for df ≥ 3)."""
    z = NormalDist().inv_cdf(p)
    if df <= 0:
        return math.inf
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def paired_ratio_test(
    pairs: Sequence[tuple[float, float, float, float]],
    *,
    rounds: int = 2000,
    exact_max: int = 1000,
    seed: int = 0,
) -> float | None:
    """Two-sided p-value for "two ratios of sums over the same units are equal", each unit
    measured once under A and once under B: ``(x_a, y_a, x_b, y_b)``, the ratio ``Σy / Σx``.

    A sign-flip permutation test: under the null hypothesis that each unit's two measurements are
    exchangeable (independent draws of one process, say), swapping them leaves the law of the
    difference ``Σy_a/Σx_a − Σy_b/Σx_b`` unchanged, so the observed difference is ranked among
    ``rounds`` random swaps (seeded: the same answer on every run). No variance is estimated, so it
    keeps its level where a delta-method interval does not: few units, most of them zero, a few
    large. Above ``exact_max`` units that change anything when swapped it uses the swaps' normal
    limit (the linearised difference's variance under random signs). None without a denominator.
    """
    sxa = sum(p[0] for p in pairs)
    sya = sum(p[1] for p in pairs)
    sxb = sum(p[2] for p in pairs)
    syb = sum(p[3] for p in pairs)
    if sxa <= 0 or sxb <= 0:
        return None

    def diff(xa: float, ya: float, xb: float, yb: float) -> float:
        return (ya / xa if xa > 0 else 0.0) - (yb / xb if xb > 0 else 0.0)

    observed = abs(diff(sxa, sya, sxb, syb))
    active = [(p[0] - p[2], p[1] - p[3]) for p in pairs if p[0] != p[2] or p[1] != p[3]]
    if not active or observed == 0.0:
        return 1.0
    if len(active) > exact_max:
        mx = (sxa + sxb) / 2
        r0 = (sya + syb) / (sxa + sxb)
        sd = math.sqrt(sum((dy - r0 * dx) ** 2 for dx, dy in active)) / mx
        return 2.0 * (1.0 - NormalDist().cdf(observed / sd)) if sd > 0 else 0.0
    rng = random.Random(seed)
    tol = observed * 1e-9  # equal differences computed in another order count as ties
    hits = 0
    for _ in range(rounds):
        bits = rng.getrandbits(len(active))
        fx = fy = 0.0
        for dx, dy in active:
            if bits & 1:  # this unit's two measurements swap sides
                fx += dx
                fy += dy
            bits >>= 1
        if abs(diff(sxa - fx, sya - fy, sxb + fx, syb + fy)) >= observed - tol:
            hits += 1
    return (hits + 1) / (rounds + 1)
