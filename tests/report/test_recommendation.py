"""Several candidates on the same requests: each judged on its own, compared head to head with
paired CIs, and one configuration recommended per category by the stated rule — on synthetic
records with known truth (the gateway-driven case is in test_candidates.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from policies.compile import parse_policy
from policies.parse import read_yaml
from records.reader import read
from report.analysis import ALL, analyze
from report.candidates import RULE
from tests.report.synthetic import several


def picks(records: list[dict[str, Any]]) -> dict[str, str | None]:
    return {cat: r.backend for cat, r in analyze(records).recommendations.items()}


def test_the_clearly_faster_candidate_is_named_and_the_pairwise_ci_excludes_one():
    records = several({"slow": {"speedups": {"chat": 1.2, "code": 1.2}},
                       "fast": {"speedups": {"chat": 1.6, "code": 1.6}}})  # fmt: skip
    a = analyze(records)
    assert picks(records) == {"chat": "fast", "code": "fast", ALL: "fast"}
    for h in a.head_to_head:
        assert (h.a, h.b) == ("slow", "fast")
        assert h.e2e is not None and h.b_faster
        assert h.e2e.ci_low <= 1.6 / 1.2 <= h.e2e.ci_high  # the true ratio, paired
    assert set(a.candidates) == {"slow", "fast"}
    assert ("candidate", "chat") not in a.latency  # no pooled candidate
    assert {("candidate slow", "chat"), ("candidate fast", "chat")} <= set(a.latency)


def test_each_category_gets_its_own_pick_and_the_policy_fragment_routes_it():
    records = several({"ngram": {"speedups": {"chat": 1.1, "code": 1.8}, "method": "ngram"},
                       "eagle": {"speedups": {"chat": 1.5, "code": 1.2}, "method": "eagle3"}})  # fmt: skip
    a = analyze(records)
    assert picks(records)["code"] == "ngram" and picks(records)["chat"] == "eagle"
    assert a.policy_fragment is not None
    policy = (
        "version: 1\nbackends:\n  prod: {url: 'http://127.0.0.1:1', kind: vllm}\n"
        "  ngram: {url: 'http://127.0.0.1:2', kind: vllm}\n"
        "  eagle: {url: 'http://127.0.0.1:3', kind: vllm}\nprimary: prod\n" + a.policy_fragment
    )
    compiled = parse_policy(read_yaml(policy.encode(), source="fragment"), source="fragment")
    routed = {rule.name: [leg.backend.name for leg in rule.legs] for rule in compiled.rules}
    assert routed == {"recommended-ngram": ["ngram"], "recommended-eagle": ["eagle"]}


def test_a_faster_candidate_that_diverges_beyond_the_noise_floor_is_never_recommended():
    records = several({"careful": {"speedups": {"chat": 1.3, "code": 1.3}},
                       "sloppy": {"speedups": {"chat": 1.9, "code": 1.9}, "divergence": {"code": 0.4}}})  # fmt: skip
    a = analyze(records)
    assert picks(records)["code"] == "careful"  # sloppy is faster on code but diverges there
    assert picks(records)["chat"] == "sloppy"  # and is fine on chat
    code = {v.category: v for v in a.candidates["sloppy"].verdicts}["code"]
    assert code.decision == "do_not_adopt"


@pytest.mark.parametrize(
    ("a_spec", "b_spec", "cheaper"),
    [
        ({"method": "draft_model", "k": 4}, {"method": "ngram", "k": 4}, "b"),  # no draft model
        ({"method": "ngram", "k": 2}, {"method": "ngram", "k": 4}, "a"),  # smaller k
    ],
)
def test_a_tie_goes_to_the_cheaper_configuration(a_spec, b_spec, cheaper):
    records = several(
        {"a": {"speedups": {"chat": 1.4, "code": 1.4}, **a_spec},
         "b": {"speedups": {"chat": 1.4, "code": 1.4}, **b_spec}},
        noise=0.0,
    )  # fmt: skip
    a = analyze(records)
    for h in a.head_to_head:
        assert h.e2e is not None and math.isclose(h.e2e.point, 1.0)
        assert not h.b_faster and not h.a_faster
    assert set(picks(records).values()) == {cheaper}
    assert "the cheaper configuration" in a.recommendations["chat"].reason


def test_a_lossy_candidate_is_not_recommended_and_none_is_a_valid_answer():
    records = several({"lossy": {"speedups": {"chat": 1.8, "code": 1.8}, "verification": "lossy"},
                       "slow": {"speedups": {"chat": 0.9, "code": 0.9}}})  # fmt: skip
    a = analyze(records)
    assert picks(records) == {"chat": None, "code": None, ALL: None}
    assert "lossily" in a.recommendations["chat"].reason
    assert a.policy_fragment is None


def test_one_candidate_reads_as_before_plus_the_recommendation():
    records = several({"only": {"speedups": {"chat": 1.5, "code": 0.8}}})
    a = analyze(records)
    assert not a.several and a.head_to_head == []
    assert picks(records) == {"chat": "only", "code": None, ALL: picks(records)[ALL]}
    assert ("candidate", "chat") in a.latency  # one candidate keeps the plain role label
    assert RULE.startswith("Per category")


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ([[1, 8, 4], [9, 1024, 0]], ((1, 8, 4), (9, 1024, 0))),
        ([[1, 8]], None),  # a row short of its k
        ([["a", 8, 4]], None),
        ("1-8:4", None),
    ],
)
def test_a_reported_schedule_is_read_or_left_out_never_a_crash(
    schedule: Any, expected: Any
) -> None:
    from report.candidates import speculation

    record = {"legs": [{"role": "primary", "backend": "p"},
                       {"role": "candidate", "backend": "c",
                        "speculative": {"method": "ngram", "reported": {"schedule": schedule}}}]}  # fmt: skip
    assert speculation([read(record)], "c").schedule == expected
