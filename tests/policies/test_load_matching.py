"""Load-matched mirroring and live sweeps: each leg's share is its backend's replicas over the
primary's, legs of smaller shares are nested in larger ones, and a sweep steps the shares through
multiples of the base share by requests or by time."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from policies import PolicyError, parse_policy
from policies.compiled import CompiledPolicy
from tests.policies.test_decide import facts

N = 20_000


def fleet(primary: int, candidate: int, baseline: int) -> dict[str, Any]:
    return {
        "prim": {"url": "http://127.0.0.1:9000", "kind": "vllm", "replicas": primary},
        "cand": {"url": "http://127.0.0.1:9001", "kind": "vllm", "replicas": candidate},
        "base": {"url": "http://127.0.0.1:9002", "kind": "sglang", "replicas": baseline},
    }


LEGS = [{"backend": "cand", "role": "candidate"}, {"backend": "base", "role": "baseline"}]


def policy(
    default: dict[str, Any], *, replicas: tuple[int, int, int] = (10, 1, 2)
) -> CompiledPolicy:
    raw = {"version": 1, "backends": fleet(*replicas), "primary": "prim", "default": default}
    return parse_policy(raw, source="test")


def sent(p: CompiledPolicy, n: int = N) -> Counter[str]:
    counts: Counter[str] = Counter()
    for i in range(n):
        counts.update(leg.backend.name for leg in p.decide(facts(request_id=f"r{i}")).legs)
    return counts


def test_load_matched_gives_each_leg_its_replicas_over_the_primarys() -> None:
    p = policy({"ratio": "load_matched", "legs": LEGS})
    assert p.default_rule is not None and p.default_rule.load_matched
    assert {leg.backend.name: leg.share for leg in p.default_rule.legs} == {
        "cand": 0.1,
        "base": 0.2,
    }
    counts = sent(p)
    assert abs(counts["cand"] / N - 0.1) < 0.01 and abs(counts["base"] / N - 0.2) < 0.012
    for i in range(2000):  # nested: a request that reaches the candidate reaches the baseline too
        names = {leg.backend.name for leg in p.decide(facts(request_id=f"r{i}")).legs}
        assert "cand" not in names or "base" in names


def test_a_shadow_fleet_at_least_as_large_as_production_gets_every_request() -> None:
    p = policy({"ratio": "load_matched", "legs": LEGS}, replicas=(1, 1, 3))
    decision = p.decide(facts())
    assert [leg.share for leg in decision.legs] == [1.0, 1.0]


def test_a_sweep_steps_the_share_by_requests_and_says_which_step() -> None:
    sweep = {"multiples": [0.5, 1, 2], "hold_requests": 4000}
    p = policy({"ratio": 0.2, "legs": LEGS[:1], "sweep": sweep})
    steps: list[list[int]] = [[], [], []]
    for i in range(12_000):
        decision = p.decide(facts(request_id=f"r{i}"))
        if decision.sweep_step is not None:
            steps[decision.sweep_step].append(len(decision.legs))
        else:
            steps[i // 4000].append(0)  # not sampled: counted in its step by position
    rates = [sum(s) / 4000 for s in steps]
    assert [round(r, 2) for r in rates] == pytest.approx([0.1, 0.2, 0.4], abs=0.02)
    shares = {
        leg.share for i in range(8000, 8200) for leg in p.decide(facts(request_id=f"s{i}")).legs
    }
    assert shares == {0.4}  # the last step holds once the sweep has run through


def test_a_timed_sweep_moves_on_after_its_hold_and_a_bare_list_holds_a_minute() -> None:
    p = policy({"ratio": 1.0, "legs": LEGS[:1], "sweep": {"multiples": [0.25, 1], "hold_s": 0.3}})
    first = {p.decide(facts(request_id=f"a{i}")).sweep_step for i in range(50)}
    time.sleep(0.35)
    later = {p.decide(facts(request_id=f"b{i}")).sweep_step for i in range(50)}
    assert first <= {0, None} and later == {1}
    bare = policy({"ratio": 0.5, "legs": LEGS[:1], "sweep": [0.5, 1.0]})
    assert bare.default_rule is not None and bare.default_rule.sweep is not None
    assert bare.default_rule.sweep.hold_ns == 60 * 10**9


@pytest.mark.parametrize(
    ("default", "message"),
    [
        ({"ratio": "matched", "legs": LEGS}, "default.ratio: must be a number between 0 and 1 or 'load_matched', got 'matched'"),
        ({"ratio": 0.5, "legs": LEGS, "sweep": {"multiples": []}}, "default.sweep.multiples: must list at least 1 item(s), got an empty list"),
        ({"ratio": 0.5, "legs": LEGS, "sweep": {"multiples": [1], "hold_s": 5, "hold_requests": 9}}, "default.sweep: give hold_s or hold_requests, not both"),
    ],
)  # fmt: skip
def test_bad_shares_and_sweeps_name_their_field(default: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy(default)
    assert message in str(info.value)


def test_replicas_must_be_positive_and_sglang_backends_are_scraped() -> None:
    raw = {
        "version": 1,
        "backends": {
            **fleet(1, 1, 1),
            "cand": {"url": "http://x:1", "kind": "vllm", "replicas": 0},
        },
    }
    with pytest.raises(PolicyError, match=r"backends\.cand\.replicas: must be >= 1, got 0"):
        parse_policy(raw, source="test")
    p = policy({"ratio": 1.0, "legs": LEGS})
    assert (
        p.backends["base"].kind == "sglang"
        and p.backends["base"].metrics_url == "http://127.0.0.1:9002/metrics"
    )
    assert p.backends["prim"].replicas == 10
