"""Policy validation: every error path names its field, examples validate, schema is committed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from policies import PolicyError, load_policy, parse_policy
from policies.model import render_json_schema
from policies.parse import format_path, read_yaml

POLICIES_DIR = Path(__file__).resolve().parents[2] / "policies"
EXAMPLES = sorted((POLICIES_DIR / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "version": 1,
    "backends": {
        "prod": {"url": "http://127.0.0.1:9000", "kind": "openai"},
        "cand": {"url": "http://127.0.0.1:9001", "kind": "vllm"},
        "base": {"url": "http://127.0.0.1:9002", "kind": "vllm"},
    },
    "primary": "prod",
    "rules": [
        {"name": "r0", "ratio": 0.5, "legs": [{"backend": "cand"}]},
        {"name": "r1", "ratio": 0.5, "legs": [{"backend": "cand"}]},
        {"name": "r2", "ratio": 0.5, "legs": [{"backend": "base", "role": "baseline"}]},
    ],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    """BASE with ``a.b[2].c``-style ``path`` set to ``value`` (intermediate dicts created)."""
    raw = copy.deepcopy(BASE)
    parts = path.replace("]", "").replace("[", ".").split(".")
    node: Any = raw
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    last = parts[-1]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return raw


def problems_of(raw: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(PolicyError) as info:
        parse_policy(raw, source="test")
    return info.value.problems


def test_base_policy_is_valid() -> None:
    policy = parse_policy(BASE, source="test")
    assert [r.name for r in policy.rules] == ["r0", "r1", "r2"]
    assert policy.primary is not None and policy.primary.name == "prod"


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("rules[2].ratio", 1.5, "rules[2].ratio: must be between 0 and 1, got 1.5"),
        ("rules[0].ratio", -0.1, "rules[0].ratio: must be between 0 and 1, got -0.1"),
        (
            "rules[1].ratio",
            "0.5",
            "rules[1].ratio: must be a number between 0 and 1 or 'load_matched', got '0.5'",
        ),
        ("rules[1].ratio", float("nan"), "rules[1].ratio: must be a finite number, got nan"),
        ("version", 2, "version: must be 1, got 2"),
        ("rules[0].name", "has space", "rules[0].name: must be 1-64 letters"),
        (
            "rules[0].legs[0].role",
            "shadow",
            "rules[0].legs[0].role: must be one of 'candidate' or 'baseline', got 'shadow'",
        ),
        ("rules[0].legs[0].model", "", "rules[0].legs[0].model: must not be empty"),
        ("rules[0].legs", None, "rules[0].legs: must be a list, got null"),
        (
            "rules[0].match.routes",
            ["chat", "embeddings"],
            "rules[0].match.routes[1]: must be one of 'chat', 'completions' or 'responses', got 'embeddings'",
        ),
        (
            "rules[0].match.models",
            [],
            "rules[0].match.models: must list at least 1 item(s), got an empty list",
        ),
        ("rules[0].match.stream", "yes", "rules[0].match.stream: must be true or false, got 'yes'"),
        (
            "rules[0].match.headers",
            {"x-tenant": "acme"},
            "rules[0].match.headers.x-tenant: must be a list, got 'acme'",
        ),
        (
            "rules[0].match.headers",
            {"x tenant": ["a"]},
            'rules[0].match.headers["x tenant"] (key): must be an HTTP header name',
        ),
        (
            "rules[0].match.prompt_bytes",
            {"min": 100, "max": 100},
            "rules[0].match.prompt_bytes: max must be greater than min, got min=100, max=100",
        ),
        (
            "rules[0].match.prompt_bytes",
            {"min": -1},
            "rules[0].match.prompt_bytes.min: must be >= 0, got -1",
        ),
        (
            "rules[0].match.categroies",
            ["code"],
            "rules[0].match.categroies: unknown key (did you mean 'categories'?)",
        ),
        ("rules[0].rati", 0.5, "rules[0].rati: unknown key (did you mean 'ratio'?)"),
        ("rulez", [], "rulez: unknown key (did you mean 'rules'?)"),
        ("backends.cand.knd", "vllm", "backends.cand.knd: unknown key (did you mean 'kind'?)"),
        (
            "rules[0].legs[0].modle",
            "m",
            "rules[0].legs[0].modle: unknown key (did you mean 'model'?)",
        ),
        (
            "budgets.breaker.cooldown",
            1,
            "budgets.breaker.cooldown: unknown key (did you mean 'cooldown_s'?)",
        ),
        ("zzz", 1, "zzz: unknown key (expected one of: version, backends,"),
        (
            "backends.cand.kind",
            "tgi",
            "backends.cand.kind: must be one of 'vllm', 'sglang', 'llamacpp', 'openai' or 'sim', got 'tgi'",
        ),
        (
            "backends.cand.url",
            "http://127.0.0.1:9001/v1",
            "backends.cand.url: must be the base URL without /v1",
        ),
        (
            "backends.cand.url",
            "ftp://host",
            "backends.cand.url: must be an http:// or https:// URL, got 'ftp://host'",
        ),
        ("backends.cand.url", "http://host:99999", "backends.cand.url: has an invalid port"),
        (
            "backends.cand.url",
            "http://host?x=1",
            "backends.cand.url: must not have a query or fragment",
        ),
        ("backends.cand.max_connections", 0, "backends.cand.max_connections: must be >= 1, got 0"),
        ("backends.cand.timeout.idle_s", 0, "backends.cand.timeout.idle_s: must be > 0, got 0"),
        (
            "backends.cand.metrics_url",
            "not a url",
            "backends.cand.metrics_url: must be an http:// or https:// URL",
        ),
        ("backends.cand.api_key_env", 12, "backends.cand.api_key_env: must be a string, got 12"),
        (
            "backends.bad name",
            {"url": "http://h", "kind": "vllm"},
            'backends["bad name"] (key): must be 1-64 letters',
        ),
        (
            "sampling.key",
            "user",
            "sampling.key: must be 'request_id' or 'header:<header-name>', got 'user'",
        ),
        ("sampling.key", "header:", "sampling.key: must be 'request_id' or 'header:<header-name>'"),
        ("budgets.max_in_flight", 1.5, "budgets.max_in_flight: must be an integer, got 1.5"),
        ("budgets.max_rps", 0, "budgets.max_rps: must be > 0"),
        ("budgets.breaker.failures", 0, "budgets.breaker.failures: must be >= 1, got 0"),
        ("timeouts.total_s", float("inf"), "timeouts.total_s: must be a finite number, got inf"),
        ("timeouts.connect_s", -1, "timeouts.connect_s: must be > 0"),
        (
            "mirror.timing",
            "before_primary",
            "mirror.timing: must be one of 'with_primary' or 'after_primary'",
        ),
        (
            "mirror.on_client_disconnect",
            "abort",
            "mirror.on_client_disconnect: must be one of 'finish' or 'cancel'",
        ),
        ("mirror.mirror_retries", 1, "mirror.mirror_retries: must be true or false, got 1"),
        ("shaping.override_temperature", 3, "shaping.override_temperature: must be <= 2, got 3"),
        ("shaping.force_stream", "true", "shaping.force_stream: must be true or false, got 'true'"),
        (
            "capture.text",
            True,
            "capture.text: must be one of false, 'hashes', 'redacted' or 'full', got true",
        ),
        (
            "capture.redact",
            ["phones"],
            "capture.redact[0]: must be one of 'emails' or 'secrets', got 'phones'",
        ),
        ("kill_switch", "on", "kill_switch: must be true or false, got 'on'"),
        (
            "headers.allow",
            ["x-tenant", "bad header"],
            "headers.allow[1]: must be an HTTP header name, got 'bad header'",
        ),
        ("default", {"ratio": 0.5}, "default.legs: is required"),
        ("backends", [], "backends: must be a mapping, got an empty list"),
        ("rules[0]", "r0", "rules[0]: must be a mapping, got 'r0'"),
    ],
)
def test_invalid_field_is_reported_with_its_path(path: str, value: Any, expected: str) -> None:
    problems = problems_of(with_change(path, value))
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    ("raw_change", "expected"),
    [
        (
            {
                "rules": [
                    {"name": "a", "ratio": 1, "legs": []},
                    {"name": "a", "ratio": 1, "legs": []},
                ]
            },
            "rules[1].name: duplicate rule name 'a' (first used by rules[0])",
        ),
        (
            {"rules": [{"name": "default", "ratio": 1, "legs": []}]},
            "rules[0].name: 'default' is reserved for the default rule",
        ),
        (
            {"rules": [{"name": "a", "ratio": 1, "legs": [{"backend": "nope"}]}]},
            "rules[0].legs[0].backend: unknown backend 'nope' (known: base, cand, prod)",
        ),
        (
            {"default": {"ratio": 1, "legs": [{"backend": "ghost"}]}},
            "default.legs[0].backend: unknown backend 'ghost'",
        ),
        (
            {"rules": [{"name": "a", "ratio": 1, "legs": [{"backend": "prod"}]}]},
            "rules[0].legs[0].backend: 'prod' is the primary; shadow legs must target other backends",
        ),
        (
            {
                "rules": [
                    {"name": "a", "ratio": 1, "legs": [{"backend": "cand"}, {"backend": "cand"}]}
                ]
            },
            "rules[0].legs[1]: duplicate of rules[0].legs[0]",
        ),
        ({"primary": "missing"}, "primary: unknown backend 'missing' (known: base, cand, prod)"),
        (
            {"headers": {"allow": ["x-tenant", "Authorization"]}},
            "headers.allow[1]: 'authorization' may carry client credentials; set "
            "headers.allow_credentials_to_shadows: true",
        ),
        (
            {"headers": {"allow": ["cookie"]}},
            "headers.allow[0]: 'cookie' may carry client credentials",
        ),
        (
            {"headers": {"allow": ["X-Api-Key"]}},
            "headers.allow[0]: 'x-api-key' may carry client credentials",
        ),
        (
            {"headers": {"allow": ["host"], "allow_credentials_to_shadows": True}},
            "headers.allow[0]: 'host' is set by the gateway or is connection-level",
        ),
        (
            {"headers": {"allow": ["x-specshadow-shadow"]}},
            "headers.allow[0]: 'x-specshadow-shadow' is set by the gateway",
        ),
    ],
)
def test_cross_field_problem_is_reported_with_its_path(
    raw_change: dict[str, Any], expected: str
) -> None:
    problems = problems_of({**BASE, **raw_change})
    assert any(p.startswith(expected) for p in problems), problems


def test_missing_version_and_wrong_types_are_all_reported_at_once() -> None:
    problems = problems_of({"backends": None, "rules": {"a": 1}})
    assert problems == (
        "version: is required",
        "backends: must be a mapping, got null",
        "rules: must be a list, got a mapping",
    )


def test_api_key_env_holding_a_secret_is_rejected_without_echoing_it() -> None:
    secret = "sk-live-0123456789abcdef"
    problems = problems_of(with_change("backends.cand.api_key_env", secret))
    assert problems[0].startswith("backends.cand.api_key_env: must be the NAME of an environment")
    assert secret not in "\n".join(problems)


def test_url_with_credentials_is_rejected_without_echoing_them() -> None:
    problems = problems_of(with_change("backends.cand.url", "http://user:hunter2@host:8000"))
    assert problems[0].startswith("backends.cand.url: must not embed credentials")
    assert "hunter2" not in "\n".join(problems)


def test_credential_headers_may_be_allowed_explicitly() -> None:
    raw = {**BASE, "headers": {"allow": ["authorization"], "allow_credentials_to_shadows": True}}
    assert parse_policy(raw, source="test").header_allow == frozenset({"authorization"})


def test_many_problems_are_capped_with_a_count() -> None:
    rules = [{"name": f"r{i}", "ratio": 2, "legs": []} for i in range(30)]
    problems = problems_of({**BASE, "rules": rules})
    assert len(problems) == 21 and problems[-1] == "... and 10 more problems"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: 1\nbackends:\n  a: [\n", "line 4, column 1: expected the node content"),
        (
            "version: 1\nkill_switch: true\nversion: 1\n",
            "line 3, column 1: duplicate key 'version' (first defined on line 1)",
        ),
        (
            "version: 1\nrules:\n  - name: a\n    ratio: 1\n    ratio: 0\n",
            "line 5, column 5: duplicate key 'ratio' (first defined on line 4)",
        ),
        ("a: b: c\n", "line 1, column 5: mapping values are not allowed here"),
        ("\tversion: 1\n", "line 1, column 1: found character '\\t' that cannot start any token"),
        ("- version: 1\n", "(top level): must be a mapping, got a list of 1"),
        ("", "(top level): the policy is empty"),
        ("# only a comment\n", "(top level): the policy is empty"),
        ("just text\n", "(top level): must be a mapping, got 'just text'"),
    ],
)
def test_yaml_problem_is_reported_with_line_and_column(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as info:
        read_yaml(text, source="test")
    assert str(info.value).startswith(expected), str(info.value)


def test_yaml_merge_keys_may_override_merged_values() -> None:
    text = (
        "version: 1\nbackends:\n  a: &vllm {url: 'http://h:1', kind: vllm}\n"
        "  b:\n    <<: *vllm\n    url: 'http://h:2'\n"
    )
    policy = parse_policy(read_yaml(text, source="t"), source="t")
    assert policy.backends["b"].url == "http://h:2" and policy.backends["b"].kind == "vllm"


def test_load_policy_reports_problems_with_the_file_as_source(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nrules:\n  - name: a\n    ratio: 1.5\n    legs: []\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.source == str(path)
    assert str(info.value) == "rules[0].ratio: must be between 0 and 1, got 1.5"


def test_load_policy_hashes_the_file_bytes(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\n")
    assert load_policy(path).sha256 == hashlib.sha256(b"version: 1\n").hexdigest()


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        ((), "(top level)"),
        (("rules", 2, "ratio"), "rules[2].ratio"),
        (("backends", "gpu-a", "url"), "backends.gpu-a.url"),
        (("headers", "x y", "[key]"), 'headers["x y"] (key)'),
    ],
)
def test_field_paths_read_like_the_yaml(loc: tuple[int | str, ...], expected: str) -> None:
    assert format_path(loc) == expected


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_policy_is_valid_and_points_editors_at_the_schema(example: Path) -> None:
    first = example.read_text().splitlines()[0]
    prefix = "# yaml-language-server: $schema="
    assert first.startswith(prefix)
    assert (example.parent / first.removeprefix(prefix)).resolve() == POLICIES_DIR / "schema.json"
    policy = load_policy(example)
    assert policy.backends


def test_examples_cover_minimal_production_and_kill_switch() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"minimal.yaml", "production.yaml", "kill-switch.yaml"} <= names
    assert load_policy(POLICIES_DIR / "examples" / "kill-switch.yaml").kill_switch
    production = load_policy(POLICIES_DIR / "examples" / "production.yaml")
    assert production.sampling_header == "x-user-id"
    roles = {leg.role for rule in production.rules for leg in rule.legs}
    assert roles == {"candidate", "baseline"}


def test_committed_schema_equals_the_generated_one() -> None:
    committed = (POLICIES_DIR / "schema.json").read_bytes()
    assert committed == render_json_schema(), (
        "run: specshadow policy schema --out policies/schema.json"
    )


def test_schema_documents_every_field() -> None:
    import json

    schema = json.loads(render_json_schema())
    undocumented = [
        f"{name}.{field}"
        for name, definition in [("PolicyModel", schema), *schema["$defs"].items()]
        for field, spec in definition.get("properties", {}).items()
        if not spec.get("description")
    ]
    assert undocumented == []


def test_quality_margins_override_the_defaults_and_unknown_metrics_name_their_path() -> None:
    from core.quality import DEFAULT_MARGINS

    compiled = parse_policy(with_change("quality.margins", {"refusal_rate": 0.01}), source="t")
    assert compiled.quality.margins["refusal_rate"] == 0.01
    assert compiled.quality.margins["length_ratio"] == DEFAULT_MARGINS["length_ratio"]
    assert parse_policy(copy.deepcopy(BASE), source="t").quality.margins == DEFAULT_MARGINS
    (problem,) = problems_of(with_change("quality.margins", {"refusals": 0.01}))
    assert problem.startswith("quality.margins.refusals: unknown metric (known: ")
    assert any(
        p.startswith("quality.margins.refusal_rate")
        for p in problems_of(with_change("quality.margins", {"refusal_rate": 2}))
    )


def _rollout_rule(ratio: float, legs: list[dict[str, Any]], guards: dict[str, Any]) -> dict:
    return {
        "name": "r",
        "ratio": ratio,
        "legs": legs,
        "rollout": {"stage": "canary", "guards": guards},
    }


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (
            _rollout_rule(0, [{"backend": "cand"}], {}),
            "rules[0].ratio: 0 mirrors nothing, so no canary answer has the primary's answer behind it",
        ),
        (
            _rollout_rule(
                0.2,
                [{"backend": "cand"}],
                {"divergence_rate_max": None, "sampled_divergence_max": None},
            ),
            "rules[0].rollout.guards: no quality guard is on",
        ),
    ],
)
def test_a_rollout_whose_quality_guards_cannot_work_is_refused_with_its_path(
    rule: dict[str, Any], expected: str
) -> None:
    problems = problems_of({**BASE, "rules": [rule]})
    assert any(p.startswith(expected) for p in problems), problems


def test_a_rollout_with_a_reference_for_its_quality_guards_is_accepted() -> None:
    """No baseline leg but a ratio above 0 (the primary behind canary answers), or a baseline
    leg whatever the ratio: both give the quality guards a reference."""
    parse_policy({**BASE, "rules": [_rollout_rule(0.1, [{"backend": "cand"}], {})]}, source="t")
    legs = [{"backend": "cand"}, {"backend": "base", "role": "baseline"}]
    parse_policy({**BASE, "rules": [_rollout_rule(0, legs, {})]}, source="t")


def test_a_temperature_override_is_refused_under_the_sampled_guard() -> None:
    raw = {**BASE, "rules": [_rollout_rule(0.1, [{"backend": "cand"}], {})]}
    problems = problems_of({**raw, "shaping": {"override_temperature": 0.0}})
    assert any(p.startswith("shaping.override_temperature:") for p in problems), problems
