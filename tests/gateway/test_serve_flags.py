"""``specshadow serve``'s flags and variables for backend kinds, the warnings for flags that do
nothing, and the startup summary of a policy file — through the real parser and Settings."""

from __future__ import annotations

import argparse

import pytest

from gateway.settings import Settings, SettingsError
from policies.compile import load_policy
from specshadow.main import build_parser
from specshadow.serve import given, idle_flags, settings_from_args, summary


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_kinds_come_from_flags_or_variables_and_bad_ones_name_their_source():
    env = {
        "SPECSHADOW_SHADOW_URLS": "http://a:1,http://b:1",
        "SPECSHADOW_SHADOW_KINDS": "vllm,sim",
        "SPECSHADOW_BASELINE_KIND": "sglang",
    }
    settings = settings_from_args(parse("--primary-kind", "openai"), env)
    assert settings.shadow_kinds == ("vllm", "sim") and settings.baseline_kind == "sglang"
    assert settings.primary_kind == "openai"
    with pytest.raises(SettingsError) as bad:
        settings_from_args(parse(), {**env, "SPECSHADOW_BASELINE_KIND": "tgi"})
    assert bad.value.problems == [
        "SPECSHADOW_BASELINE_KIND: must be one of vllm, sglang, llamacpp, openai, sim, got 'tgi'"
    ]
    with pytest.raises(SettingsError) as count:
        settings_from_args(
            parse("--shadow", "http://a:1", "--shadow-kind", "vllm", "--shadow-kind", "sim"),
            {},
        )
    assert count.value.problems[0].startswith("--shadow-kind: give one kind for every shadow")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ((), {}, []),
        (("--shadow", "http://a:1", "--shadow-ratio", "0.1"), {}, []),
        (("--shadow-ratio", "0.1"), {},
         ["--shadow-ratio does nothing without --shadow or --baseline"]),
        ((), {"SPECSHADOW_SHADOW_RATIO": "0.1"},
         ["SPECSHADOW_SHADOW_RATIO does nothing without --shadow or --baseline"]),
        (("--shadow", "http://a:1", "--shadow-ratio", "0"), {},
         ["--shadow-ratio is 0: nothing is mirrored"]),
        (("--baseline-kind", "vllm"), {}, ["--baseline-kind does nothing without --baseline"]),
        (("--baseline", "http://b:1"), {},
         ["--baseline without --shadow: the baseline is mirrored, but there is no candidate for "
          "it to be the noise floor of"]),
        (("--policy", "p.yaml", "--shadow", "http://a:1", "--shadow-kind", "vllm"), {},
         ["--shadow, --shadow-kind do nothing with --policy: the policy file names the backends, "
          "their kinds and shares"]),
    ],
)  # fmt: skip
def test_flags_that_do_nothing(argv, env, expected):
    args = parse(*argv)
    settings = settings_from_args(args, env)
    assert idle_flags(settings, given(args, env)) == expected


def test_the_summary_of_a_policy_file_names_roles_kinds_and_shares(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\n"
        "backends:\n"
        "  prod: {url: 'http://prod:8000', kind: vllm, replicas: 4}\n"
        "  spec: {url: 'http://spec:8000', kind: vllm, replicas: 1}\n"
        "  base: {url: 'http://base:8000', kind: sglang}\n"
        "primary: prod\n"
        "rules:\n"
        "  - {name: code, match: {headers: {x-cat: [code]}}, ratio: load_matched,\n"
        "     legs: [{backend: spec, role: candidate}]}\n"
        "default: {ratio: 0.05, legs: [{backend: spec, role: candidate},\n"
        "                              {backend: base, role: baseline}]}\n"
    )
    settings = Settings(policy_path=str(path), store_path="r.sqlite", state_path="s.json")
    lines = summary(settings, load_policy(path), None)
    assert lines == [
        "primary prod at http://prod:8000: vllm (from the policy)",
        "shadow spec (candidate) at http://spec:8000: vllm (from the policy); mirrored 25 % of "
        "rule code (load_matched); 5 % of rule default",
        "shadow base (baseline) at http://base:8000: sglang (from the policy); mirrored 5 % of "
        "rule default",
        f"store r.sqlite; policy {path}; state s.json",
    ]


def test_an_embedded_gateway_keeps_the_stated_kinds() -> None:
    """``open_policy`` (the demo's, the tests' and an embedding's gateway) takes the kinds the
    settings state; what it is not told stays ``openai``."""
    from gateway.app import open_policy
    from gateway.settings import Settings

    one = Settings(
        primary_url="http://127.0.0.1:1",
        shadow_urls=("http://127.0.0.1:2", "http://127.0.0.1:3"),
        shadow_kinds=("vllm",),
        baseline_url="http://127.0.0.1:4",
        baseline_kind="sim",
    )
    kinds = {n: b.kind for n, b in open_policy(one).current.backends.items()}
    assert kinds == {"primary": "openai", "shadow-1": "vllm", "shadow-2": "vllm", "baseline": "sim"}
    each = Settings(
        primary_url="http://127.0.0.1:1",
        shadow_urls=("http://127.0.0.1:2", "http://127.0.0.1:3"),
        shadow_kinds=("sglang", "openai"),
    )
    kinds = {n: b.kind for n, b in open_policy(each).current.backends.items()}
    assert kinds == {"primary": "openai", "shadow-1": "sglang", "shadow-2": "openai"}


def test_the_pool_keepalive_comes_from_its_flag_or_variable_and_a_bad_one_names_its_source():
    assert Settings().upstream.keepalive_s == 4.0  # below vLLM's and SGLang's 5 s
    env = {"SPECSHADOW_UPSTREAM_KEEPALIVE_S": "2.5"}
    assert settings_from_args(parse(), env).upstream.keepalive_s == 2.5
    assert settings_from_args(parse("--keepalive", "1"), env).upstream.keepalive_s == 1.0
    with pytest.raises(SettingsError) as bad:
        settings_from_args(parse("--keepalive", "0"), env)
    assert bad.value.problems == ["--keepalive: must be positive, got 0.0"]
