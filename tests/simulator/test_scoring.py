"""simulator.scoring: prompt_logprobs over a chat prompt + an answer are the model's own."""

from __future__ import annotations

from typing import Any

from core import jsonx
from simulator.config import SimConfig
from simulator.drafter import prompt_logprobs
from simulator.plan import plan_completion
from simulator.request import parse_request
from simulator.sampling import model_for, parse_text, sequence_logprobs
from simulator.scoring import FLOOR, split_chat
from simulator.tokens import chat_ids, ids_of, text_ids

CONFIG = SimConfig(model="sim-model", sampling=True, max_output_tokens=40)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief.\nVery brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi. What now?"},
    {"role": "user", "content": "Tell me more about item 42, please."},
]


def scored(prompt: list[int]) -> list[Any]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0}  # fmt: skip
    plan = plan_completion(CONFIG, parse_request("completions", jsonx.dumps(body), CONFIG), "chat")
    assert plan.prompt_logprobs is not None
    return plan.prompt_logprobs


def test_a_multi_turn_answer_is_scored_exactly_under_its_original_prompt() -> None:
    chat = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 30, "temperature": 0.8}
    request = parse_request("chat", jsonx.dumps(chat), CONFIG)
    answer = plan_completion(CONFIG, request, "chat")
    prompt, output = chat_ids(MESSAGES), ids_of(answer.tokens)
    assert split_chat([*prompt, *output]) == (bytes.fromhex(answer.prompt_hash), len(prompt))
    rows = scored([*prompt, *output])
    got = [rows[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(output)]
    ids = parse_text(answer.text)
    assert ids is not None
    truth = sequence_logprobs(
        model_for(CONFIG), bytes.fromhex(answer.prompt_hash), ids, temperature=1.0
    )
    assert max(abs(a - b) for a, b in zip(got, truth, strict=True)) < 1e-12
    assert all(min(r["rank"] for r in row.values()) == 1 for row in rows[len(prompt) :])


def test_what_is_not_a_chat_prompt_keeps_the_drafters_entries_and_odd_pieces_get_the_floor() -> (
    None
):
    text = text_ids("Tell me about it. Lorem ipsum dolor")
    assert split_chat(text) is None
    assert scored(text) == prompt_logprobs(text, CONFIG.drafter_match_for("chat"), 0)
    prompt = chat_ids(MESSAGES)
    odd = text_ids(" Lorem {")
    rows = scored([*prompt, *odd])
    assert rows[len(prompt) + 1][str(odd[1])]["logprob"] == FLOOR
