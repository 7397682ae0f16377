"""Percentiles: one definition (numpy's default linear interpolation) for the whole project; the
paired ratio test's level and power on known truth."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, strategies as st

from core.stats import mean, paired_ratio_test, percentile, percentile_sorted, percentiles


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        # Hand-computed: rank = (n - 1) * q / 100, interpolate between the neighbours.
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # rank 1.5
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([10.0, 20.0, 30.0, 40.0, 50.0], 90, 46.0),  # rank 3.6 → 40 + 0.6 * 10
        ([15.0, 20.0, 35.0, 40.0, 50.0], 40, 29.0),  # rank 1.6 → 20 + 0.6 * 15
        ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
        ([7.0], 99, 7.0),
        ([0.0, 100.0], 99, 99.0),
    ],
)
def test_percentile_interpolates_linearly_between_ranks(
    values: list[float], q: float, expected: float
) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == (None, None)


@pytest.mark.parametrize("q", [-1, 100.5, float("nan")])
def test_percentile_outside_zero_to_hundred_is_rejected(q: float) -> None:
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0], q)


@given(st.lists(st.integers(-(10**9), 10**9), min_size=2, max_size=50))
def test_percentile_matches_statistics_quantiles_inclusive(values: list[int]) -> None:
    reference = statistics.quantiles(values, n=100, method="inclusive")  # q = 1..99
    ordered = sorted(values)
    for q in (1, 25, 50, 90, 99):
        assert percentile_sorted(ordered, q) == pytest.approx(reference[q - 1], rel=1e-12, abs=1e-6)


def test_percentiles_sorts_once_and_agrees_with_percentile() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentiles(values, (10, 50, 90)) == tuple(percentile(values, q) for q in (10, 50, 90))


def test_mean() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert mean([]) is None


def _zero_inflated_unit(rng: random.Random, ratio: float) -> tuple[float, float]:
    """One request's (drafts, accepted): most accept nothing, one in twelve a lot."""
    drafts = float(rng.randint(0, 5))
    if rng.random() < 1 / 12:
        drafts = float(rng.randint(10, 16))
        return drafts, float(sum(rng.random() < ratio for _ in range(int(drafts) * 3)))
    return drafts, float(rng.random() < 0.05)


def test_the_paired_ratio_test_keeps_its_level_where_intervals_do_not() -> None:
    """Both sides independent draws of one zero-inflated process, 48 units, 400 runs: the test's
    false alarms at α = 5 % stay within the binomial band around 5 % (sd 1.1 points), and its
    p-values are uniform enough that a tenth of them fall below 0.1."""
    rng = random.Random(3)
    ps = []
    for _ in range(400):
        pairs = [
            (*_zero_inflated_unit(rng, 0.6), *_zero_inflated_unit(rng, 0.6)) for _ in range(48)
        ]
        p = paired_ratio_test(pairs, rounds=500, seed=rng.randrange(1 << 30))
        assert p is not None
        ps.append(p)
    assert sum(p < 0.05 for p in ps) / len(ps) <= 0.085
    assert 0.06 <= sum(p < 0.1 for p in ps) / len(ps) <= 0.14


def test_the_paired_ratio_test_finds_a_real_difference_and_its_normal_limit_agrees() -> None:
    rng = random.Random(4)
    pairs = [(*_zero_inflated_unit(rng, 0.9), *_zero_inflated_unit(rng, 0.3)) for _ in range(300)]
    exact = paired_ratio_test(pairs, rounds=2000)
    normal = paired_ratio_test(pairs, exact_max=0)
    assert exact is not None and normal is not None
    assert exact < 0.01 and normal < 0.01
    same = [(x, y, x, y) for x, y, _, _ in pairs]
    assert paired_ratio_test(same) == 1.0  # nothing to tell apart
    assert paired_ratio_test([(0.0, 0.0, 1.0, 0.0)]) is None  # one side has no denominator
    # Moderate difference: the swaps' normal limit and the Monte Carlo p agree to a few points.
    mild = [(*_zero_inflated_unit(rng, 0.6), *_zero_inflated_unit(rng, 0.45)) for _ in range(600)]
    a, b = paired_ratio_test(mild, rounds=4000), paired_ratio_test(mild, exact_max=0)
    assert a is not None and b is not None and abs(a - b) < 0.05, (a, b)
