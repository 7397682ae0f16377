"""sample_unit: deterministic, uniform in [0, 1), never exactly 1."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, strategies as st

from policies.sample import is_sampled, sample_unit


def test_same_inputs_give_the_same_value() -> None:
    assert sample_unit("rule", "req-1") == sample_unit("rule", "req-1")


def test_salt_and_key_are_separated() -> None:
    assert sample_unit("ab", "c") != sample_unit("a", "bc")


def test_value_matches_the_documented_construction() -> None:
    digest = hashlib.blake2b(b"rule\0req-1", digest_size=8).digest()
    assert sample_unit("rule", "req-1") == (int.from_bytes(digest, "big") >> 11) / 2**53


def test_the_largest_53_bit_value_stays_below_one() -> None:
    # The float trap: a 64-bit fraction of all ones rounds to 1.0; 53 bits do not.
    assert ((2**64 - 1) / 2**64) == 1.0
    assert ((2**53 - 1) / 2**53) < 1.0


@given(st.text(), st.text())
def test_value_is_in_the_unit_interval(salt: str, key: str) -> None:
    assert 0.0 <= sample_unit(salt, key) < 1.0


@given(st.text(max_size=20))
def test_ratio_edges_need_no_hash(key: str) -> None:
    assert is_sampled("r", key, 1.0) and not is_sampled("r", key, 0.0)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
def test_is_sampled_agrees_with_sample_unit(ratio: float) -> None:
    for i in range(1000):
        assert is_sampled("r", str(i), ratio) is (sample_unit("r", str(i)) < ratio)
