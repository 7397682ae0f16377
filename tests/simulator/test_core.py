"""Pure cores of the simulator: text generation, JSON from schemas, the step model, config."""

from __future__ import annotations

import json
import random

import pytest

from simulator.acceptance import expected_rates, plan_steps
from simulator.config import Faults, FaultSyntaxError, SimConfig, parse_faults
from simulator.plan import plan_completion
from simulator.request import SimRequestError, classify, parse_request
from simulator.textgen import split_pieces
from tests.simulator.helpers import fits_schema

CFG = SimConfig(min_output_tokens=20, max_output_tokens=40)


def chat(content: str, **extra: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **extra}).encode()


def test_same_prompt_gives_same_tokens_and_a_smaller_max_tokens_gives_a_prefix():
    full = plan_completion(CFG, parse_request("chat", chat("hi", max_tokens=500), CFG), "chat")
    again = plan_completion(CFG, parse_request("chat", chat("hi", max_tokens=500), CFG), "chat")
    short = plan_completion(CFG, parse_request("chat", chat("hi", max_tokens=5), CFG), "chat")
    other = plan_completion(CFG, parse_request("chat", chat("hello", max_tokens=500), CFG), "chat")
    assert full.tokens == again.tokens
    assert 20 <= len(full.tokens) <= 40 and full.finish_reason == "stop"
    assert short.tokens == full.tokens[:5] and short.finish_reason == "length"
    assert other.tokens != full.tokens


def test_plain_and_speculative_plans_have_the_same_tokens_but_different_steps():
    spec = SimConfig(mode="speculative", min_output_tokens=50, max_output_tokens=50)
    plain = SimConfig(mode="plain", min_output_tokens=50, max_output_tokens=50)
    body = chat("lossless", max_tokens=100)
    p = plan_completion(plain, parse_request("chat", body, plain), "chat")
    s = plan_completion(spec, parse_request("chat", body, spec), "chat")
    assert p.tokens == s.tokens
    assert len(p.steps) == 50 and len(s.steps) < 50


def test_divergence_at_changes_speculative_tokens_from_that_index_only():
    spec = SimConfig(
        mode="speculative", divergence_at=7, min_output_tokens=30, max_output_tokens=30
    )
    plain = SimConfig(min_output_tokens=30, max_output_tokens=30)
    body = chat("diverge", max_tokens=64)
    p = plan_completion(plain, parse_request("chat", body, plain), "chat").tokens
    s = plan_completion(spec, parse_request("chat", body, spec), "chat").tokens
    assert p[:7] == s[:7]
    assert all(a != b for a, b in zip(p[7:], s[7:], strict=True))


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positif", "negatif", "netral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "keywords": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "maxItems": 5,
            },
            "count": {"type": "integer", "minimum": 3, "maximum": 9},
            "flag": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
            "optional": {"type": "string"},
        },
        "required": ["sentiment", "confidence", "keywords", "count", "flag", "note"],
    },
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"id": {"type": "integer"}},
                "required": ["id"],
            }
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
        "required": ["items"],
    },
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "null"}, {"type": "string"}]}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("prompt", ["a", "b", "c", "d"])
def test_json_schema_output_parses_and_fits_the_schema(schema, prompt):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    req = parse_request("chat", chat(prompt, response_format=rf, max_tokens=1000), CFG)
    plan = plan_completion(CFG, req, classify(req, None))
    assert plan.kind == "json" and plan.category == "structured_output"
    assert plan.finish_reason == "stop"
    value = json.loads(plan.text)
    assert fits_schema(value, schema), value
    assert len(plan.tokens) > 3  # pieces, not one blob


def test_json_object_mode_output_is_a_json_object():
    req = parse_request("chat", chat("x", response_format={"type": "json_object"}), CFG)
    assert isinstance(json.loads(plan_completion(CFG, req, "structured_output").text), dict)


@pytest.mark.parametrize(
    "text", ['{"a": [1, 2.5, "x y"], "b": null}', "  spaced\n\ttext ", "ünï ✓"]
)
def test_split_pieces_concatenate_back_to_the_text(text):
    assert "".join(split_pieces(text)) == text


