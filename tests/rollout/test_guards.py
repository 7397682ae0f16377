"""The guards' sequential tests on streams with known content: the e-process against independent
arithmetic, the spending schedule, each guard's regression, ``needs`` as a published bound, the
sampled guard without a baseline leg; the rollout state file's atomicity and its damaged-file
behaviour. (Rates of false rollbacks and detection delays: test_guards_anytime.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from core.evidence import LegQuality
from evidence.quality import sketch
from policies.compiled import GuardSpec
from rollout.guards import GuardBank, Observation, evaluate
from rollout.sequential import BET_FRACTION, BET_MEMORIES, SequentialTest, spending
from rollout.state import RuleState, Transition, load_state, save_state


def obs(**kw: object) -> Observation:
    base = {
        "served_by": "primary", "candidate_ok": True, "primary_ok": True, "candidate_e2e": 1.0,
        "candidate_tpot": 0.01, "primary_e2e": 1.0, "primary_tpot": 0.01,
        "candidate_tokens_per_event": 2.5, "diverged": False, "baseline_diverged": False,
        "acceptance": 2.5, "acceptance_exact": True, "drafted": 8, "accepted": 6,
        "output_tokens": 32,
    }  # fmt: skip
    return Observation(**{**base, **kw})  # type: ignore[arg-type]


SPEC = GuardSpec(min_samples=10, window=60, confidence=0.99)


def states(window: list[Observation], kv: tuple[float, ...] = ()) -> dict[str, str]:
    return {g.name: g.status for g in evaluate(SPEC, window, kv)}


def test_the_spending_schedule_sums_to_alpha() -> None:
    assert math.fsum(spending(0.01, j) for j in range(1, 200_000)) == pytest.approx(0.01, rel=1e-4)
    assert spending(0.01, 1) == 0.005 and spending(0.01, 3) == 0.01 / 12


def test_one_statistics_e_value_is_the_mixture_of_its_bettors_wealth() -> None:
    """Independent arithmetic: each bettor's aGRAPA stake from its own running moments."""
    xs = [0.5, -0.2, 0.9, 0.9, -1.0, 0.3, 0.8, 0.8, 0.1, 0.7]
    test = SequentialTest(0.001, 1000, (-1.0,))
    wealth = []
    for memory in BET_MEMORIES:
        mean = var = 0.0
        w_total = 1.0
        for n, x in enumerate(xs):
            if mean > 0:
                w_total *= 1 + min(BET_FRACTION, mean / (var + mean * mean)) * x
            w = 1 / min(n + 2, memory)
            d = x - mean
            mean, var = mean + w * d, (1 - w) * (var + w * d * d)
        wealth.append(w_total)
    for x in xs:
        test.step((x,))
    e, threshold = test.evidence()
    assert e == pytest.approx(sum(wealth) / len(wealth), rel=1e-12)
    assert threshold == pytest.approx(1 / spending(0.001, 1))


def test_a_test_restarts_below_one_half_and_each_restart_raises_the_threshold() -> None:
    test = SequentialTest(0.01, 1000, (-1.0,))
    for _ in range(3):
        test.step((1.0,))  # the bettors learn a positive mean and stake
    before = test.started
    for _ in range(10):
        test.step((-1.0,))  # the stakes are lost
    assert test.started > before  # the wealth fell below ½: a fresh e-process
    assert test.evidence()[1] == pytest.approx(1 / spending(0.01, test.started))
    assert test.evidence()[1] > 1 / spending(0.01, before)


def test_evidence_older_than_the_window_that_stopped_growing_is_forgotten() -> None:
    test = SequentialTest(1e-4, 40, (-1.0,))
    for _ in range(12):
        test.step((1.0,))  # strong evidence, not enough for 1e-4
    e, _ = test.evidence()
    assert 2 < e < 1e4 and not test.rejected
    for _ in range(60):
        test.step((0.0,))  # flat: nothing new for the rest of the window
    assert test.started == 2 and test.evidence()[0] == 1.0


def test_a_rejection_is_final() -> None:
    test = SequentialTest(0.01, 50, (-1.0,))
    while not test.rejected:
        test.step((1.0,))
    for _ in range(100):
        test.step((-1.0,))
    assert test.rejected


def test_guards_wait_for_their_minimum_sample_then_hold() -> None:
    assert set(states([obs()] * 9).values()) == {"waiting", "unavailable"}  # kv: no scrapes
    healthy = states([obs()] * 60, kv=(0.4, 0.5, 0.5))
    assert healthy.pop("sampled_divergence") == "unavailable"  # greedy traffic only
    assert healthy == dict.fromkeys(healthy, "ok")


