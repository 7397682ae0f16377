"""Paired speedups with bootstrap confidence intervals (pure; numpy).

A speedup compares the same requests on two configurations: per pair ``ratio = reference /
candidate`` (e.g. primary e2e / candidate e2e — above 1 means the candidate is faster). The point
estimate is the geometric mean of the ratios (the mean of log ratios, so 2× faster and 2× slower
cancel); the 95 % interval is the percentile bootstrap of that mean over pairs, seeded, so a report
is reproducible. Pairs with a missing or non-positive value on either side are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Speedup", "paired_speedup", "samples_needed"]

MIN_PAIRS = 2


@dataclass(frozen=True, slots=True)
class Speedup:
    """Geometric-mean ratio reference/candidate with a bootstrap CI; ``n`` pairs used."""

    point: float
    ci_low: float
    ci_high: float
    n: int
    median: float
    confidence: float = 0.95

    @property
    def significant_gain(self) -> bool:
        return self.ci_low > 1.0

    @property
    def significant_loss(self) -> bool:
        return self.ci_high < 1.0


def _pairs(pairs: Iterable[tuple[float | None, float | None]]) -> np.ndarray:
    logs = [
        math.log(a / b)
        for a, b in pairs
        if a is not None and b is not None and a > 0 and b > 0 and math.isfinite(a / b)
    ]
    return np.asarray(logs, dtype=float)


def paired_speedup(
    pairs: Iterable[tuple[float | None, float | None]],
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Speedup | None:
    """``pairs`` of (reference, candidate) values of one metric; ``None`` with < 2 usable pairs."""
    logs = _pairs(pairs)
    n = len(logs)
    if n < MIN_PAIRS:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    boot = logs[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(boot, [alpha, 1.0 - alpha])
    return Speedup(
        point=math.exp(float(logs.mean())),
        ci_low=math.exp(float(lo)),
        ci_high=math.exp(float(hi)),
        n=n,
        median=math.exp(float(np.median(logs))),
        confidence=confidence,
    )


def samples_needed(speedup: Speedup, *, margin: float = 1.2, cap: int = 1_000_000) -> int | None:
    """Pairs needed for the CI to exclude 1 at the measured effect (CI width shrinks as 1/√n).

    ``None`` when the measured effect is zero (no finite sample would show it); at most ``cap``.
    """
    return pairs_needed(
        speedup.point, speedup.ci_low, speedup.ci_high, speedup.n, margin=margin, cap=cap
    )


def pairs_needed(
    point: float, low: float, high: float, n: int, *, margin: float = 1.2, cap: int = 1_000_000
) -> int | None:
    """:func:`samples_needed` for any ratio estimate with a CI from ``n`` pairs."""
    effect = abs(math.log(point))
    half_width = (math.log(high) - math.log(low)) / 2.0
    if effect < 1e-9:
        return None
    if half_width < effect:
        return n
    return min(cap, math.ceil(n * (half_width / effect) ** 2 * margin))
