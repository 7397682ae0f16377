"""Build LegResults for comparison tests by feeding SSE bytes to the real StreamRecorder."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from core.exchange import CaptureSpec, Exchange, LegResult, ModelName, RequestId, Role
from core.recorder import StreamRecorder

MS = 1_000_000


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def leg(
    role: Role = "candidate",
    pieces: Sequence[str] = ("Hello", " world"),
    *,
    logprobs: bool = False,
    tool_calls: Sequence[tuple[str, str]] = (),
    finish: str = "stop",
    refusal: str | None = None,
    gap_ms: int = 5,
    ttft_ms: int = 20,
    outcome: str = "completed",
    metrics: dict[str, Any] | None = None,
    per_event: int = 1,
    usage: int | None = None,
    backend: str | None = None,
) -> LegResult:
    """A streamed chat leg: ``pieces`` as content deltas, ``per_event`` pieces per event;
    ``usage``: a final usage chunk with that many completion tokens (as ``include_usage`` asks)."""
    t0 = 10_000 * MS
    rec = StreamRecorder(t0_ns=t0)
    now = t0 + ttft_ms * MS
    rec.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), now)
    for start in range(0, len(pieces), per_event):
        group = list(pieces[start : start + per_event])
        choice: dict[str, Any] = {"index": 0, "delta": {"content": "".join(group)}}
        if logprobs:
            choice["logprobs"] = {"content": [{"token": p, "logprob": -0.1} for p in group]}
        rec.feed(sse({"choices": [choice]}), now)
        now += gap_ms * MS
    for i, (name, args) in enumerate(tool_calls):
        call = {
            "index": i,
            "id": f"c{i}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
        rec.feed(sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}), now)
        now += gap_ms * MS
    if refusal is not None:
        rec.feed(sse({"choices": [{"index": 0, "delta": {"refusal": refusal}}]}), now)
    final: dict[str, Any] = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    if metrics is not None:
        final["metrics"] = metrics
    rec.feed(sse(final), now)
    if usage is not None:
        rec.feed(
            sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}}), now
        )
    rec.feed(b"data: [DONE]\n\n", now)
    recording = rec.finish(outcome=outcome, status=200)  # type: ignore[arg-type]
    return LegResult(
        role=role,
        backend=backend or role,
        server_address="127.0.0.1:1",
        upstream_model="m",
        status=200,
        outcome=recording.outcome,
        error_type=None,
        recording=recording,
        started_unix_ns=1_700_000_000 * 10**9,
        t0_ns=t0,
        end_ns=now,
        inflight_at_dispatch=1,
    )


T = TypeVar("T")


def some(value: T | None) -> T:
    """``value``, asserting it is known (narrows Optional for mypy)."""
    assert value is not None
    return value


def exchange(
    i: int = 0,
    *,
    category: str | None = "chat",
    primary: LegResult | None = None,
    shadows: Sequence[LegResult] | None = None,
    capture: CaptureSpec | None = None,
    request_json: Mapping[str, Any] | None = None,
    started_unix_ns: int | None = None,
    temperature: float | None = 0.0,
) -> Exchange:
    """An Exchange of real recorder output: primary + candidate by default."""
    return Exchange(
        exchange_id=f"ex-{i:06d}",
        request_id=RequestId(f"req-{i:06d}"),
        route="chat",
        requested_model=ModelName("m"),
        stream=True,
        started_unix_ns=started_unix_ns if started_unix_ns is not None else time.time_ns(),
        temperature=temperature,
        seed=None,
        category=category,
        policy_generation=1,
        policy_rule="default",
        sampled=True,
        drop_reason=None,
        primary=primary if primary is not None else leg("primary"),
        shadows=tuple(shadows) if shadows is not None else (leg("candidate"),),
        request_json=request_json,
        capture=capture,
    )
