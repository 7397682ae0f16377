"""The recorder on Responses API streams and bodies, and on every engine's per-request
speculative statistics — fed bytes as the engines write them, read back as acceptance."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.timings import Recording
from evidence.acceptance import leg_acceptance
from tests.core.test_timings import DONE, MS, chat_chunk, record, sse, usage


def ev(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def response(status: str, **fields: Any) -> dict[str, Any]:
    return {"id": "resp_9", "object": "response", "model": "m", "status": status, **fields}


def test_acknowledgements_are_not_output_and_reasoning_deltas_are() -> None:
    rec = record(
        [
            (ev("response.created", response=response("in_progress")), 1),
            (ev("response.in_progress", response=response("in_progress")), 2),
            (ev("response.output_item.added", output_index=0, item={"type": "reasoning"}), 3),
            (ev("response.reasoning_text.delta", output_index=0, delta="Let me think"), 40),
            (ev("response.reasoning_summary_text.delta", output_index=0, delta=" — short"), 50),
            (ev("response.output_text.delta", output_index=1, delta="42"), 90),
            (ev("response.output_text.done", output_index=1, text="42"), 91),
            (
                ev(
                    "response.completed",
                    response=response("completed", usage={"input_tokens": 4, "output_tokens": 9}),
                ),
                95,
            ),
        ]
    )
    assert rec.timings.ttft_s == pytest.approx(40 * MS / 1e9)  # the first reasoning delta
    assert rec.timings.e2e_s == pytest.approx(90 * MS / 1e9)  # the last output, not completed
    assert rec.output_events == 3 and rec.events == 8
    choice = rec.choices[0]
    assert (choice.text, choice.reasoning) == ("42", "Let me think — short")
    assert (rec.output_tokens, rec.prompt_tokens, rec.tokens_source) == (9, 4, "usage")
    assert rec.done and rec.response_id == "resp_9" and rec.response_model == "m"
    assert rec.usage is not None and rec.usage["responses_usage"]["output_tokens"] == 9


def test_incomplete_and_failed_responses() -> None:
    cut = record(
        [
            (ev("response.output_text.delta", delta="a b"), 5),
            (
                ev(
                    "response.incomplete",
                    response=response(
                        "incomplete",
                        incomplete_details={"reason": "max_output_tokens"},
                        usage={"input_tokens": 1, "output_tokens": 2},
                    ),
                ),
                6,
            ),
        ]
    )
    assert cut.done and cut.choices[0].finish_reason == "length" and cut.error is None
    failed = record(
        [
            (ev("response.created", response=response("in_progress")), 1),
            (ev("error", error={"code": "server_error", "message": "boom"}), 2),
            (ev("response.failed", response=response("failed", error={"code": "x"})), 3),
        ]
    )
    assert failed.done and failed.error == {"code": "server_error", "message": "boom"}
    assert failed.output_events == 0 and failed.timings.ttft_s is None
    flat = record([(ev("error", code="rate_limit", message="slow down"), 1)])
    assert flat.error == {"code": "rate_limit", "message": "slow down"}  # the SDK's flat shape


def test_function_call_arguments_are_merged_per_output_item() -> None:
    item = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": ""}
    rec = record(
        [
            (ev("response.output_item.added", output_index=0, item=item), 1),
            (ev("response.function_call_arguments.delta", output_index=0, delta='{"q":'), 20),
            (ev("response.function_call_arguments.delta", output_index=0, delta=' "x"}'), 30),
            (ev("response.completed", response=response("completed")), 31),
        ]
    )
    (call,) = rec.choices[0].tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "lookup", '{"q": "x"}')
    assert rec.timings.ttft_s == pytest.approx(20 * MS / 1e9)
    assert rec.choices[0].finish_reason == "tool_calls"


def test_a_non_streaming_response_body() -> None:
    body = response(
        "completed",
        output=[
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
            {
                "type": "message",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ],
        usage={"input_tokens": 3, "output_tokens": 6, "total_tokens": 9},
        metrics={"speculative_decoding": {"num_spec_steps": 2, "num_accepted_draft_tokens": 3}},
    )
    rec = record([(json.dumps(body).encode(), 50)], content_type="application/json")
    choice = rec.choices[0]
    assert (choice.text, choice.reasoning, choice.tool_calls[0].name) == ("Hello", "hmm", "f")
    assert rec.output_tokens == 6 and rec.timings.e2e_s == pytest.approx(0.05)
    assert leg_acceptance(rec).mean_acceptance_length == 2.5  # 1 + 3 accepted / 2 steps


# -- acceptance from any engine ------------------------------------------------------------------


def stream(final: dict[str, Any], *, chunks: int = 4, per: int = 3) -> Recording:
    feeds = [(sse(chat_chunk({"content": "ab" * per})), 10 * (i + 1)) for i in range(chunks)]
    return record([*feeds, (sse(final), 100), (DONE, 100)])


def test_vllm_top_level_metrics_on_the_usage_chunk() -> None:
    spec = {"num_spec_steps": 6, "num_accepted_draft_tokens": 9, "num_draft_tokens": 24}
    final = {"choices": [], "usage": usage(5, 12), "metrics": {"speculative_decoding": spec}}
    acc = leg_acceptance(stream(final))
    assert acc.source == "vllm_metrics"
    assert (acc.mean_acceptance_length, acc.draft_acceptance_rate) == (2.5, 9 / 24)
    assert acc.tokens_per_pass == 3.0  # 12 tokens in 4 events


def test_vllm_earlier_per_choice_stats_on_the_terminal_chunk() -> None:
    stats = {
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.375,
        "acceptance_histogram": {"0": 2, "1": 1, "3": 3},  # the sparse form of that revision
        "num_spec_steps": 6,
        "num_accepted_draft_tokens": 9,
        "num_draft_tokens": 24,
    }
    terminal = chat_chunk({}, finish="stop", usage=usage(5, 12))
    terminal["choices"][0]["speculative_decoding_stats"] = stats
    acc = leg_acceptance(stream(terminal))
    assert acc.source == "choice_stats"
    assert (acc.num_drafts, acc.num_draft_tokens, acc.num_accepted_tokens) == (6, 24, 9)
    assert acc.mean_acceptance_length == 2.5


def test_tensorrt_llm_names_derive_the_length() -> None:
    stats = {"total_accepted_draft_tokens": 8, "total_draft_tokens": 12, "num_spec_steps": 4}
    terminal = chat_chunk({}, finish="stop", usage=usage(5, 12))
    terminal["choices"][0]["speculative_decoding"] = stats
    acc = leg_acceptance(stream(terminal))
    assert acc.source == "choice_stats"
    assert (acc.mean_acceptance_length, acc.draft_acceptance_rate) == (3.0, 8 / 12)


@pytest.mark.parametrize(
    "meta",
    [
        {
            "spec_verify_ct": 10,
            "spec_accept_length": 3.0,
            "spec_accept_rate": 20 / 30,
            "spec_accept_token_num": 20,
            "spec_draft_token_num": 30,
        },
        {"spec_verify_ct": 10, "spec_num_correct_drafts": 20, "spec_num_proposed_drafts": 30},
        {"spec_verify_ct": 10, "spec_accepted_drafts": 20, "spec_proposed_drafts": 30},
    ],
)
def test_sglang_meta_info_in_every_version(meta: dict[str, Any]) -> None:
    """SGLang's ``return_meta_info`` answer (non-streaming only): counts under ``meta_info``."""
    body = {
        "id": "x",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "w" * 60},
                "finish_reason": "stop",
                "meta_info": {"completion_tokens": 30, "e2e_latency": 0.4, **meta},
            }
        ],
        "usage": usage(5, 30),
    }
    rec = record([(json.dumps(body).encode(), 40)], content_type="application/json")
    acc = leg_acceptance(rec)
    assert acc.source == "sglang_meta_info"
    assert (acc.num_drafts, acc.num_draft_tokens, acc.num_accepted_tokens) == (10, 30, 20)
    assert acc.mean_acceptance_length == pytest.approx(3.0)
    assert acc.draft_acceptance_rate == pytest.approx(20 / 30)


def test_prediction_token_usage_is_a_rate_and_zeros_say_nothing() -> None:
    details = {"accepted_prediction_tokens": 12, "rejected_prediction_tokens": 4}
    final = {"choices": [], "usage": {**usage(5, 12), "completion_tokens_details": details}}
    acc = leg_acceptance(stream(final))
    assert acc.source == "usage_prediction_tokens"
    assert acc.draft_acceptance_rate == 0.75 and acc.num_draft_tokens == 16
    assert acc.mean_acceptance_length is None and acc.num_drafts is None  # no step count
    zeros = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    plain = {"choices": [], "usage": {**usage(5, 12), "completion_tokens_details": zeros}}
    assert leg_acceptance(stream(plain)).source is None


def test_vllm_metrics_win_over_other_reports() -> None:
    details = {"accepted_prediction_tokens": 1, "rejected_prediction_tokens": 1}
    final = {
        "choices": [],
        "usage": {**usage(5, 12), "completion_tokens_details": details},
        "metrics": {"speculative_decoding": {"num_spec_steps": 4, "num_accepted_draft_tokens": 8}},
    }
    assert leg_acceptance(stream(final)).source == "vllm_metrics"
