"""Response bodies shaped like vLLM's OpenAI server (pure): chunks, bodies, usage, metrics, errors.

Field order and null fields follow what vLLM 0.32 writes, so a client (or the gateway's recorder)
cannot tell the simulator from the real server by shape.

``return_token_ids: true`` (vLLM ≥ 0.10.2, chat and completions) adds the ids of
:mod:`simulator.tokens` where vLLM 0.32 puts them; without it nothing below changes:

- chat, whole: ``choices[0].token_ids`` (the output ids) after ``stop_reason``, and top-level
  ``prompt_token_ids`` after ``prompt_logprobs``.
- completions, whole: per choice ``token_ids`` after ``stop_reason`` and ``prompt_token_ids``
  after ``prompt_logprobs``.
- chat, streamed: the role chunk carries top-level ``prompt_token_ids`` (after ``usage`` when
  continuous usage is on; its choice has no ``token_ids``, as in vLLM); every output chunk's choice
  carries ``token_ids``, the ids of exactly the tokens that chunk's delta carries (one engine
  step's), after ``finish_reason`` / ``stop_reason``.
- completions, streamed: every chunk's choice carries ``stop_reason`` (``null``), then
  ``prompt_token_ids`` (the prompt's ids on the first chunk, ``null`` after), then ``token_ids``
  (that chunk's ids), as vLLM writes them.

So the streamed ``token_ids`` concatenate to the whole answer's, ``len`` of which is
``usage.completion_tokens``. The final usage-only chunk is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from simulator.plan import Plan
from simulator.request import SimRequest
from simulator.textgen import WORDS
from simulator.tokens import ids_of


def error_body(
    status: int, message: str, err_type: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _alternatives(token: str, logprob: float, n: int) -> list[tuple[str, float]]:
    """``n`` top candidates: the chosen token first, then lower-probability words."""
    others = [
        (" " + WORDS[(len(token) * 7 + i) % len(WORDS)], round(logprob - 1.5 * i, 4))
        for i in range(1, n)
    ]
    return [(token, logprob), *others]


def chat_logprobs(tokens: Sequence[str], logprobs: Sequence[float], top: int) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": p, "bytes": list(t.encode())}
                    for t, p in _alternatives(tok, lp, top)
                ]
                if top
                else [],
            }
            for tok, lp in zip(tokens, logprobs, strict=True)
        ]
    }


def completion_logprobs(
    tokens: Sequence[str], logprobs: Sequence[float], top: int, offset: int
) -> dict[str, Any]:
    offsets = []
    pos = offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": list(logprobs),
        "tokens": list(tokens),
        "top_logprobs": [
            dict(_alternatives(t, p, top)) for t, p in zip(tokens, logprobs, strict=True)
        ]
        if top
        else None,
    }


def tool_call_id(response_id: str) -> str:
    return f"chatcmpl-tool-{response_id.rsplit('-', 1)[-1][:32]}"


def chat_delta(plan: Plan, start: int, end: int, call_id: str) -> dict[str, Any]:
    """The ``delta`` for output tokens ``[start, end)``."""
    if plan.kind != "tool_call":
        return {"content": "".join(plan.tokens[start:end])}
    arguments = "".join(plan.tokens[max(start, 1) : end])
    function: dict[str, Any] = {}
    call: dict[str, Any] = {"index": 0}
    if start == 0:
        call = {"id": call_id, "type": "function", "index": 0}
        function["name"] = plan.tokens[0]
    function["arguments"] = arguments
    call["function"] = function
    return {"tool_calls": [call]}


def stream_chunk(
    request: SimRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    plan: Plan,
    start: int,
    end: int,
    finish_reason: str | None,
    call_id: str,
    role_only: bool = False,
) -> dict[str, Any]:
    """One output-bearing chunk (or the chat role chunk when ``role_only``)."""
    lp: Any = None
    if request.logprobs and not role_only:
        toks, lps = plan.tokens[start:end], plan.logprobs[start:end]
        lp = (
            chat_logprobs(toks, lps, request.top_logprobs)
            if request.route == "chat"
            else completion_logprobs(
                toks, lps, request.top_logprobs, len("".join(plan.tokens[:start]))
            )
        )
    if request.route == "chat":
        delta = (
            {"role": "assistant", "content": ""}
            if role_only
            else chat_delta(plan, start, end, call_id)
        )
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": "".join(plan.tokens[start:end]),
            "logprobs": lp,
            "finish_reason": finish_reason,
        }
        obj = "text_completion"
    if finish_reason is not None or (request.return_token_ids and request.route != "chat"):
        choice["stop_reason"] = None
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if request.return_token_ids:
        if request.route != "chat":
            choice["prompt_token_ids"] = list(request.prompt_ids) if start == 0 else None
        if not role_only:
            choice["token_ids"] = ids_of(plan.tokens[start:end])
        elif request.route == "chat":
            chunk["prompt_token_ids"] = list(request.prompt_ids)
    return chunk


def usage_chunk(
    request: SimRequest, *, response_id: str, created: int, model: str, plan: Plan
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if request.route == "chat" else "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(plan.prompt_tokens, len(plan.tokens)),
    }


def full_body(
    request: SimRequest, *, response_id: str, created: int, model: str, plan: Plan, call_id: str
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` / ``text_completion`` body."""
    lp: Any = None
    if request.route == "chat":
        if request.logprobs:
            lp = chat_logprobs(plan.tokens, plan.logprobs, request.top_logprobs)
        tool_calls: list[dict[str, Any]] = []
        content: str | None = plan.text
        if plan.kind == "tool_call":
            content = None
            tool_calls = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": plan.tool_name, "arguments": plan.arguments},
                }
            ]
        message = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": tool_calls,
            "reasoning_content": None,
        }
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lp}
        obj = "chat.completion"
    else:
        if request.logprobs:
            lp = completion_logprobs(plan.tokens, plan.logprobs, request.top_logprobs, 0)
        choice = {"index": 0, "text": plan.text, "logprobs": lp}
        obj = "text_completion"
    choice |= {"finish_reason": plan.finish_reason, "stop_reason": None}
    if request.return_token_ids:
        choice["token_ids"] = ids_of(plan.tokens)
    if request.route == "completions":
        choice["prompt_logprobs"] = plan.prompt_logprobs
        if request.return_token_ids:
            choice["prompt_token_ids"] = list(request.prompt_ids)
    body: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(plan.prompt_tokens, len(plan.tokens)),
    }
    if request.route == "chat":
        body |= {"service_tier": None, "system_fingerprint": None, "prompt_logprobs": None}
        if request.return_token_ids:
            body["prompt_token_ids"] = list(request.prompt_ids)
    return body


