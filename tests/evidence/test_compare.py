"""compare(): exact match, divergence positions, JSON and tool-call equivalence, refusal,
citations, bounded similarity, paired latency, and flags only for greedy requests."""

from __future__ import annotations

import time

import pytest

from evidence.compare import (
    MAX_SIMILARITY_UNITS,
    compare,
    is_greedy,
    is_refusal,
    json_equal,
    similarity,
)
from otel.attributes import evaluation_results
from tests.evidence.legs import leg, some


def evaluations(c: object) -> list[tuple[str, float | None, str | None]]:
    """The comparison's evaluation events as (name, value, label)."""
    return [(r.name, r.score_value, r.score_label) for r in evaluation_results(c)]  # type: ignore[arg-type]


WORDS = [" alpha", " beta", " gamma", " delta", " eps", " zeta"]


def test_identical_outputs_match_exactly_with_no_divergence():
    c = compare(leg("primary", WORDS), leg("candidate", WORDS), greedy=True)
    assert c.exact_match is True and c.first_divergence is None and c.similarity == 1.0
    assert c.divergence_unit == "char" and c.flag is False and c.finish_reason_equal is True
    assert c.length_ratio == 1.0


@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_a_divergence_at_token_n_is_reported_at_n_when_both_legs_carry_logprobs(n):
    other = [*WORDS[:n], *(" x" + w for w in WORDS[n:])]
    c = compare(
        leg("primary", WORDS, logprobs=True), leg("candidate", other, logprobs=True), greedy=True
    )
    assert c.divergence_unit == "token" and c.first_divergence == n
    assert c.divergence_fraction == pytest.approx(n / len(WORDS))
    assert c.exact_match is False and c.flag is True
    assert 0.0 <= some(c.similarity) < 1.0


def test_without_logprobs_the_divergence_is_in_characters():
    other = [*WORDS[:2], " gxmma", *WORDS[3:]]
    c = compare(leg("primary", WORDS), leg("candidate", other), greedy=True)
    assert c.divergence_unit == "char"
    assert c.first_divergence == len("".join(WORDS[:2])) + 2


def test_a_shorter_output_diverges_where_it_ends():
    c = compare(leg("primary", WORDS), leg("candidate", WORDS[:3], finish="length"), greedy=True)
    assert c.first_divergence == len("".join(WORDS[:3]))
    assert c.finish_reason_equal is False and some(c.length_ratio) < 1.0


def test_sampled_requests_are_never_flagged_one_by_one():
    c = compare(leg("primary", WORDS), leg("candidate", ["different"]), greedy=False)
    assert c.exact_match is False and c.flag is False


@pytest.mark.parametrize(
    ("temperature", "seed", "greedy"),
    [(0.0, None, True), (0, None, True), (None, 7, True), (0.7, None, False), (None, None, False)],
)
def test_greedy_means_temperature_zero_or_a_fixed_seed(temperature, seed, greedy):
    assert is_greedy(temperature, seed) is greedy


@pytest.mark.parametrize(
    ("a", "b", "valid_b", "equal"),
    [
        ('{"a": 1, "b": [1, 2]}', '{"b": [1, 2], "a": 1}', True, True),
        (
            '{"a": 1, "b": {"x": "y", "z": null}}',
            '{"b": {"z": null, "x": "y"}, "a": 1}',
            True,
            True,
        ),
        ('{"a": 1}', '{"a": 2}', True, False),
        ('{"a": 1}', '{"a": 1.5}', True, False),
        ('{"a": true}', '{"a": 1}', True, False),
        ('{"a": [1, 2]}', '{"a": [2, 1]}', True, False),
        ('{"a": 1}', '{"a": 1', False, None),
    ],
)
def test_json_outputs_are_equal_when_parsed_equal_whatever_the_key_order(a, b, valid_b, equal):
    c = compare(leg("primary", [a]), leg("candidate", [b]), greedy=True, expects_json=True)
    assert c.json_expected and c.json_valid_a is True and c.json_valid_b is valid_b
    assert c.json_equal is equal


def test_json_is_judged_from_the_outputs_when_the_request_is_unknown():
    c = compare(leg("primary", ['{"k": 1}']), leg("candidate", ['{"k": 1 }']), greedy=True)
    assert c.json_expected and c.json_equal is True and c.exact_match is False
    plain = compare(leg("primary", ["hi"]), leg("candidate", ["hi"]), greedy=True)
    assert plain.json_expected is False and plain.json_equal is None


def test_a_request_that_asked_for_json_and_got_prose_is_invalid_json():
    c = compare(
        leg("primary", ["sure!"]), leg("candidate", ["sure!"]), greedy=True, expects_json=True
    )
    assert c.json_valid_a is False and c.json_equal is None
    assert ("json_valid", 0.0, "invalid") in evaluations(c)


