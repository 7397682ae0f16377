"""Report analysis on synthetic records with known truth: speedup CIs contain the true ratio,
verdicts follow speed and quality, the gate and the checklist use the measured numbers."""

from __future__ import annotations

import math

import pytest

from loadgen.speedup import paired_speedup, samples_needed
from report.analysis import ALL, Analysis, CandidateAnalysis, analyze, bucket_order, wilson
from tests.report.synthetic import records


def only(a: Analysis) -> CandidateAnalysis:
    (c,) = a.candidates.values()
    return c


@pytest.mark.parametrize("true_speedup", [0.8, 1.25, 1.6])
def test_the_e2e_speedup_ci_contains_the_true_ratio(true_speedup):
    a = analyze(records(speedups={"chat": true_speedup}, n=80, seed=11))
    s = only(a).speedups["chat"].e2e
    assert s is not None and s.n == 80
    assert s.ci_low <= true_speedup <= s.ci_high
    assert s.ci_high - s.ci_low < 0.15 * true_speedup  # and it is informative
    base = only(a).speedups["chat"].baseline_e2e
    assert base is not None and base.ci_low <= 1.0 <= base.ci_high * 1.02  # noise sits at 1


def test_the_bootstrap_is_seeded_and_drops_unusable_pairs():
    pairs = [(2.0, 1.0), (4.0, 2.0), (3.0, 1.5), (None, 1.0), (1.0, 0.0), (1.0, None)]
    a, b = paired_speedup(pairs), paired_speedup(pairs)
    assert a == b and a is not None and a.n == 3 and a.point == pytest.approx(2.0)
    assert paired_speedup([(1.0, 1.0)]) is None


def test_samples_needed_shrinks_the_ci_below_the_effect():
    wide = paired_speedup([(1.1, 1.0), (0.95, 1.0), (1.2, 1.0), (0.9, 1.0), (1.15, 1.0)])
    assert wide is not None and wide.ci_low < 1.0 < wide.ci_high
    needed = samples_needed(wide)
    assert needed is not None and needed > wide.n
    flat = paired_speedup([(1.0, 1.0), (1.0, 1.0)])
    assert flat is not None and samples_needed(flat) is None


def test_verdicts_follow_speed_quality_and_sample_size():
    recs = records(
        speedups={"chat": 1.5, "json": 1.5, "slow": 0.8, "flat": 1.0},
        n=60, noise=0.01, candidate_divergence={"json": 0.4}, seed=5,
    ) + records(speedups={"rare": 1.4}, n=5, seed=6)  # fmt: skip
    a = analyze(recs)
    verdict = {v.category: v for v in only(a).verdicts}
    assert verdict["chat"].decision == "adopt"
    assert verdict["json"].decision == "do_not_adopt" and "diverges" in verdict["json"].reasons[0]
    assert verdict["slow"].decision == "do_not_adopt" and "slower" in verdict["slow"].reasons[-1]
    assert (
        verdict["flat"].decision == "do_not_adopt"
        and "no material gain" in verdict["flat"].reasons[-1]
    )
    assert verdict["rare"].decision == "not_enough_data" and verdict["rare"].pairs_needed == 10
    assert only(a).quality["json"].worse_than_noise and not only(a).quality["chat"].worse_than_noise
    assert ALL in verdict


def test_an_uncertain_speedup_asks_for_a_sample_size():
    a = analyze(records(speedups={"chat": 1.04}, n=12, noise=0.25, seed=2))
    v = only(a).verdicts[0]
    assert v.decision == "not_enough_data"
    assert v.pairs_needed is not None and v.pairs_needed > 12
    assert any(f"Before deciding chat: shadow about {v.pairs_needed}" in i for i in a.checklist)


def test_the_gate_measures_the_share_of_e2e_spent_generating():
    a = analyze(records(speedups={"chat": 1.5}, n=20, ttft_s=0.05))
    assert a.gate["chat"] is not None and a.gate["chat"] > 0.9
    slow_start = analyze(records(speedups={"chat": 1.5}, n=20, ttft_s=10.0))
    assert slow_start.gate_overall is not None and slow_start.gate_overall < 0.5


