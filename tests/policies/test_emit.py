"""policies.emit.policy_yaml: the one writer of policy YAML reads back as what it was given."""

from __future__ import annotations

from typing import Any

from policies.compile import parse_policy
from policies.emit import policy_yaml
from policies.parse import read_yaml
from specshadow.story import canary_policy, shadow_policy

URLS = {name: f"http://127.0.0.1:{i}" for i, name in
        enumerate(("primary", "baseline", "ngram-k4", "eagle3-k3"), start=1)}  # fmt: skip


def test_what_is_written_reads_back_as_the_same_mapping() -> None:
    policy: dict[str, Any] = {
        "version": 1,
        "backends": {"prod": {"url": "http://127.0.0.1:1", "kind": "vllm"}},
        "primary": "prod",
        "rules": [
            {
                # names YAML would read as a boolean, a number and nothing stay strings
                "name": "r1",
                "match": {"categories": ["no", "1.0", "null", "chat"]},
                "ratio": 0.25,
                "legs": ({"backend": "prod", "role": "candidate"},),
                "rollout": {"steps": (0.05, 1.0), "guards": {"tokens_per_event_min": None}},
            }
        ],
    }
    text = policy_yaml(policy, comments=["first", "", "third"])
    assert text.startswith("# first\n#\n# third\nversion: 1\n")
    assert "rules:\n  - name: r1\n" in text  # a block sequence indented as by hand
    back = read_yaml(text, source="t")
    assert back["rules"] == [
        {
            "name": "r1",
            "match": {"categories": ["no", "1.0", "null", "chat"]},
            "ratio": 0.25,
            "legs": [{"backend": "prod", "role": "candidate"}],
            "rollout": {"steps": [0.05, 1.0], "guards": {"tokens_per_event_min": None}},
        }
    ]


def test_the_demo_policies_are_valid_policies() -> None:
    shadow = parse_policy(read_yaml(shadow_policy(URLS, ratio=0.1), source="s"), source="s")
    assert shadow.primary is not None and shadow.primary.name == "primary"
    canary_text = canary_policy(URLS, {"ngram-k4": ["multi_turn", "code"]})
    canary = parse_policy(read_yaml(canary_text, source="c"), source="c")
    rule = canary.rules[0]
    assert rule.name == "ngram-k4" and rule.rollout is not None
    assert rule.rollout.stage == "canary"
