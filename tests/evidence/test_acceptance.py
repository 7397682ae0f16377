"""Per-request acceptance from vLLM metrics and stream shape; buckets; pooled summaries."""

from __future__ import annotations

import pytest

from evidence.acceptance import leg_acceptance, summarize
from records.rules import concurrency_bucket, output_length_bucket
from tests.evidence.legs import leg

SPEC = {
    "speculative_decoding": {
        "mean_acceptance_length": 3.0,
        "draft_acceptance_rate": 0.5,
        "num_spec_steps": 4,
        "num_draft_tokens": 16,
        "num_accepted_draft_tokens": 8,
    }
}


def test_vllm_metrics_are_read_with_their_source():
    acc = leg_acceptance(leg(metrics=SPEC, pieces=["a"] * 12, logprobs=True).recording)
    assert acc.source == "vllm_metrics"
    assert (acc.mean_acceptance_length, acc.draft_acceptance_rate) == (3.0, 0.5)
    assert (acc.num_drafts, acc.num_draft_tokens, acc.num_accepted_tokens) == (4, 16, 8)


def test_rates_are_derived_from_counts_when_vllm_omits_them():
    spec = {
        "speculative_decoding": {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 10}
    }
    acc = leg_acceptance(leg(metrics=spec).recording)
    assert acc.mean_acceptance_length == 3.0 and acc.draft_acceptance_rate == 0.5


def test_stream_shape_estimates_tokens_per_pass_and_coverage():
    # 12 tokens in 4 events: 3 tokens per target pass; MAL 3 → every pass drafted
    acc = leg_acceptance(leg(pieces=["a"] * 12, per_event=3, logprobs=True, metrics=SPEC).recording)
    assert acc.tokens_per_pass == 3.0 and acc.tokens_per_pass_source == "stream_shape"
    assert acc.coverage == pytest.approx(1.0)
    half = leg_acceptance(
        leg(pieces=["a"] * 12, per_event=2, logprobs=True, metrics=SPEC).recording
    )
    assert half.coverage == pytest.approx(0.5)


def spec_with(accepted: int) -> dict[str, dict[str, int]]:
    return {"speculative_decoding": {"num_drafts": 4, "num_draft_tokens": 16,
                                     "num_accepted_tokens": accepted}}  # fmt: skip


@pytest.mark.parametrize(
    ("per_event", "accepted", "expected"),
    [
        # 12 tokens, 8 accepted: 4 passes. A loaded API server sent them as 2 events of 6; the
        # stream alone would say 6 tokens per pass, the engine's counts say 4 passes.
        (6, 8, (3.0, "engine_counts")),
        # Unmerged: 4 events, the same 4 passes: the stream's shape.
        (3, 8, (3.0, "stream_shape")),
        # The engine counted 10 accepted, 2 of them past the stop the output cut (12 − 10 = 2
        # passes, fewer than the 4 events the stream had): the events are the better bound.
        (3, 10, (3.0, "stream_shape")),
        # llama.cpp streams one event per token whatever it accepted: 12 events, 1.0, as before.
        (1, 8, (1.0, "stream_shape")),
    ],
)
def test_tokens_per_pass_takes_the_larger_of_two_lower_bounds_on_the_passes(
    per_event: int, accepted: int, expected: tuple[float, str]
) -> None:
    rec = leg(pieces=["a"] * 12, per_event=per_event, logprobs=True, metrics=spec_with(accepted))
    acc = leg_acceptance(rec.recording)
    assert (acc.tokens_per_pass, acc.tokens_per_pass_source) == expected
    # Coverage follows: every pass drafted (4 drafts in 4 passes) when the passes are right.
    if expected[0] == 3.0 and accepted == 8:
        assert acc.coverage == pytest.approx(1.0)


def test_estimated_token_counts_give_no_stream_shape():
    acc = leg_acceptance(leg(pieces=["abc"] * 8, per_event=2).recording)  # no usage, no logprobs
    assert acc.tokens_per_pass is None and acc.source is None
    assert leg_acceptance(None).mean_acceptance_length is None


@pytest.mark.parametrize(
    ("tokens", "bucket"),
    [
        (None, None),
        (0, "<64"),
        (63, "<64"),
        (64, "64-256"),
        (255, "64-256"),
        (256, "256-1024"),
        (1023, "256-1024"),
        (1024, ">=1024"),
    ],
)
def test_output_length_buckets(tokens, bucket):
    assert output_length_bucket(tokens) == bucket


@pytest.mark.parametrize(
    ("n", "bucket"), [(0, "1"), (1, "1"), (2, "2-4"), (16, "5-16"), (17, "17-64"), (65, ">64")]
)
def test_concurrency_buckets(n, bucket):
    assert concurrency_bucket(n) == bucket


def test_summaries_pool_counts_by_key_not_by_averaging_rates():
    a = leg_acceptance(leg(metrics=SPEC).recording)
    spec2 = {
        "speculative_decoding": {
            "num_spec_steps": 1,
            "num_draft_tokens": 4,
            "num_accepted_draft_tokens": 4,
        }
    }
    b = leg_acceptance(leg(metrics=spec2).recording)
    out = summarize([("code", a), ("code", b), ("chat", a)])
    assert out["code"].draft_acceptance_rate == pytest.approx(12 / 20)
    assert out["code"].mean_acceptance_length == pytest.approx(1 + 12 / 5)
    assert out["chat"].requests == 1 and out["chat"].draft_acceptance_rate == 0.5