def test_each_guard_fires_on_its_own_regression() -> None:
    good = [obs()] * 40
    assert states(good + [obs(candidate_e2e=3.0)] * 40)["e2e_p99_ratio"] == "breach"
    assert states(good + [obs(candidate_tpot=0.05)] * 40)["tpot_p99_ratio"] == "breach"
    assert states(good + [obs(candidate_ok=False)] * 40)["error_rate_delta"] == "breach"
    assert states(good + [obs(diverged=True)] * 40)["divergence_rate"] == "breach"
    assert states(good + [obs(candidate_tokens_per_event=1.0)] * 150)["tokens_per_event"] == (
        "breach"
    )
    assert states(good, kv=(0.96, 0.97, 0.99))["kv_usage"] == "breach"
    assert states(good, kv=(0.99, 0.5, 0.99))["kv_usage"] == "ok"  # a spike is not sustained
    # Within the thresholds nothing fires, however long: 1.4× slower, 2 % more errors.
    fine = [obs(candidate_e2e=1.4, candidate_ok=i % 50 != 0) for i in range(1000)]
    assert states(fine)["e2e_p99_ratio"] == "ok" and states(fine)["error_rate_delta"] == "ok"


def test_divergence_is_judged_against_each_exchanges_noise_floor() -> None:
    noisy = [obs(diverged=i % 5 == 0, baseline_diverged=i % 5 == 0) for i in range(400)]
    assert states(noisy)["divergence_rate"] == "ok"  # 20 % both: no worse than a plain copy
    worse = [obs(diverged=i % 2 == 0, baseline_diverged=i % 5 == 0) for i in range(400)]
    assert states(worse)["divergence_rate"] == "breach"
    alone = [obs(diverged=i % 5 == 0, baseline_diverged=None) for i in range(400)]
    assert states(alone)["divergence_rate"] == "breach"  # no baseline: the floor is 0


def test_a_p99_guard_trips_on_exactly_needs_worst_case_pairs() -> None:
    """The published detection bound: ``needs`` pairs with the candidate past the threshold (and
    the primary not) trip the guard, one fewer does not."""
    spec = GuardSpec(min_samples=10, window=60, tpot_p99_ratio_max=None, tokens_per_event_min=None)
    good = [obs()] * 100
    (e2e,) = [g for g in evaluate(spec, good) if g.name == "e2e_p99_ratio"]
    assert e2e.needs is not None and 5 <= e2e.needs <= 40, e2e
    for bad in (e2e.needs - 1, e2e.needs):
        (g,) = [
            g
            for g in evaluate(spec, good + [obs(candidate_e2e=10.0)] * bad)
            if g.name == "e2e_p99_ratio"
        ]
        assert g.status == ("breach" if bad == e2e.needs else "ok"), bad
        if g.status == "breach":
            assert g.bound is not None and g.needs == 0


def quality(text: str) -> LegQuality:
    return LegQuality(
        len(text.split()), False, None, None, 0, False, None, 0, None, 0, None, sketch(text)
    )


def test_the_sampled_guard_needs_a_baseline_leg() -> None:
    spec = GuardSpec(min_samples=10, window=60)
    out = quality("a sampled answer that differs every time")
    without = [obs(sampled=True, diverged=None, candidate_output=out)] * 60
    (g,) = [g for g in evaluate(spec, without) if g.name == "sampled_divergence"]
    assert g.status == "unavailable" and "baseline leg" in g.detail
    greedy = [obs()] * 60
    (g,) = [g for g in evaluate(spec, greedy) if g.name == "sampled_divergence"]
    assert g.status == "unavailable" and "greedy" in g.detail


def test_the_sampled_guard_fires_when_the_candidate_says_something_else() -> None:
    words = ["the", "cache", "holds", "keys", "and", "values", "for", "every", "token", "of"]
    texts = [" ".join(words[i % 5 :] + words[: i % 5]) for i in range(10)]
    other = [" ".join(["spam"] * (8 + i % 3)) for i in range(10)]
    bank = GuardBank(GuardSpec(min_samples=10, window=200))
    for i in range(400):
        bank.update(
            obs(sampled=True, diverged=None, candidate_output=quality(other[i % 10]),
                baseline_output=quality(texts[(i * 7) % 10]))
        )  # fmt: skip
        if bank.breached():
            break
    assert bank.breached() == "sampled_divergence" and i < 200, i
    (g,) = [g for g in bank.states() if g.name == "sampled_divergence"]
    assert g.status == "breach" and g.value is not None and g.value > 0.1


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


def test_an_estimated_tpot_is_paired_only_within_its_own_exchange() -> None:
    """A stream without usage has an estimated count: its TPOT may meet the other leg of its own
    exchange (estimated alike, evidence.counts) but never a leg of another exchange."""
    from evidence.worker import build_evidence
    from rollout.guards import observe
    from tests.evidence.legs import exchange, leg

    words = tuple(f" word{i:02d}" for i in range(40))
    other = tuple(f" other{i:02d}" for i in range(30))
    served = exchange(  # a canary answer streamed without usage, the primary not mirrored
        primary=leg("candidate", words, backend="cand"), shadows=[]
    )
    alone = observe(build_evidence(served), "cand")
    assert alone is not None and alone.candidate_tpot is None
    counted = exchange(primary=leg("candidate", words, usage=40, backend="cand"), shadows=[])
    exact = observe(build_evidence(counted), "cand")
    assert exact is not None and exact.candidate_tpot is not None
    both = build_evidence(
        exchange(
            primary=leg("primary", words),
            shadows=[leg("candidate", other, usage=30, backend="cand")],
        )
    )
    paired = observe(both, "cand")
    assert paired is not None
    assert paired.candidate_tpot is not None and paired.primary_tpot is not None
