"""The guards' statistics against independent arithmetic, and their states on windows with known
content; the rollout state file's atomicity and its damaged-file behaviour."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

import pytest

from gateway.guards import Observation, evaluate, quantile_lower_rank, wilson_lower
from gateway.rollout_state import RuleState, Transition, load_state, save_state
from policies.compiled import GuardSpec


def binomial_tail(n: int, q: float, r: int) -> float:
    return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(r, n + 1))


@pytest.mark.parametrize("n", [20, 60, 200])
def test_the_p99_lower_bound_rank_is_the_largest_with_enough_coverage(n: int) -> None:
    r = quantile_lower_rank(n, 0.99, 0.99)
    assert binomial_tail(n, 0.99, r) >= 0.99
    assert r == n or binomial_tail(n, 0.99, r + 1) < 0.99


def test_wilson_lower_bound_at_the_edges() -> None:
    z = NormalDist().inv_cdf(0.99)
    assert wilson_lower(0, 20, z) == 0.0
    assert wilson_lower(20, 20, z) == pytest.approx(20 / (20 + z * z))  # p = 1: n / (n + z²)


def obs(**kw: object) -> Observation:
    base = {
        "served_by": "primary", "candidate_ok": True, "primary_ok": True, "candidate_e2e": 1.0,
        "candidate_tpot": 0.01, "primary_e2e": 1.0, "primary_tpot": 0.01,
        "candidate_tokens_per_event": 2.5, "diverged": False, "baseline_diverged": False,
    }  # fmt: skip
    return Observation(**{**base, **kw})  # type: ignore[arg-type]


SPEC = GuardSpec(min_samples=10, window=60, confidence=0.99)


def states(window: list[Observation], kv: tuple[float, ...] = ()) -> dict[str, str]:
    return {g.name: g.status for g in evaluate(SPEC, window, kv)}


def test_guards_wait_for_their_minimum_sample_then_hold() -> None:
    assert set(states([obs()] * 9).values()) == {"waiting", "unavailable"}  # kv: no scrapes
    healthy = states([obs()] * 30, kv=(0.4, 0.5, 0.5))
    assert healthy == dict.fromkeys(healthy, "ok")


def test_each_guard_fires_on_its_own_regression() -> None:
    good = [obs()] * 40
    assert states(good + [obs(candidate_e2e=3.0)] * 20)["e2e_p99_ratio"] == "breach"
    assert states(good + [obs(candidate_tpot=0.05)] * 20)["tpot_p99_ratio"] == "breach"
    assert states(good + [obs(candidate_ok=False)] * 10)["error_rate_delta"] == "breach"
    assert states(good + [obs(diverged=True)] * 10)["divergence_rate"] == "breach"
    assert states([obs(candidate_tokens_per_event=1.0)] * 30)["tokens_per_event"] == "breach"
    assert states(good, kv=(0.96, 0.97, 0.99))["kv_usage"] == "breach"
    assert states(good, kv=(0.99, 0.5, 0.99))["kv_usage"] == "ok"  # a spike is not sustained


def test_divergence_is_judged_against_the_noise_floor() -> None:
    noisy = [obs(diverged=i % 5 == 0, baseline_diverged=i % 5 == 0) for i in range(60)]
    assert states(noisy)["divergence_rate"] == "ok"  # 20 % both: no worse than two plain copies
    worse = [obs(diverged=i % 2 == 0, baseline_diverged=i % 5 == 0) for i in range(60)]
    assert states(worse)["divergence_rate"] == "breach"


def test_a_p99_guard_trips_on_exactly_needs_bad_observations() -> None:
    """The published detection bound: at a full window, ``needs`` uniformly bad observations
    trip the guard and one fewer does not."""
    spec = GuardSpec(min_samples=10, window=60, tpot_p99_ratio_max=None, tokens_per_event_min=None)
    good = [obs()] * 60
    (e2e,) = [g for g in evaluate(spec, good) if g.name == "e2e_p99_ratio"]
    assert e2e.needs is not None
    for bad in (e2e.needs - 1, e2e.needs):
        window = good[bad:] + [obs(candidate_e2e=10.0)] * bad
        (g,) = [g for g in evaluate(spec, window) if g.name == "e2e_p99_ratio"]
        assert g.status == ("breach" if bad == e2e.needs else "ok"), bad


def test_the_state_file_round_trips_and_a_damaged_one_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "state" / "rollout.json"
    t = Transition("code", "canary", "shadow", 0.0, 1.0, "guard", "guard x", "e2e_p99_ratio", "ex1")
    states_in = {"code": RuleState("shadow", "abc", None, True, 1.0, 0, t)}
    save_state(path, states_in)
    assert load_state(path) == states_in
    assert [p.name for p in path.parent.iterdir()] == ["rollout.json"]  # no temporary left
    path.write_text("{not json")
    assert load_state(path) == {}
    assert load_state(None) == {} and load_state(tmp_path / "absent.json") == {}
