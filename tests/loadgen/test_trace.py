"""Trace reading: extras are stripped, routes detected, bad lines named."""

from __future__ import annotations

import json

import pytest

from loadgen.client import RequestSettings, prepare_body
from loadgen.trace import TraceError, bundled_trace, parse_trace_text, read_trace, trace_records


def test_extras_are_stripped_and_kept_beside_the_body(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "timestamp": 5,
         "category": "chat", "meta": {"id": "x"}},
        {},
        {"model": "m", "prompt": "once upon"},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) if r else "" for r in rows) + "\n")
    records = read_trace(path)
    assert len(records) == 2
    chat, comp = records
    assert chat.route == "chat" and comp.route == "completions"
    assert set(chat.body) == {"model", "messages"}
    assert chat.timestamp_s == 5.0 and chat.category == "chat" and chat.meta == {"id": "x"}
    assert comp.index == 1 and comp.timestamp_s is None and comp.category is None


def test_the_bundled_trace_has_120_categorised_chat_rows():
    records = bundled_trace()
    assert len(records) == 120
    assert {r.category for r in records} == {"chat", "multi_turn", "structured_output"}
    assert all("category" not in r.body and "meta" not in r.body for r in records)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1]", "expected a JSON object"),
        ('{"model": "m"}', "neither 'messages'"),
        ('{"prompt": "x", "timestamp": "noon"}', "'timestamp' must be a number"),
        ('{"prompt": "x", "category": 3}', "'category' must be a string"),
        ('{"prompt": "x", "meta": []}', "'meta' must be an object"),
        ("{nope", "invalid JSON"),
    ],
)
def test_bad_lines_are_named(line, message):
    with pytest.raises(TraceError, match=f"trace line 2: {message}"):
        parse_trace_text('{"prompt": "ok"}\n' + line)


def test_records_and_dicts_can_be_mixed_and_are_reindexed():
    first = bundled_trace()[3]
    records = trace_records([{"prompt": "a", "category": "c"}, first])
    assert records[0].category == "c" and records[1].index == 1
    assert records[1].body == first.body and records[1].category == first.category


def test_the_sent_body_applies_overrides_and_never_carries_extras():
    record = trace_records([{"model": "m", "messages": [], "max_completion_tokens": 9,
                             "category": "chat", "stream_options": {"x": 1}}])[0]  # fmt: skip
    streamed = json.loads(prepare_body(record, RequestSettings("u", model="n", max_tokens=4)))
    assert streamed == {"model": "n", "messages": [], "max_tokens": 4, "stream": True,
                        "stream_options": {"x": 1, "include_usage": True}}  # fmt: skip
    plain = json.loads(prepare_body(record, RequestSettings("u", stream=False)))
    assert plain["stream"] is False and "stream_options" not in plain and "category" not in plain
