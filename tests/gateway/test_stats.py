"""Percentiles: one definition (numpy's default linear interpolation) for the whole project."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, strategies as st

from core.stats import mean, percentile, percentile_sorted, percentiles


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
