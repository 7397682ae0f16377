"""One sampler: the policy's rules and the token tap's shares draw with core.sample."""

from __future__ import annotations

from core.sample import is_sampled, sample_unit
from evidence.tokens import selected
from policies import sample as policy_sample


def test_the_policy_and_the_token_tap_draw_with_the_same_function() -> None:
    assert policy_sample.sample_unit is sample_unit
    assert policy_sample.is_sampled is is_sampled
    ids = [f"ex-{i}" for i in range(2000)]
    for share in (0.0, 0.3, 1.0):
        tokens = {i for i in ids if selected(i, share)}
        assert tokens == {i for i in ids if is_sampled("tap/cf-share", i, share)}
    assert {i for i in ids if selected(i, 0.0)} == set()
    assert {i for i in ids if selected(i, 1.0)} == set(ids)


def test_the_token_and_likelihood_shares_are_drawn_independently() -> None:
    ids = [f"ex-{i}" for i in range(4000)]
    cf = {i for i in ids if selected(i, 0.5)}
    lk = {i for i in ids if selected(i, 0.5, salt="tap/lk-share")}
    assert 1800 < len(cf) < 2200 and 1800 < len(lk) < 2200
    assert 800 < len(cf & lk) < 1200  # independent halves overlap in about a quarter
