"""StreamRecorder: vLLM-shaped streams and bodies in, exact timings and assembled output out.

Times are injected (``received_ns``), so the arithmetic is asserted exactly.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.recorder import MAX_BODY_BYTES, StreamRecorder
from core.timings import Recording

T0 = 5_000_000_000  # an arbitrary perf_counter_ns origin
MS = 1_000_000


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_chunk(
    delta: dict[str, Any], *, finish: str | None = None, index: int = 0, **extra: Any
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [choice],
        **extra,
    }


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def record(feeds: list[tuple[bytes, int]], **kwargs: Any) -> Recording:
    recorder = StreamRecorder(t0_ns=T0, **kwargs)
    for chunk, at_ms in feeds:
        recorder.feed(chunk, T0 + at_ms * MS)
    return recorder.finish()


def plain_stream() -> list[tuple[bytes, int]]:
    """vLLM without speculation: role chunk, one token per chunk, finish, usage, [DONE]."""
    feeds = [(sse(chat_chunk({"role": "assistant", "content": ""})), 10)]
    for i, token in enumerate(["The", " cat", " sat", " down", "."]):
        feeds.append((sse(chat_chunk({"content": token})), 100 + 20 * i))
    feeds.append((sse(chat_chunk({"content": ""}, finish="stop")), 185))
    feeds.append(
        (sse({"id": "chatcmpl-1", "model": "tiny", "choices": [], "usage": usage(7, 5)}), 190)
    )
    feeds.append((DONE, 190))
    return feeds


def test_plain_stream_timings_follow_the_definitions_exactly() -> None:
    rec = record(plain_stream())
    t = rec.timings
    assert t.ttft_s == 0.1
    assert t.e2e_s == 0.18  # the finish and usage chunks do not extend e2e
    assert t.tpot_s == 0.02  # (180 - 100) ms / (5 - 1)
    assert t.chunk_gaps_s == (0.02, 0.02, 0.02, 0.02)
    assert (t.chunk_gap_p50_s, t.chunk_gap_p99_s, t.chunk_gap_max_s) == (0.02, 0.02, 0.02)
    assert t.tokens_per_event == 1.0
    assert t.overhead_p50_s is None  # no written_ns given


def test_plain_stream_is_assembled_with_usage_tokens() -> None:
    rec = record(plain_stream())
    assert rec.streaming and rec.done and rec.outcome == "completed"
    assert rec.parse_error is None and rec.error is None
    [choice] = rec.choices
    assert choice.text == "The cat sat down."
    assert choice.finish_reason == "stop"
    assert (rec.output_tokens, rec.tokens_source, rec.prompt_tokens) == (5, "usage", 7)
    assert (rec.output_events, rec.events, rec.chunks) == (5, 8, 9)
    assert [s.kind for s in rec.stamps] == ["role", *["output"] * 5, "other", "usage"]
    assert (rec.response_model, rec.response_id) == ("tiny", "chatcmpl-1")
    assert rec.bytes_received == sum(len(c) for c, _ in plain_stream())


def speculative_stream(*, final_usage: bool) -> list[tuple[bytes, int]]:
    """Continuous usage stats; a verification step emits several tokens per event."""
    feeds = [(sse(chat_chunk({"role": "assistant", "content": ""}, usage=usage(7, 0))), 10)]
    done = 0
    for i, (text, n) in enumerate([("a", 1), ("bcd", 3), ("ef", 2), ("ghij", 4)]):
        done += n
        feeds.append((sse(chat_chunk({"content": text}, usage=usage(7, done))), 50 + 30 * i))
    if final_usage:
        feeds.append((sse({"id": "chatcmpl-1", "choices": [], "usage": usage(7, done)}), 200))
    feeds.append((DONE, 200))
    return feeds


def test_speculative_stream_counts_tokens_per_event_from_continuous_usage() -> None:
    rec = record(speculative_stream(final_usage=False))
    assert (rec.output_tokens, rec.tokens_source) == (10, "continuous_usage")
    assert [s.tokens for s in rec.stamps if s.kind == "output"] == [1, 3, 2, 4]
    assert rec.timings.tokens_per_event == 2.5
    assert rec.timings.ttft_s == 0.05
    assert rec.timings.e2e_s == 0.14
    assert rec.timings.tpot_s == 0.01  # 90 ms / 9
    assert rec.choices[0].text == "abcdefghij"


def test_final_usage_chunk_wins_over_continuous_usage() -> None:
    rec = record(speculative_stream(final_usage=True))
    assert (rec.output_tokens, rec.tokens_source) == (10, "usage")
    assert rec.timings.e2e_s == 0.14  # the trailing usage-only chunk at 200 ms does not count
    assert rec.stamps[-1].kind == "usage"


def test_tool_call_deltas_are_merged_by_index() -> None:
    call0 = {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "get", "arguments": ""},
    }
    call1 = {
        "index": 1,
        "id": "call_b",
        "type": "function",
        "function": {"name": "put", "arguments": '{"k"'},
    }
    feeds = [
        (sse(chat_chunk({"role": "assistant", "content": None})), 5),
        (sse(chat_chunk({"tool_calls": [call0]})), 10),
        (sse(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]})), 20),
        (sse(chat_chunk({"tool_calls": [call1]})), 30),
        (sse(chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})), 40),
        (
            sse(
                chat_chunk(
                    {"tool_calls": [{"index": 1, "id": None, "function": {"arguments": ": 2}"}}]}
                )
            ),
            50,
        ),
        (sse(chat_chunk({}, finish="tool_calls")), 60),
        (DONE, 60),
    ]
    rec = record(feeds)
    [choice] = rec.choices
    assert [(t.index, t.id, t.type, t.name, t.arguments) for t in choice.tool_calls] == [
        (0, "call_a", "function", "get", '{"x": 1}'),
        (1, "call_b", "function", "put", '{"k": 2}'),
    ]
    assert choice.finish_reason == "tool_calls"
    assert rec.output_events == 5
    assert rec.timings.ttft_s == 0.01


def test_completions_stream_with_logprobs_counts_tokens_from_logprobs() -> None:
    def chunk(text: str, tokens: list[str], finish: str | None = None) -> bytes:
        logprobs = {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens)}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(
            {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice]}
        )

    rec = record(
        [
            (chunk("Hi", ["Hi"]), 30),
            (chunk(" there", [" th", "ere"]), 40),
            (chunk("", [], "length"), 41),
            (DONE, 41),
        ]
    )
    [choice] = rec.choices
    assert choice.text == "Hi there"
    assert choice.tokens == ("Hi", " th", "ere")
    assert choice.finish_reason == "length"
    assert (rec.output_tokens, rec.tokens_source) == (3, "logprobs")
    assert [s.tokens for s in rec.stamps] == [1, 2, 0]
    assert rec.timings.tpot_s == 0.005  # 10 ms / 2


def test_chat_logprobs_token_strings_are_kept() -> None:
    lp = {
        "content": [
            {"token": "A", "logprob": -0.5, "top_logprobs": []},
            {"token": "B", "logprob": -1.0, "top_logprobs": []},
        ]
    }
    chunk = chat_chunk({"content": "AB"})
    chunk["choices"][0]["logprobs"] = lp
    rec = record([(sse(chunk), 10), (DONE, 11)])
    assert rec.choices[0].tokens == ("A", "B")
    assert rec.stamps[0].tokens == 2


def test_reasoning_sent_under_both_names_is_not_doubled() -> None:
    feeds = [
        (sse(chat_chunk({"reasoning_content": "think", "reasoning": "think"})), 10),
        (sse(chat_chunk({"reasoning": " more"})), 20),
        (sse(chat_chunk({"content": "ok"})), 30),
    ]
    rec = record(feeds)
    assert rec.choices[0].reasoning == "think more"
    assert rec.choices[0].text == "ok"
    assert rec.output_events == 3


def test_refusal_deltas_are_output() -> None:
    rec = record(
        [
            (sse(chat_chunk({"refusal": "I can't"})), 10),
            (sse(chat_chunk({"refusal": " help."})), 20),
        ]
    )
    assert rec.choices[0].refusal == "I can't help."
    assert rec.output_events == 2


def test_choices_are_assembled_per_index() -> None:
    feeds = [
        (sse(chat_chunk({"content": "x"}, index=1)), 10),
        (sse(chat_chunk({"content": "a"}, index=0)), 20),
        (sse(chat_chunk({"content": "y"}, index=1, finish="stop")), 30),
    ]
    rec = record(feeds)
    assert [(c.index, c.text, c.finish_reason) for c in rec.choices] == [
        (0, "a", None),
        (1, "xy", "stop"),
    ]


def test_without_usage_or_logprobs_tokens_are_estimated_from_characters() -> None:
    feeds = [(sse(chat_chunk({"content": "x" * 30})), 10), (sse(chat_chunk({"content": "y"})), 20)]
    rec = record(feeds)
    assert (rec.output_tokens, rec.tokens_source) == (8, "estimated")  # ceil(31 / 4)
    short = record(
        [(sse(chat_chunk({"content": "a"})), 10), (sse(chat_chunk({"content": "b"})), 20)]
    )
    assert (short.output_tokens, short.tokens_source) == (2, "estimated")  # at least one per event


def test_error_event_mid_stream_is_recorded_and_output_kept() -> None:
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    rec = record(
        [(sse(chat_chunk({"content": "par"})), 10), (sse(error), 20)],
    )
    assert rec.error == error["error"]
    assert rec.choices[0].text == "par"
    assert [s.kind for s in rec.stamps] == ["output", "error"]
    assert not rec.done
    assert rec.parse_error is None


def test_flat_vllm_error_object_is_recorded() -> None:
    flat = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    assert record([(sse(flat), 10)]).error == flat


def test_malformed_json_event_sets_parse_error_and_the_rest_is_still_recorded() -> None:
    feeds = [
        (sse(chat_chunk({"content": "a"})), 10),
        (b"data: {not json\n\n", 15),
        (sse(chat_chunk({"content": "b"})), 20),
        (sse({"id": "chatcmpl-1", "choices": [], "usage": usage(3, 2)}) + DONE, 30),
    ]
    rec = record(feeds)
    assert rec.parse_error is not None and rec.parse_error.startswith("event 2: invalid JSON")
    assert rec.choices[0].text == "ab"
    assert (rec.output_tokens, rec.tokens_source) == (2, "usage")
    assert [s.kind for s in rec.stamps] == ["output", "other", "output", "usage"]
    assert rec.done


@pytest.mark.parametrize(
    "payload",
    [
        b"[1, 2]",
        b'{"choices": "nope"}',
        b'{"choices": [{"index": "0", "delta": {"content": "x"}}]}',
        b'{"choices": [{"delta": "text"}]}',
        b'{"choices": [{"delta": {"tool_calls": [{"index": [1]}]}}]}',
        b'{"choices": [{"delta": {"content": "x"}, "logprobs": {"content": [1]}}]}',
    ],
)
def test_events_of_unexpected_shape_set_parse_error_without_losing_later_events(
    payload: bytes,
) -> None:
    rec = record(
        [(b"data: " + payload + b"\n\n", 10), (sse(chat_chunk({"content": "ok"})), 20), (DONE, 20)]
    )
    assert rec.parse_error is not None
    assert rec.choices[-1].text.endswith("ok")
    assert rec.done


def test_event_time_is_the_chunk_that_completed_it() -> None:
    wire = sse(chat_chunk({"content": "hello"}))
    rec = record([(wire[:20], 10), (wire[20:-1], 30), (wire[-1:], 70)])
    assert rec.timings.ttft_s == 0.07
    assert rec.chunks == 3


def test_several_events_in_one_read_share_its_time() -> None:
    two = sse(chat_chunk({"content": "a"})) + sse(chat_chunk({"content": "b"}))
    rec = record([(two, 40), (sse(chat_chunk({"content": "c"})), 50)])
    assert rec.timings.chunk_gaps_s == (0.0, 0.01)
    assert rec.output_events == 3


def test_cut_stream_is_not_an_error_but_is_not_done() -> None:
    recorder = StreamRecorder(t0_ns=T0)
    recorder.feed(sse(chat_chunk({"content": "a"})), T0 + 10 * MS)
    recorder.feed(b'data: {"choi', T0 + 20 * MS)
    rec = recorder.finish(outcome="upstream_error")
    assert (rec.outcome, rec.done, rec.parse_error) == ("upstream_error", False, None)
    assert recorder.incomplete_at_eof
    assert rec.choices[0].text == "a"


def test_vllm_per_request_metrics_are_kept_verbatim() -> None:
    metrics = {"spec_decode": {"num_drafts": 4, "num_accepted_tokens": 6, "acceptance_length": 2.5}}
    feeds = [
        (sse(chat_chunk({"content": "a"})), 10),
        (sse(chat_chunk({}, finish="stop", metrics=metrics)), 20),
    ]
    assert record(feeds).vllm_metrics == metrics


def test_non_streaming_chat_body() -> None:
    body = json.dumps(
        {
            "id": "chatcmpl-9",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "Hello",
                        "reasoning_content": "hmm",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": usage(4, 6),
            "metrics": {"ttft_s": 0.01},
        }
    ).encode()
    rec = record([(body[:50], 100), (body[50:], 250)], content_type="application/json")
    assert not rec.streaming
    assert rec.timings.ttft_s is None and rec.timings.tpot_s is None
    assert rec.timings.e2e_s == 0.25
    assert rec.timings.chunk_gaps_s == () and rec.timings.chunk_gap_p50_s is None
    [choice] = rec.choices
    assert (choice.text, choice.reasoning, choice.finish_reason) == ("Hello", "hmm", "tool_calls")
    assert [(t.index, t.id, t.name, t.arguments) for t in choice.tool_calls] == [
        (0, "c1", "f", "{}")
    ]
    assert (rec.output_tokens, rec.tokens_source, rec.output_events, rec.events) == (
        6,
        "usage",
        1,
        1,
    )
    assert rec.timings.tokens_per_event == 6.0
    assert rec.vllm_metrics == {"ttft_s": 0.01}
    assert rec.response_id == "chatcmpl-9"
    assert rec.stamps[0].tokens == 6


def test_non_streaming_completions_body() -> None:
    body = {
        "id": "cmpl-2",
        "model": "tiny",
        "choices": [{"index": 0, "text": "abc", "finish_reason": "stop", "logprobs": None}],
    }
    rec = record([(json.dumps(body).encode(), 80)], content_type=None)
    assert rec.choices[0].text == "abc"
    assert (rec.output_tokens, rec.tokens_source) == (1, "estimated")
    assert rec.timings.e2e_s == 0.08


def test_non_streaming_error_body() -> None:
    body = {"error": {"message": "model not found", "type": "NotFoundError", "code": 404}}
    rec = StreamRecorder(t0_ns=T0, content_type="application/json")
    rec.feed(json.dumps(body).encode(), T0 + MS)
    result = rec.finish(outcome="upstream_status", status=404)
    assert result.error == body["error"]
    assert result.output_events == 0 and result.output_tokens is None


@pytest.mark.parametrize(("status", "flagged"), [(502, False), (200, True), (None, True)])
def test_non_json_body_is_a_parse_error_only_when_not_an_error_status(
    status: int | None, flagged: bool
) -> None:
    rec = StreamRecorder(t0_ns=T0, content_type="text/html")
    rec.feed(b"<html>Bad Gateway</html>", T0 + MS)
    assert (rec.finish(status=status).parse_error is not None) is flagged


def test_oversized_body_is_not_parsed() -> None:
    rec = StreamRecorder(t0_ns=T0, content_type="application/json")
    piece = b" " * (4 * 1024 * 1024)
    for i in range(MAX_BODY_BYTES // len(piece) + 1):
        rec.feed(piece, T0 + i)
    result = rec.finish()
    assert result.parse_error is not None and "exceeds" in result.parse_error
    assert result.bytes_received > MAX_BODY_BYTES


def test_overhead_summarises_written_minus_received() -> None:
    recorder = StreamRecorder(t0_ns=T0)
    for i, overhead_us in enumerate([10, 20, 30, 40, 1000]):
        received = T0 + (i + 1) * MS
        recorder.feed(sse(chat_chunk({"content": "x"})), received, received + overhead_us * 1000)
    t = recorder.finish().timings
    assert t.overhead_p50_s == 30e-6
    assert t.overhead_max_s == 1000e-6
    assert t.overhead_p99_s == pytest.approx((40 + 0.96 * 960) * 1e-6)


def test_stamps_are_bounded_but_summaries_use_every_event() -> None:
    recorder = StreamRecorder(t0_ns=T0, max_stamps=3)
    for i in range(10):
        at = T0 + (i + 1) * MS * (2 if i == 9 else 1)  # the last gap is 11 ms
        recorder.feed(sse(chat_chunk({"content": "x"})), at, at + 1)
    rec = recorder.finish()
    assert len(rec.stamps) == 3 and rec.stamps_truncated
    assert len(rec.timings.chunk_gaps_s) == 3
    assert rec.timings.chunk_gap_max_s == 0.011
    assert rec.output_events == 10


def test_finish_is_idempotent_and_later_feeds_are_ignored() -> None:
    recorder = StreamRecorder(t0_ns=T0)
    recorder.feed(sse(chat_chunk({"content": "a"})), T0 + MS)
    first = recorder.finish()
    recorder.feed(sse(chat_chunk({"content": "b"})), T0 + 2 * MS)
    assert recorder.finish(outcome="cancelled") is first
    assert first.choices[0].text == "a"


def test_live_peeks_track_the_stream() -> None:
    recorder = StreamRecorder(t0_ns=T0)

    def peek() -> tuple[int, int | None]:
        return recorder.output_events, recorder.ttft_ns

    assert peek() == (0, None)
    recorder.feed(sse(chat_chunk({"role": "assistant", "content": ""})), T0 + MS)
    assert peek() == (0, None)
    recorder.feed(sse(chat_chunk({"content": "a"})), T0 + 3 * MS)
    recorder.feed(sse(chat_chunk({"content": "b"})), T0 + 4 * MS)
    assert peek() == (2, 3 * MS)
    assert not recorder.done
    recorder.feed(DONE, T0 + 5 * MS)
    assert recorder.done


def test_one_output_token_has_no_tpot() -> None:
    rec = record(
        [(sse(chat_chunk({"content": "a"})), 10), (sse({"choices": [], "usage": usage(1, 1)}), 20)]
    )
    assert rec.output_tokens == 1
    assert rec.timings.tpot_s is None
    assert rec.timings.ttft_s == rec.timings.e2e_s == 0.01


def test_empty_stream_records_nothing_and_does_not_fail() -> None:
    rec = StreamRecorder(t0_ns=T0).finish(outcome="upstream_timeout")
    assert (rec.events, rec.chunks, rec.output_tokens, rec.parse_error) == (0, 0, None, None)
    assert rec.timings.e2e_s is None


def test_tool_call_fields_of_the_wrong_type_are_dropped() -> None:
    call = {"index": 0, "id": 7, "type": None, "function": {"name": ["f"], "arguments": "{}"}}
    rec = record([(sse(chat_chunk({"tool_calls": [call]})), 10)])
    [tool] = rec.choices[0].tool_calls
    assert (tool.id, tool.type, tool.name, tool.arguments) == (None, None, None, "{}")
    assert rec.tokens_source == "estimated"


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"[1]", "body: JSON is not an object"), (b'{"choices": [7]}', "body: unexpected shape")],
)
def test_json_bodies_of_unexpected_shape_set_parse_error(body: bytes, message: str) -> None:
    rec = record([(body, 10)], content_type="application/json")
    assert rec.parse_error is not None
    assert rec.parse_error.startswith(message)


def test_error_that_is_not_an_object_is_wrapped() -> None:
    assert record([(sse({"error": "boom"}), 10)]).error == {"message": "boom"}


def test_a_chunk_of_the_wrong_type_is_recorded_not_raised() -> None:
    recorder = StreamRecorder(t0_ns=T0)
    recorder.feed(sse(chat_chunk({"content": "a"})), T0 + MS)
    recorder.feed("data: not bytes\n\n", T0 + 2 * MS)  # type: ignore[arg-type]
    recorder.feed(sse(chat_chunk({"content": "b"})), T0 + 3 * MS)  # decoding stopped; counted
    rec = recorder.finish()
    assert rec.parse_error is not None
    assert rec.parse_error.startswith("recorder failed: TypeError")
    assert rec.choices[0].text == "a"
    assert rec.chunks == 3


def test_finish_never_raises_even_when_building_fails() -> None:
    recorder = StreamRecorder(t0_ns=None)  # type: ignore[arg-type]
    recorder.feed(sse(chat_chunk({"content": "a"})), T0 + MS)
    rec = recorder.finish(outcome="completed")
    assert rec.parse_error is not None
    assert rec.parse_error.startswith("recorder failed: TypeError")
    assert (rec.outcome, rec.chunks, rec.output_events, rec.choices) == ("completed", 1, 1, ())
    assert recorder.finish() is rec


def test_invalid_utf8_inside_an_event_is_replaced_like_the_spec_says() -> None:
    rec = record([(b'data: {"choices": [{"index": 0, "delta": {"content": "a\xffb"}}]}\n\n', 10)])
    assert rec.parse_error is None
    assert rec.choices[0].text == "a\ufffdb"