def test_tool_call_plan_has_the_name_first_then_arguments_that_parse():
    tools = [
        {"type": "function", "function": {"name": "noop"}},
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"],
                },
            },
        },
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    req = parse_request("chat", chat("w", tools=tools, tool_choice=choice, max_tokens=200), CFG)
    plan = plan_completion(CFG, req, classify(req, None))
    assert plan.category == "tool_call" and plan.finish_reason == "tool_calls"
    assert plan.tokens[0] == "get_weather" and plan.tool_name == "get_weather"
    args = json.loads(plan.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    no_tools = parse_request("chat", chat("w", tools=tools, tool_choice="none"), CFG)
    assert no_tools.tool is None


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{nope", 400, "JSON"),
        (b"[1]", 400, "object"),
        (chat("x", model="other"), 404, "does not exist"),
        (chat("x", stream_options={"include_usage": True}), 400, "stream=True"),
        (chat("x", max_tokens=0), 400, "max_tokens"),
        (chat("x", n=2), 400, "n=1"),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
    ],
)
def test_invalid_requests_are_refused_like_vllm(body, status, fragment):
    with pytest.raises(SimRequestError) as info:
        parse_request("chat", body, CFG)
    assert info.value.status == status and fragment in info.value.message


def test_max_tokens_defaults_to_64_and_aliases_are_served_models():
    cfg = SimConfig(model="a", aliases=("b",))
    assert parse_request("chat", chat("x", model="b"), cfg).max_tokens == 64
    assert parse_request("completions", json.dumps({"prompt": "x"}).encode(), cfg).model == "a"


def test_requests_are_classified_by_header_tools_schema_and_turns():
    turns = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        }
    ).encode()
    assert classify(parse_request("chat", turns, CFG), None) == "multi_turn"
    assert classify(parse_request("chat", chat("x"), CFG), None) == "chat"
    assert classify(parse_request("chat", chat("x"), CFG), "code") == "code"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("status=503", Faults(status=503)),
        ("hang_before_headers", Faults(hang_before_headers=True)),
        ("hang_after=3, malformed", Faults(hang_after=3, malformed=True)),
        ("drop_after=2;slow_headers=0.5", Faults(drop_after=2, slow_headers_s=0.5)),
        ("", Faults()),
    ],
)
def test_fault_specs_parse(text, expected):
    assert parse_faults(text) == expected


@pytest.mark.parametrize("text", ["status=abc", "status=200", "explode", "malformed=1"])
def test_bad_fault_specs_are_rejected(text):
    with pytest.raises(FaultSyntaxError):
        parse_faults(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"acceptance": (0.5, 0.5)},
        {"acceptance": 1.5},
        {"coverage": -0.1},
        {"category_acceptance": {"code": (0.1,)}},
        {"min_output_tokens": 10, "max_output_tokens": 5},
        {"num_speculative_tokens": 0},
    ],
)
def test_config_rejects_out_of_range_values(kwargs):
    with pytest.raises(ValueError):  # noqa: PT011 — the message names the field; any field will do
        SimConfig(**kwargs)


@pytest.mark.parametrize("seed", range(50))
def test_every_step_emits_accepted_plus_one_and_the_steps_cover_the_output(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 80)
    steps = plan_steps(n, speculative=True, probs=(0.9, 0.8, 0.7), coverage=0.7, rng=rng)
    assert sum(s.emitted for s in steps) == n
    assert steps[0].drafted == 0
    assert all(0 <= s.accepted <= s.drafted <= 3 for s in steps)


def test_plain_mode_and_zero_coverage_never_draft():
    for speculative, coverage in ((False, 1.0), (True, 0.0)):
        steps = plan_steps(
            30, speculative=speculative, probs=(1.0,) * 4, coverage=coverage, rng=random.Random(1)
        )
        assert len(steps) == 30 and not any(s.drafted for s in steps)


def test_empirical_step_statistics_match_expected_rates():
    cfg = SimConfig(mode="speculative", acceptance=(0.9, 0.7, 0.5, 0.3), coverage=0.6)
    exp = expected_rates(cfg)
    rng = random.Random(7)
    drafting = [
        s
        for s in plan_steps(
            200_000, speculative=True, probs=cfg.acceptance_for("chat"), coverage=0.6, rng=rng
        )
        if s.drafted == 4
    ]
    accepted = sum(s.accepted for s in drafting)
    assert accepted / (4 * len(drafting)) == pytest.approx(exp.draft_acceptance_rate, abs=0.01)
    assert 1 + accepted / len(drafting) == pytest.approx(exp.mean_acceptance_length, abs=0.02)
    assert exp.per_position == pytest.approx((0.9, 0.63, 0.315, 0.0945))
    assert exp.tokens_per_step == pytest.approx(0.6 * exp.mean_acceptance_length + 0.4)


def test_category_overrides_change_expected_rates_and_plain_has_none():
    cfg = SimConfig(
        mode="speculative",
        acceptance=0.5,
        category_acceptance={"code": 0.9},
        category_coverage={"code": 0.5},
    )
    assert (
        expected_rates(cfg, "code").draft_acceptance_rate
        > expected_rates(cfg, "chat").draft_acceptance_rate
    )
    assert expected_rates(cfg, "code").coverage == 0.5
    assert expected_rates(SimConfig()).mean_acceptance_length == 1.0
