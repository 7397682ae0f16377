"""Hand-built Exchange / LegResult / Recording values for telemetry tests (no recorder involved)."""

from __future__ import annotations

from typing import Any

from core.exchange import Exchange, LegResult, ModelName, RequestId, Role
from core.timings import (
    ChoiceOutput,
    EventKind,
    EventStamp,
    Recording,
    StreamOutcome,
    StreamTimings,
)

T0_NS = 1_000_000_000
STARTED_UNIX_NS = 1_700_000_000_000_000_000


def make_timings(**overrides: Any) -> StreamTimings:
    values: dict[str, Any] = {
        "ttft_s": 0.02,
        "e2e_s": 0.05,
        "tpot_s": 0.003,
        "chunk_gaps_s": (0.002, 0.004, 0.006),
        "chunk_gap_p50_s": 0.004,
        "chunk_gap_p90_s": 0.006,
        "chunk_gap_p99_s": 0.006,
        "chunk_gap_max_s": 0.006,
        "tokens_per_event": 2.5,
        "overhead_p50_s": 0.00004,
        "overhead_p99_s": 0.0002,
        "overhead_max_s": 0.0003,
    }
    values.update(overrides)
    return StreamTimings(**values)


def make_recording(
    *,
    text: str = "Hello world",
    outcome: StreamOutcome = "completed",
    timings: StreamTimings | None = None,
    vllm_metrics: dict[str, Any] | None = None,
    output_tokens: int | None = 10,
    prompt_tokens: int | None = 7,
) -> Recording:
    events: tuple[tuple[int, EventKind, int | None], ...] = (
        (5, "role", None),
        (20, "output", 3),
        (22, "output", 2),
        (26, "output", 3),
        (50, "output", 2),
        (51, "usage", None),
    )
    stamps = tuple(
        EventStamp(received_ns=T0_NS + ms * 1_000_000, kind=kind, tokens=tokens)
        for ms, kind, tokens in events
    )
    return Recording(
        streaming=True,
        outcome=outcome,
        timings=timings or make_timings(),
        output_tokens=output_tokens,
        tokens_source="usage",
        prompt_tokens=prompt_tokens,
        output_events=4,
        events=6,
        chunks=6,
        bytes_received=900,
        done=True,
        choices=(ChoiceOutput(0, text, "", (), "stop", None, None),),
        usage={"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens},
        vllm_metrics=vllm_metrics,
        response_model="tiny-llama",
        response_id="chatcmpl-1",
        error=None,
        parse_error=None,
        stamps=stamps,
        stamps_truncated=False,
    )


def make_leg(
    role: Role = "primary",
    *,
    backend: str | None = None,
    outcome: StreamOutcome = "completed",
    status: int | None = 200,
    error_type: str | None = None,
    recording: Recording | None = None,
    with_recording: bool = True,
) -> LegResult:
    rec = (
        recording
        if recording is not None
        else (make_recording(outcome=outcome) if with_recording else None)
    )
    return LegResult(
        role=role,
        backend=backend or role,
        server_address="127.0.0.1:8000",
        upstream_model="tiny-llama",
        status=status,
        outcome=outcome,
        error_type=error_type,
        recording=rec,
        started_unix_ns=STARTED_UNIX_NS,
        t0_ns=T0_NS,
        end_ns=T0_NS + 60_000_000,
        inflight_at_dispatch=0,
    )


SPEC_METRICS = {
    "speculative_decoding": {
        "mean_acceptance_length": 3.9,
        "draft_acceptance_rate": 0.61,
        "num_drafts": 12,
    }
}


def make_exchange(
    *, shadows: tuple[LegResult, ...] | None = None, category: str | None = "chat"
) -> Exchange:
    if shadows is None:
        shadows = (
            make_leg(
                "candidate",
                backend="vllm-ngram",
                recording=make_recording(vllm_metrics=SPEC_METRICS),
            ),
            make_leg("baseline", backend="vllm-plain"),
        )
    return Exchange(
        exchange_id="ex-1",
        request_id=RequestId("req-1"),
        route="chat",
        requested_model=ModelName("tiny-llama"),
        stream=True,
        started_unix_ns=STARTED_UNIX_NS,
        temperature=0.0,
        seed=None,
        category=category,
        policy_generation=3,
        policy_rule="mirror-all",
        sampled=True,
        drop_reason=None,
        primary=make_leg("primary", backend="primary"),
        shadows=shadows,
        request_json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
        },
    )
