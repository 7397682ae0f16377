"""The simulator's tokenizer and vLLM's n-gram proposer port, pure: hand-made cases, a brute-force
oracle, and the tokenizer's promise that an answer's text splits back into its own tokens."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from simulator.config import SimConfig
from simulator.ngram import find_longest_matched_ngram_and_propose_tokens as propose
from simulator.plan import plan_completion
from simulator.request import parse_request
from simulator.tokens import (
    HASHED_BASE,
    IM_END,
    IM_START,
    VOCABULARY,
    chat_ids,
    decode,
    ids_of,
    piece_id,
    text_ids,
    text_pieces,
)
from tests.simulator.helpers import brute_force


@pytest.mark.parametrize(
    ("tokens", "lo", "hi", "max_len", "k", "want"),
    [
        # The suffix [2, 3] occurred at 1..2; 4, 1 followed it.
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 100, 2, [4, 1]),
        # vLLM's docstring example: [4, 2, 3] has no match, [2, 3] does; only 3 tokens follow.
        ([1, 2, 3, 4, 2, 3], 2, 3, 100, 4, [4, 2, 3]),
        # Two equally long matches of [1, 2] (at 1 and at 4): the earliest wins.
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 100, 1, [7]),
        # The longer match ([1, 2, 3] at 0) beats the shorter, later-ending [2, 3] at 4.
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2, 3, 100, 2, [9, 2]),
        # Overlapping occurrences count; drafts stop at the end of the context.
        ([7, 7, 7, 7], 2, 2, 100, 3, [7, 7]),
        # max_ngram caps the match: [4, 5] matches at 3, whatever longer match exists.
        ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 1, 2, 100, 3, [1, 2, 3]),
        # No room left under max_model_len: one draft at most.
        ([1, 2, 1, 2], 2, 2, 5, 3, [1]),
        ([1, 2, 1, 2], 2, 2, 4, 3, []),
        ([1], 2, 4, 100, 3, []),  # shorter than min_ngram
        ([1, 2, 3, 4], 1, 4, 100, 3, []),  # nothing repeats
        ([3, 1, 2, 3], 1, 4, 100, 2, [1, 2]),  # a unigram match when min_ngram allows it
        ([3, 1, 2, 3], 2, 4, 100, 2, []),
    ],
)
def test_the_ngram_proposer_on_hand_made_sequences(tokens, lo, hi, max_len, k, want):
    assert propose(tokens, lo, hi, max_len, k) == want
    assert brute_force(tokens, lo, hi, max_len, k) == want


def test_the_ngram_proposer_agrees_with_a_brute_force_oracle():
    rng = random.Random(7)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice((2, 3, 5))) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        max_len = rng.choice((100, len(tokens) + rng.randint(0, 3)))
        assert propose(tokens, lo, hi, max_len, k) == brute_force(tokens, lo, hi, max_len, k), (
            tokens,
            lo,
            hi,
            max_len,
            k,
        )


def test_fixed_vocabulary_ids_are_distinct_and_every_id_fits_int32():
    assert len(set(VOCABULARY)) == len(VOCABULARY) < HASHED_BASE
    assert [piece_id(p) for p in VOCABULARY] == list(range(len(VOCABULARY)))
    for piece in ("Jakarta", "exampleword", "  \n  ", "é", "<|im_start|>x"):
        token_id = piece_id(piece)
        assert token_id == piece_id(piece) and HASHED_BASE <= token_id < 2**31


def test_text_pieces_concatenate_back_and_recognise_special_pieces():
    text = 'Hello world, <|im_end|> {"a": 12345}\n\n  x'
    pieces = text_pieces(text)
    assert "".join(pieces) == text
    assert pieces[:4] == ["Hello", " world", ",", " "]
    assert IM_END in pieces and "12345" not in pieces and "123" in pieces
    assert decode(text_ids(text)) == text


def test_chat_template_pieces():
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"}]
    want = [IM_START, "system", "\n", "Be", " brief", IM_END, "\n"]
    want += [IM_START, "user", "\n", "hi", IM_END, "\n", IM_START, "assistant", "\n"]
    assert chat_ids(messages) == ids_of(want)
    assert chat_ids(messages, add_generation_prompt=False) == ids_of(want[:-3])


@pytest.mark.parametrize("copy", [0.0, 0.5, 0.9])
def test_an_answers_text_splits_back_into_exactly_its_tokens(copy):
    cfg = SimConfig(copy=copy, min_output_tokens=1, max_output_tokens=120)
    bodies: list[dict[str, object]] = [
        {"messages": [{"role": "user", "content": f"q{i} def f(x):\n    return x + {i}\n"}]}
        for i in range(40)
    ]
    bodies += [
        {"messages": [{"role": "user", "content": "j"}], "response_format": {"type": kind}}
        for kind in ("json_object",)
    ]
    for body in bodies:
        for max_tokens in (1, 7, 500):
            raw = json.dumps({**body, "max_tokens": max_tokens}).encode()
            plan = plan_completion(cfg, parse_request("chat", raw, cfg), "chat")
            assert text_ids(plan.text) == ids_of(plan.tokens), plan.tokens


def test_usage_prompt_tokens_are_the_tokenized_prompt():
    cfg = SimConfig()
    messages = [{"role": "user", "content": "Count me, please"}]
    chat = parse_request("chat", json.dumps({"messages": messages}).encode(), cfg)
    assert chat.prompt_ids == tuple(chat_ids(messages)) and chat.prompt_tokens == 12
    text = parse_request("completions", json.dumps({"prompt": "a b, c"}).encode(), cfg)
    assert text.prompt_ids == tuple(text_ids("a b, c")) and text.prompt_tokens == 4
    ids = parse_request("completions", json.dumps({"prompt": [5, 6, 7]}).encode(), cfg)
    assert ids.prompt_ids == (5, 6, 7)


def test_answers_without_copying_are_the_text_they_always_were():
    """Pinned: the word answers from before token ids and copying existed (copy=0.0)."""
    cfg = SimConfig()
    digest = hashlib.sha256()
    for i in range(50):
        body = {"messages": [{"role": "user", "content": f"golden {i}"}], "max_tokens": 300}
        plan = plan_completion(cfg, parse_request("chat", json.dumps(body).encode(), cfg), "chat")
        digest.update(plan.text.encode())
    assert digest.hexdigest()[:16] == "917cec998e2ebd2e"