def test_rollback_triggers_come_from_the_adopted_categories_numbers():
    a = analyze(records(speedups={"chat": 1.5, "slow": 0.8}, n=40, seed=4))
    c_tpot = a.latency[("candidate", "chat")]["tpot_s"][2]
    p_tpot = a.latency[("primary", "chat")]["tpot_s"][2]
    assert c_tpot is not None and p_tpot is not None
    # The guard rollout.yaml carries: 1.25 × the measured ratio, within [1.0, 1.5] (issue 36).
    ratio = round(min(1.5, max(1.0, 1.25 * c_tpot / p_tpot)), 2)
    text = "\n".join(a.checklist)
    assert a.checklist[0] == "Enable speculative decoding for: chat — ship candidate-backend."
    assert (
        f"Roll back chat if candidate p99 tpot > {ratio}× the primary's p99 = "
        f"{ratio * p_tpot * 1e3:.1f} ms" in text
    )
    assert "Roll back chat if its divergence rate exceeds the noise floor" in text
    assert "slow" not in a.checklist[0]


def test_acceptance_is_grouped_by_category_output_length_and_concurrency():
    a = analyze(records(speedups={"chat": 1.5, "code": 1.2}, n=30))
    assert set(only(a).acceptance.category) == {"chat", "code"}
    assert set(only(a).acceptance.output_length) <= {"<64", "64-256"}
    assert set(only(a).acceptance.concurrency) == {"1", "2-4"}
    chat = only(a).acceptance.category["chat"]
    assert len(chat.tokens_per_event) == 30 and min(chat.tokens_per_event) > 2
    assert a.resources["candidate-backend"].peak == pytest.approx(0.45)


def test_failed_legs_count_as_errors_and_leave_the_timings():
    recs = records(speedups={"chat": 1.5}, n=12)
    recs[0]["legs"][1] |= {"status": 503, "outcome": "upstream_status", "e2e_s": 99.0}
    a = analyze(recs)
    assert a.errors[("candidate", "chat")].k == 1
    assert only(a).speedups["chat"].e2e.n == 11  # type: ignore[union-attr]
    assert (a.latency[("candidate", "chat")]["e2e_s"][2] or 0.0) < 99.0


def test_no_records_means_no_verdicts():
    a = analyze([], [{"schema": "specshadow.matrix/1", "backend": "b", "bucket": "s",
                      "concurrency": 1, "stable": True}])  # fmt: skip
    assert (
        a.candidates == {}
        and a.checklist == []
        and a.stable_regions == ["b × s: speedup CI > 1 at concurrency 1"]
    )


def test_helpers_wilson_and_bucket_order():
    lo, hi = wilson(5, 10) or (0, 0)
    assert lo < 0.5 < hi and wilson(0, 0) is None
    labels = [">=1024", "64-256", "<64", "256-1024", "2-4", "1", "x"]
    assert sorted(labels, key=bucket_order) == [
        "1",
        "2-4",
        "<64",
        "64-256",
        "256-1024",
        ">=1024",
        "x",
    ]
    assert math.isinf(bucket_order("x")[0])


def test_requests_that_skip_speculation_leave_the_speedup_and_are_counted() -> None:
    """vLLM decodes penalty / min_p requests plainly: they are slow on the candidate for a
    reason that is not speculation's, and must not drag its speed-up down."""
    fast = records(speedups={"chat": 1.5}, n=60, noise=0.01, seed=11)
    slow = records(speedups={"chat": 0.5}, n=60, noise=0.01, seed=12)
    skipped = [
        {**r, "exchange_id": f"skip-{i}", "speculation_skip": "penalty"} for i, r in enumerate(slow)
    ]
    a = analyze(fast + skipped)
    c = only(a)
    (v,) = [v for v in c.verdicts if v.category == "chat"]
    assert v.e2e is not None and v.e2e.point > 1.3, v.e2e
    assert c.exclusions["chat"]["speculation skipped by the engine (penalty): quality only"] == 60
    mixed = only(analyze(fast + slow))
    (w,) = [v for v in mixed.verdicts if v.category == "chat"]
    assert w.e2e is not None and w.e2e.point < v.e2e.point  # the same records, counted: slower


def test_report_json_carries_a_quality_object_beside_every_verdict() -> None:
    from report.export import report_json

    js = report_json(analyze(records(speedups={"chat": 1.5, "code": 1.2}, n=30, seed=13)))
    for obj in (js["overall"], *js["categories"].values()):
        q = obj["quality"]
        assert q["verdict"] in ("equivalent", "not_equivalent", "not_enough_data")
        assert {"decided_by", "n", "needed", "metrics", "mmd"} <= set(q)
    (cand,) = js["candidates"].values()
    assert cand["overall"]["quality"]["verdict"] == js["overall"]["quality"]["verdict"]


def test_the_analysis_is_built_whole_and_frozen():
    import dataclasses

    a = analyze(records(speedups={"chat": 1.5}, n=12))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.counterfactual = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        only(a).verdicts = []  # type: ignore[misc]
