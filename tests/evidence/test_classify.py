"""The cheap request classifier and the category precedence (header → policy → classifier)."""

from __future__ import annotations

from typing import Any

import pytest

from core.classify import RAG_MIN_CHARS, categorize, classify_request, request_traits


def chat(*contents: object, **extra: object) -> dict[str, Any]:
    roles = ["user", "assistant"]
    return {
        "messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)],
        **extra,
    }


TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {}}}]


@pytest.mark.parametrize(
    ("payload", "category"),
    [
        (chat("weather?", tools=TOOLS), "tool_call"),
        (chat("weather?", tools=TOOLS, tool_choice="none"), "chat"),
        (chat("give me json", response_format={"type": "json_object"}), "structured_output"),
        (
            chat("x", response_format={"type": "json_schema", "json_schema": {}}),
            "structured_output",
        ),
        (chat("x", response_format={"type": "text"}), "chat"),
        (chat("a" * (RAG_MIN_CHARS + 1)), "rag"),
        (chat("Sources: [1] foo [2] bar. Answer with citations."), "rag"),
        (chat("Context:\nThe sky is blue.\n\nQuestion: what colour?"), "rag"),
        (chat("Fix this:\n```python\nprint(1)\n```"), "code"),
        (chat("def f(x):\n    return x\nwhy does import fail"), "code"),
        (chat("hi", "hello!", "how are you?"), "multi_turn"),
        (chat("Solve for x: 3x + 2 = 11"), "math"),
        (chat("what is 12 * 7"), "math"),
        (chat("Tell me a story about a cat."), "chat"),
        ({"prompt": "Once upon a time"}, "chat"),
        ({"prompt": ["def main():", "    return 0;"]}, "code"),
        (chat([{"type": "text", "text": "Solve 2+2"}]), "math"),
    ],
)
def test_the_classifier_sorts_requests_by_documented_rules(payload, category):
    assert classify_request(payload) == category


def test_the_header_wins_over_the_policy_and_the_classifier():
    body = chat("x", tools=TOOLS)
    assert categorize("rag", body, policy_category="code") == ("rag", "header")
    assert categorize(None, body, policy_category="code") == ("code", "policy")
    assert categorize("  ", body) == ("tool_call", "classifier")
    assert categorize(None, None) == (None, "unknown")


def test_request_traits_count_users_and_see_json_mode():
    t = request_traits(chat("a", "b", "c", response_format={"type": "json_object"}))
    assert t.json_mode and not t.has_tools and t.user_messages == 2 and t.prompt_chars == 5


# A cost on the wall clock: the timing tier (docs/testing.md).
@pytest.mark.timing
def test_classifying_a_huge_prompt_stays_cheap():
    import time

    body = chat("word " * 2_000_000)
    started = time.perf_counter()
    assert classify_request(body) == "rag"
    assert time.perf_counter() - started < 1.0