def request_metrics(
    plan: Plan,
    *,
    k: int,
    speculative: bool,
    arrival_ns: int,
    started_ns: int,
    step_ns: Sequence[int],
) -> dict[str, Any]:
    """vLLM's per-request ``metrics`` object, measured by the simulator's own clock.

    - ``time_to_first_token_ms``: arrival → first token emitted (queue and prefill included).
    - ``generation_time_ms``: arrival → last token emitted.
    - ``queue_time_ms``: arrival → left the queue.
    - ``mean_itl_ms``: first → last token over the decode steps (0 with one step).
    - ``tokens_per_second``: completion tokens / generation time.
    - ``speculative_decoding`` (speculative mode, when any step drafted): over drafting steps,
      ``mean_acceptance_length`` = 1 + accepted / drafting steps, ``draft_acceptance_rate`` =
      accepted / drafted, ``acceptance_histogram[i]`` = drafting steps that accepted i drafts.
    """
    first, last = step_ns[0], step_ns[-1]
    gen_ms = (last - arrival_ns) / 1e6
    out: dict[str, Any] = {
        "time_to_first_token_ms": round((first - arrival_ns) / 1e6, 3),
        "generation_time_ms": round(gen_ms, 3),
        "queue_time_ms": round((started_ns - arrival_ns) / 1e6, 3),
        "mean_itl_ms": round((last - first) / 1e6 / (len(step_ns) - 1), 3)
        if len(step_ns) > 1
        else 0.0,
        "tokens_per_second": round(len(plan.tokens) / (gen_ms / 1e3), 3) if gen_ms > 0 else 0.0,
    }
    drafting = [s for s in plan.steps if s.drafted]
    if speculative and drafting:
        accepted = sum(s.accepted for s in drafting)
        drafted = sum(s.drafted for s in drafting)
        histogram = [0] * (k + 1)
        for s in drafting:
            histogram[s.accepted] += 1
        out["speculative_decoding"] = {
            "mean_acceptance_length": round(1 + accepted / len(drafting), 6),
            "draft_acceptance_rate": round(accepted / drafted, 6),
            "acceptance_histogram": histogram,
            "num_spec_steps": len(drafting),
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": k,
        }
    return out