@pytest.mark.parametrize(
    ("calls_a", "calls_b", "names", "args"),
    [
        (
            [("get", '{"city": "Paris", "unit": "C"}')],
            [("get", '{"unit": "C", "city": "Paris"}')],
            True,
            True,
        ),
        ([("get", '{"city": "Paris"}')], [("get", '{"city": "Rome"}')], True, False),
        ([("get", '{"city": "Paris"}')], [("put", '{"city": "Paris"}')], False, True),
        ([("get", '{"city": "Paris"')], [("get", '{"city": "Paris"}')], True, False),
        ([("get", '{"city": "Paris"')], [("get", '{"city": "Paris"')], True, True),
        ([("get", "{}")], [("get", "{}"), ("put", "{}")], False, False),
    ],
)
def test_tool_calls_compare_names_and_parsed_arguments(calls_a, calls_b, names, args):
    c = compare(
        leg("primary", [], tool_calls=calls_a, finish="tool_calls"),
        leg("candidate", [], tool_calls=calls_b, finish="tool_calls"),
        greedy=True,
    )
    assert c.tool_names_equal is names and c.tool_arguments_equal is args
    assert c.exact_match is (calls_a == calls_b)


def test_no_tool_calls_on_either_side_leaves_tool_fields_unknown():
    c = compare(leg("primary"), leg("candidate"), greedy=True)
    assert c.tool_names_equal is None and c.tool_arguments_equal is None


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("I'm sorry, but I can't help with that.", True),
        ("I cannot assist with this request.", True),
        ("As an AI language model, I must decline.", True),
        ("Sure! Here is the recipe.", False),
        ("The sorry state of affairs in I/O.", False),
    ],
)
def test_the_refusal_detector_matches_documented_phrases(text, refused):
    assert is_refusal(text) is refused


def test_a_refusal_on_one_side_only_is_reported():
    c = compare(
        leg("primary", ["Here you go."]),
        leg("candidate", ["I'm sorry, I can't help with that."]),
        greedy=False,
    )
    assert c.refusal_a is False and c.refusal_b is True and c.one_sided_refusal is True
    field = compare(leg("primary", []), leg("candidate", [], refusal="no"), greedy=False)
    assert field.refusal_b is True and field.one_sided_refusal is True


def test_cited_sources_are_compared_as_sets():
    same = compare(
        leg("primary", ["See [1] and [3]."]), leg("candidate", ["Per [3], [1]."]), greedy=False
    )
    assert same.citations_equal is True and same.citations_a == (1, 3)
    differ = compare(leg("primary", ["See [1, 2]."]), leg("candidate", ["See [1]."]), greedy=False)
    assert differ.citations_equal is False and differ.citations_a == (1, 2)
    none = compare(leg("primary"), leg("candidate"), greedy=False)
    assert none.citations_equal is None


def test_latency_deltas_and_ratios_are_shadow_minus_primary():
    a = leg("primary", WORDS, ttft_ms=20, gap_ms=10)
    b = leg("candidate", WORDS, ttft_ms=30, gap_ms=5, per_event=2)
    c = compare(a, b, greedy=True)
    ttft = some(c.latency_delta("ttft_s"))
    assert ttft.delta == pytest.approx(0.010) and ttft.ratio == pytest.approx(1.5)
    gap = some(c.latency_delta("chunk_gap_p50_s"))
    assert gap.a == pytest.approx(0.010) and gap.b == pytest.approx(0.005)
    tpe = some(c.latency_delta("tokens_per_event"))
    assert some(tpe.b) > some(tpe.a)
    assert {d.name for d in c.latency} == {
        "ttft_s",
        "tpot_s",
        "chunk_gap_p50_s",
        "chunk_gap_p99_s",
        "e2e_s",
        "tokens_per_event",
    }


def test_a_failed_leg_is_not_comparable_and_never_flagged():
    c = compare(leg("primary"), leg("candidate", outcome="upstream_error"), greedy=True)
    assert c.comparable is False and c.exact_match is None and c.flag is False
    assert evaluations(c) == []


# A cost on the wall clock (the cap itself is the `capped` flag): the timing tier.
@pytest.mark.timing
def test_similarity_cost_is_bounded_on_long_outputs():
    n = 50_000
    a = [f"t{i % 97}" for i in range(n)]
    b = list(reversed(a))
    started = time.perf_counter()
    score, capped = similarity(a, b)
    assert time.perf_counter() - started < 5.0
    assert capped and 0.0 <= score <= 2 * MAX_SIMILARITY_UNITS / n + 1e-9


def test_similarity_strips_a_long_common_prefix_in_linear_time():
    a = ["x"] * 100_000 + ["a"]
    b = ["x"] * 100_000 + ["b"]
    score, capped = similarity(a, b)
    assert not capped and score == pytest.approx(100_000 / 100_001)


def test_json_equal_keeps_types_apart():
    assert json_equal({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]})
    assert not json_equal(1, 1.0) and not json_equal(True, 1) and not json_equal([1], [1, 2])


def test_evaluations_name_each_known_score():
    c = compare(
        leg("primary", WORDS, logprobs=True),
        leg("candidate", [*WORDS[:2], " q", *WORDS[3:]], logprobs=True),
        greedy=True,
    )
    names = {name: (value, label) for name, value, label in evaluations(c)}
    assert names["exact_match"] == (0.0, "diverge")
    assert names["first_divergence"] == (2.0, "token")
    assert 0 < some(names["similarity"][0]) < 1
