"""decide(): rule matching, sampling and skip reasons on compiled policies."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policies import CompiledPolicy, PolicyError, RequestFacts, parse_policy, policy_from_flags
from policies.sample import sample_unit

BACKENDS = {
    "cand": {"url": "http://127.0.0.1:9001", "kind": "vllm"},
    "base": {"url": "http://127.0.0.1:9002", "kind": "vllm"},
}
CAND = [{"backend": "cand"}]


def policy(**fields: Any) -> CompiledPolicy:
    return parse_policy({"version": 1, "backends": BACKENDS, **fields}, source="test")


def facts(**overrides: Any) -> RequestFacts:
    values: dict[str, Any] = {
        "route": "chat",
        "model": "llama-3-8b",
        "stream": True,
        "headers": {},
        "prompt_bytes": 100,
        "category": None,
        "request_id": "req-1",
        "retry_count": 0,
    }
    values.update(overrides)
    return RequestFacts(**values)


def rule(name: str, ratio: float = 1.0, legs: Any = CAND, **match: Any) -> dict[str, Any]:
    return {"name": name, "ratio": ratio, "legs": legs, "match": match}


def test_first_matching_rule_wins_over_later_ones() -> None:
    p = policy(rules=[rule("a", models=["llama-3-8b"]), rule("b", models=["llama-3-8b"])])
    assert p.decide(facts()).rule == "a"


def test_request_no_rule_matches_falls_to_default() -> None:
    p = policy(rules=[rule("a", models=["gpt-*"])], default={"ratio": 1, "legs": CAND})
    decision = p.decide(facts())
    assert decision.rule == "default" and decision.skip_reason is None


def test_request_no_rule_matches_without_default_is_not_mirrored() -> None:
    decision = policy(rules=[rule("a", models=["gpt-*"])]).decide(facts())
    assert (decision.rule, decision.sampled, decision.legs, decision.skip_reason) == (
        None,
        False,
        (),
        "no_rule",
    )


def test_default_with_ratio_zero_never_mirrors() -> None:
    p = policy(default={"ratio": 0, "legs": CAND})
    assert {p.decide(facts(request_id=str(i))).skip_reason for i in range(200)} == {"not_sampled"}


@pytest.mark.parametrize(
    ("pattern", "model", "matches"),
    [
        ("llama-3-8b", "llama-3-8b", True),
        ("llama-3-8b", "llama-3-8b-instruct", False),
        ("llama-*", "llama-3-8b", True),
        ("llama-?-8b", "llama-3-8b", True),
        ("llama-[12]-*", "llama-3-8b", False),
        ("LLAMA-*", "llama-3-8b", False),  # case-sensitive
        ("*", None, False),  # a request without a model never matches a models list
    ],
)
def test_model_patterns_are_exact_or_glob(pattern: str, model: str | None, matches: bool) -> None:
    p = policy(rules=[rule("m", models=["other", pattern])])
    assert (p.decide(facts(model=model)).rule == "m") is matches


def test_route_and_stream_conditions() -> None:
    p = policy(rules=[rule("c", routes=["completions"]), rule("s", stream=False)])
    assert p.decide(facts(route="completions")).rule == "c"
    assert p.decide(facts(route="chat", stream=False)).rule == "s"
    assert p.decide(facts(route="chat", stream=True)).rule is None


@pytest.mark.parametrize(
    ("headers", "matches"),
    [
        ({"x-tenant": "acme"}, True),
        ({"x-tenant": "beta-7"}, True),
        ({"x-tenant": "gamma"}, False),
        ({}, False),
        ({"x-tenant": "acme", "x-other": "1"}, True),
    ],
)
def test_header_values_are_matched_exact_or_glob(headers: dict[str, str], matches: bool) -> None:
    p = policy(rules=[rule("t", headers={"X-Tenant": ["acme", "beta-*"]})])
    assert (p.decide(facts(headers=headers)).rule == "t") is matches


def test_all_header_conditions_must_hold() -> None:
    p = policy(rules=[rule("t", headers={"x-tenant": ["acme"], "x-tier": ["gold"]})])
    assert p.decide(facts(headers={"x-tenant": "acme"})).rule is None
    assert p.decide(facts(headers={"x-tenant": "acme", "x-tier": "gold"})).rule == "t"


@pytest.mark.parametrize(
    ("category", "matches"), [("code", True), ("code-python", True), ("chat", False), (None, False)]
)
def test_category_condition(category: str | None, matches: bool) -> None:
    p = policy(rules=[rule("c", categories=["code", "code-*"])])
    assert (p.decide(facts(category=category)).rule == "c") is matches


@pytest.mark.parametrize(
    ("prompt_bytes", "expected"),
    [
        (0, "small"),
        (1023, "small"),
        (1024, "medium"),
        (8191, "medium"),
        (8192, "large"),
        (10**9, "large"),
    ],
)
def test_prompt_size_buckets_are_half_open(prompt_bytes: int, expected: str) -> None:
    p = policy(
        rules=[
            rule("small", prompt_bytes={"max": 1024}),
            rule("medium", prompt_bytes={"min": 1024, "max": 8192}),
            rule("large", prompt_bytes={"min": 8192}),
        ]
    )
    assert p.decide(facts(prompt_bytes=prompt_bytes)).rule == expected


def test_rule_with_no_legs_stops_matching_and_mirrors_nothing() -> None:
    p = policy(rules=[rule("exclude", legs=[], headers={"x-tenant": ["internal"]}), rule("all")])
    decision = p.decide(facts(headers={"x-tenant": "internal"}))
    assert (decision.rule, decision.skip_reason, decision.legs) == ("exclude", "no_legs", ())
    assert p.decide(facts()).rule == "all"


def test_mirrored_decision_carries_the_legs_with_model_rewrite() -> None:
    legs = [{"backend": "cand", "model": "llama-spec"}, {"backend": "base", "role": "baseline"}]
    decision = policy(rules=[rule("a", legs=legs)]).decide(facts())
    assert decision.sampled and decision.skip_reason is None
    assert [(leg.role, leg.backend.name, leg.model) for leg in decision.legs] == [
        ("candidate", "cand", "llama-spec"),
        ("baseline", "base", None),
    ]


def test_kill_switch_stops_mirroring_but_reports_the_rule() -> None:
    decision = policy(rules=[rule("a")], kill_switch=True).decide(facts())
    assert (decision.rule, decision.sampled, decision.legs, decision.skip_reason) == (
        "a",
        True,
        (),
        "kill_switch",
    )


def test_retried_request_is_not_mirrored_by_default() -> None:
    p = policy(rules=[rule("a")])
    assert p.decide(facts(retry_count=1)).skip_reason == "retry"
    assert p.decide(facts(retry_count=0)).skip_reason is None


def test_retried_request_is_mirrored_when_the_policy_allows_it() -> None:
    p = policy(rules=[rule("a")], mirror={"mirror_retries": True})
    assert p.decide(facts(retry_count=3)).skip_reason is None


def test_body_over_budget_is_not_mirrored() -> None:
    p = policy(rules=[rule("a")], budgets={"max_body_bytes": 1000})
    assert p.decide(facts(prompt_bytes=1000)).skip_reason is None
    assert p.decide(facts(prompt_bytes=1001)).skip_reason == "body_size"
    assert p.decide(facts(prompt_bytes=10, body_bytes=5000)).skip_reason == "body_size"


def test_unsampled_request_reports_not_sampled_before_other_reasons() -> None:
    p = policy(rules=[rule("a", ratio=0)], kill_switch=True)
    decision = p.decide(facts(retry_count=2))
    assert (decision.sampled, decision.skip_reason) == (False, "not_sampled")


def test_capture_comes_from_the_rule_or_the_policy() -> None:
    p = policy(
        rules=[{**rule("a", models=["x"]), "capture": {"text": "full"}}, rule("b")],
        capture={"text": "hashes"},
    )
    assert p.decide(facts(model="x")).capture.text == "full"
    assert p.decide(facts(model="y")).capture.text == "hashes"
    assert policy(rules=[rule("c")]).decide(facts()).capture.text == "off"


@pytest.mark.parametrize("ratio", [0.05, 0.25, 0.5, 0.9])
def test_empirical_ratio_over_10000_request_ids_is_within_one_point(ratio: float) -> None:
    p = policy(rules=[rule("r", ratio=ratio)])
    mirrored = sum(p.decide(facts(request_id=f"req-{i}")).legs != () for i in range(10_000))
    assert abs(mirrored / 10_000 - ratio) <= 0.01


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, 0), (1.0, 10_000)])
def test_ratio_edges_mirror_none_or_all(ratio: float, expected: int) -> None:
    p = policy(rules=[rule("r", ratio=ratio)])
    assert sum(p.decide(facts(request_id=f"id{i}")).sampled for i in range(10_000)) == expected


def test_sticky_header_key_gives_every_request_of_a_user_the_same_answer() -> None:
    p = policy(rules=[rule("r", ratio=0.5)], sampling={"key": "header:X-User-Id"})
    for user in (f"user-{u}" for u in range(50)):
        answers = {
            p.decide(facts(request_id=f"{user}-{i}", headers={"x-user-id": user})).sampled
            for i in range(20)
        }
        assert len(answers) == 1
    users = [p.decide(facts(headers={"x-user-id": f"u{u}"})).sampled for u in range(2000)]
    assert 0.4 < sum(users) / len(users) < 0.6


def test_sticky_key_falls_back_to_the_request_id_when_the_header_is_missing_or_empty() -> None:
    p = policy(rules=[rule("r", ratio=0.5)], sampling={"key": "header:x-user-id"})
    for i in range(200):
        rid = f"req-{i}"
        expected = sample_unit("r", rid) < 0.5
        assert p.decide(facts(request_id=rid)).sampled is expected
        assert p.decide(facts(request_id=rid, headers={"x-user-id": ""})).sampled is expected


def test_same_rule_name_keeps_decisions_across_reload_with_other_changes() -> None:
    before = policy(rules=[rule("keep", ratio=0.3)])
    after = policy(
        rules=[rule("new", models=["gpt-*"]), rule("keep", ratio=0.3)], kill_switch=False
    )
    ids = [f"r{i}" for i in range(2000)]
    assert [before.decide(facts(request_id=i)).sampled for i in ids] == [
        after.decide(facts(request_id=i)).sampled for i in ids
    ]


def test_raising_a_ratio_only_adds_requests() -> None:
    low, high = policy(rules=[rule("r", ratio=0.1)]), policy(rules=[rule("r", ratio=0.2)])
    ids = [f"r{i}" for i in range(3000)]
    low_set = {i for i in ids if low.decide(facts(request_id=i)).sampled}
    high_set = {i for i in ids if high.decide(facts(request_id=i)).sampled}
    assert low_set < high_set


def test_decide_results_do_not_depend_on_cache_state() -> None:
    p = policy(rules=[rule("a", models=["m1"]), rule("b", routes=["completions"])])
    first = [
        p.decide(facts(model=m, route=r)).rule
        for m in ("m1", "m2")
        for r in ("chat", "completions")
    ]
    again = [
        p.decide(facts(model=m, route=r)).rule
        for m in ("m1", "m2")
        for r in ("chat", "completions")
    ]
    fresh = dataclasses.replace(p)  # a new, empty cache
    third = [
        fresh.decide(facts(model=m, route=r)).rule
        for m in ("m1", "m2")
        for r in ("chat", "completions")
    ]
    assert first == again == third == ["a", "a", None, "b"]


def test_backend_defaults_and_overrides_are_resolved() -> None:
    p = parse_policy(
        {
            "version": 1,
            "backends": {
                "v": {"url": "http://h:8000/", "kind": "vllm", "timeout": {"idle_s": 5}},
                "o": {"url": "https://api.example", "kind": "openai", "api_key_env": "O_KEY"},
            },
            "timeouts": {"connect_s": 1.5, "idle_s": 20},
        },
        source="t",
    )
    v, o = p.backends["v"], p.backends["o"]
    assert (v.url, v.metrics_url, v.connect_s, v.idle_s) == (
        "http://h:8000",
        "http://h:8000/metrics",
        1.5,
        5,
    )
    assert (o.metrics_url, o.server_address, v.server_address) == (
        None,
        "api.example:443",
        "h:8000",
    )
    assert o.auth_header({"O_KEY": "secret"}) == ("authorization", "Bearer secret")
    assert o.auth_header({}) is None and o.auth_header({"O_KEY": ""}) is None
    assert v.auth_header({"ANY": "x"}) is None


def test_primary_url_flag_overrides_the_policy_primary() -> None:
    raw = {
        "version": 1,
        "backends": {**BACKENDS, "prod": {"url": "http://old:1", "kind": "vllm"}},
        "primary": "prod",
    }
    p = parse_policy(raw, source="t", primary_url="http://new:2")
    assert p.primary is not None
    assert (p.primary.name, p.primary.url, p.primary.metrics_url) == (
        "prod",
        "http://new:2",
        "http://new:2/metrics",
    )
    assert p.backends["prod"] is p.primary


def test_primary_url_flag_creates_a_primary_backend_when_the_policy_has_none() -> None:
    p = parse_policy({"version": 1, "backends": BACKENDS}, source="t", primary_url="http://p:1")
    assert p.primary is not None and (p.primary.name, p.primary.kind) == ("primary", "openai")


def test_primary_url_flag_refuses_to_take_over_a_shadow_backend_name() -> None:
    backends = {"primary": {"url": "http://s:1", "kind": "vllm"}}
    with pytest.raises(PolicyError, match=r"^--primary: the policy has a shadow backend named"):
        parse_policy({"version": 1, "backends": backends}, source="t", primary_url="http://p:1")


def test_policy_from_flags_mirrors_to_candidates_and_baseline_at_the_ratio() -> None:
    p = policy_from_flags(
        primary_url="http://127.0.0.1:9000",
        shadow_urls=["http://127.0.0.1:9001", "http://127.0.0.1:9003"],
        baseline_url="http://127.0.0.1:9002",
        ratio=1.0,
    )
    decision = p.decide(facts())
    assert decision.rule == "flags"
    assert [(leg.role, leg.backend.name) for leg in decision.legs] == [
        ("candidate", "shadow-1"),
        ("candidate", "shadow-2"),
        ("baseline", "baseline"),
    ]
    assert p.primary is not None and p.primary.url == "http://127.0.0.1:9000"
    assert p.source == "flags" and len(p.sha256) == 64


def test_policy_from_flags_without_shadows_mirrors_nothing() -> None:
    p = policy_from_flags(primary_url="http://h:1", shadow_urls=[], baseline_url=None, ratio=0.5)
    assert p.decide(facts()).skip_reason == "no_rule"


def test_policy_from_flags_reports_bad_flags_by_name() -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_flags(
            primary_url="ftp://x", shadow_urls=["http://h:1/v1"], baseline_url=None, ratio=1.5
        )
    assert info.value.problems == (
        "--shadow: must be the base URL without /v1 (the gateway appends /v1/chat/completions), "
        "got 'http://h:1/v1'",
        "--primary: must be an http:// or https:// URL, got 'ftp://x'",
        "--shadow-ratio: must be between 0 and 1, got 1.5",
    )
