"""llama.cpp's generated ids for the token tap: shadow legs ask for logprobs (llama.cpp sends ids
only there), the assembler keeps their ``id``s, and ids fewer than the leg's output tokens (a
speculating llama.cpp streams no logprobs for the drafted tokens it accepted) are not kept. The
tokenizer path (``/apply-template`` then ``/tokenize``) runs against the real server in
tests/llamacpp/test_counterfactual.py."""

from __future__ import annotations

import json
from typing import Any

from core.assemble import Assembler
from policies import LegPlan, parse_policy, shape_shadow_body

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def shaped(route: Any = "chat", body: dict[str, Any] = CHAT, kind: str = "llamacpp") -> Any:
    backends = {"l": {"url": "http://127.0.0.1:9001", "kind": kind}}
    raw = {"version": 1, "backends": backends, "counterfactual": {"tokenizer": "l"}}
    p = parse_policy(raw, source="t")
    assert p.shaping.token_ids
    return json.loads(
        shape_shadow_body(body, LegPlan("candidate", p.backends["l"], None), p.shaping, route=route)
    )


def test_a_llamacpp_chat_leg_is_asked_for_one_logprob_per_token_while_ids_are_wanted() -> None:
    body = shaped()
    assert (body["logprobs"], body["top_logprobs"]) == (True, 1)
    assert "return_token_ids" not in body  # vLLM's field: llama.cpp would not know it
    # The client's own logprobs request is left as it is; completions are not touched.
    assert shaped(body={**CHAT, "logprobs": True, "top_logprobs": 5})["top_logprobs"] == 5
    assert "logprobs" not in shaped(route="completions", body={"model": "m", "prompt": "x"})
    assert "logprobs" not in shaped(kind="openai")


def chunk(text: str, ids: list[int] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    if ids is not None:
        choice["logprobs"] = {"content": [{"id": i, "token": text, "logprob": -0.1,
                                           "top_logprobs": []} for i in ids]}  # fmt: skip
    return {"object": "chat.completion.chunk", "choices": [choice]}


def test_the_assembler_keeps_llamacpp_logprob_ids_in_order() -> None:
    a = Assembler()
    for obj in (chunk("a", [7]), chunk("b", None), chunk("cd", [8, 9])):
        a.on_object(obj, streaming=True)
    (choice,) = a.freeze()
    assert choice.token_ids == (7, 8, 9)  # the chunk without logprobs gave none
    assert choice.text == "abcd"
