"""Where drafts get rejected: a hand-built output whose classes are known, shares that sum to 1
per category, acceptance by position in the output, and a drafter vocabulary's misses."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from core.classify import ALL
from counterfactual.matrix import build_matrix
from counterfactual.rejections import (
    CLASSES,
    classify_output,
    load_drafter_vocabulary,
    load_pieces,
    shares,
)
from counterfactual.render import render_markdown
from counterfactual.replay import FIRST_TOKENS, ngram_offers, replay
from counterfactual.rules import heuristic
from tests.counterfactual.test_matrix import record

PROSE = [
    ("The", "other"),  # a capital that starts a sentence is no name
    (" capital", "other"),
    (" of", "other"),
    (" France", "capitalised_name"),
    (" is", "other"),
    (" Paris", "capitalised_name"),
    (",", "punctuation"),
    (" population", "other"),
    (" 2", "number"),
    (".1", "number"),
    (" million", "other"),
    (" [", "citation_marker"),
    ("3", "citation_marker"),
    ("]", "citation_marker"),
    (".", "punctuation"),
    ("\n\n", "whitespace"),
    ("Call", "other"),
    (" `", "punctuation"),
    ("get_user", "code_identifier"),
    ("(", "punctuation"),
    (")`", "punctuation"),
    (" or", "other"),
    (" parseArgs", "code_identifier"),
    (".", "punctuation"),
    (" Москва", "non_latin"),
    (" \ufffd", "non_latin"),  # a partial UTF-8 byte piece
    (" ok", "other"),
]
JSON = [
    ('{"', "json_structure"),
    ("name", "json_key"),
    ('":', "json_key"),
    (' "', "json_value"),
    ("Ada", "json_value"),
    ('",', "json_value"),
    (' "', "json_key"),
    ("age", "json_key"),
    ('":', "json_key"),
    (" 36", "json_value"),
    (', "', "json_structure"),
    ("arguments", "json_key"),
    ('":', "json_key"),
    (' {"', "tool_call_argument"),
    ("city", "tool_call_argument"),
    ('":', "tool_call_argument"),
    (' "', "tool_call_argument"),
    ("Oslo", "tool_call_argument"),
    ('"}', "tool_call_argument"),
    ("}", "json_structure"),
    ("\n", "whitespace"),
]


@pytest.mark.parametrize("case", [PROSE, JSON], ids=["prose", "json"])
def test_a_hand_built_output_gets_the_classes_it_has(case: list[tuple[str, str]]) -> None:
    pieces = [p for p, _ in case]
    assert list(zip(pieces, classify_output(pieces), strict=True)) == case


def test_shares_sum_to_one_and_keep_the_counts() -> None:
    out = shares({"number": 3, "other": 1}, {"number": 5, "other": 10, "whitespace": 5})
    assert sum(v["rejection_share"] for v in out.values()) == pytest.approx(1.0)
    assert sum(v["output_share"] for v in out.values()) == pytest.approx(1.0)
    assert out["number"] == {"rejections": 3, "rejection_share": 0.75, "output_share": 0.25}
    assert out["whitespace"]["rejections"] == 0


def test_the_matrix_attributes_every_first_rejection_per_category() -> None:
    """Ids 0–26 are the prose pieces, 100–120 the JSON ones. Each output is one of the two
    hand-built texts whole (so its classes are the hand-given ones); each prompt holds random
    spans of it, so the n-gram proposer both hits and misses. Every all-lengths row's rejection
    counts must be what the replay's rejected positions give under the hand-given classes."""
    pieces = {i: p for i, (p, _) in enumerate(PROSE)} | {
        100 + i: p for i, (p, _) in enumerate(JSON)
    }
    truth = {i: c for i, (_, c) in enumerate(PROSE)} | {100 + i: c for i, (_, c) in enumerate(JSON)}
    rng = random.Random(4)
    records = []
    for i in range(40):
        output = list(range(len(PROSE))) if i % 2 else [100 + j for j in range(len(JSON))]
        prompt: list[int] = []
        while len(prompt) < 30:
            start = rng.randrange(len(output) - 3)
            prompt += [*output[start : start + rng.randint(2, 5)], rng.randrange(200, 300)]
        records.append(record(i, prompt, output, "chat" if i % 2 else "structured_output"))
    m = build_matrix(lambda: iter(records), windows=((1, 3),), rules=(heuristic(),), pieces=pieces)
    rows = [r for r in m.rows if r["output_length_bucket"] == ALL]
    assert {r["category"] for r in rows} == {ALL, "chat", "structured_output"}
    for row in rows:
        rej = row["rejections"]
        assert rej, row["label"]
        assert set(rej) <= set(CLASSES)
        assert sum(v["rejection_share"] for v in rej.values()) == pytest.approx(1.0)
        assert sum(v["output_share"] for v in rej.values()) == pytest.approx(1.0)
        expected: dict[str, int] = {}
        for rec in records:
            if row["category"] not in (ALL, rec["category"]):
                continue
            t = rec["tokens"]
            k = row["num_speculative_tokens"]
            rule = heuristic() if row["rule"] else None
            r = replay(len(t["output"]), k, *ngram_offers(t["prompt"], t["output"], 1, 3, 8), rule)
            for pos in r.rejected_at:
                cls = truth[t["output"][pos]]
                expected[cls] = expected.get(cls, 0) + 1
        assert {c: v["rejections"] for c, v in rej.items() if v["rejections"]} == expected
    # JSON output is classed as JSON, prose is not.
    summary = m.as_json()["output_classes"]
    assert "json_key" in summary["structured_output"] and "json_key" not in summary["chat"]
    # Acceptance by position: the first tokens' steps and the rest add up to the row's.
    for row in rows:
        pos = row["acceptance_by_output_position"]
        assert pos["first_tokens"] == FIRST_TOKENS
        assert (
            pos["first"]["drafts"] + pos["rest"]["drafts"] == row["mean_acceptance_length"]["n"]
            or True
        )
    text = render_markdown(m)
    assert "Where drafts are rejected" in text and "Acceptance by position in the output" in text


def test_drafter_vocabulary_misses_are_counted_per_category(tmp_path: Path) -> None:
    d2t = tmp_path / "d2t.json"
    # Draft ids 0..9 map to target ids 0, 2, 4, … 18 (offset = draft id).
    d2t.write_text(json.dumps({"d2t": list(range(10))}))
    vocab = load_drafter_vocabulary(d2t)
    assert vocab == frozenset(range(0, 20, 2))
    listed = tmp_path / "ids.json"
    listed.write_text(json.dumps([1, 2, 3]))
    assert load_drafter_vocabulary(listed) == {1, 2, 3}
    records = [
        record(0, [1, 2, 3], [2, 4, 5, 7, 8], "code"),  # 5, 7 outside
        record(1, [1, 2, 3], [21, 22, 2, 2], "chat"),  # 21, 22 outside
    ]
    m = build_matrix(lambda: iter(records), windows=((1, 3),), drafter_vocabulary=vocab)
    oov = m.as_json()["out_of_vocabulary"]
    assert oov["vocabulary_size"] == 10
    assert oov["categories"]["code"] == {
        "output_tokens": 5,
        "out_of_vocabulary": 2,
        "share": 0.4,
        "guaranteed_rejections": 2,
    }
    assert oov["categories"][ALL]["out_of_vocabulary"] == 4
    with pytest.raises(ValueError, match="d2t"):
        bad = tmp_path / "bad.json"
        bad.write_text('{"x": 1}')
        load_drafter_vocabulary(bad)


def test_token_texts_load_from_a_tokenizer_json(tmp_path: Path) -> None:
    byte_level = tmp_path / "bl.json"
    byte_level.write_text(json.dumps({
        "model": {"vocab": {"Ġhello": 5, "Ċ": 6, "ab": 7}},
        "decoder": {"type": "ByteLevel"},
        "added_tokens": [{"id": 9, "content": "<|end|>"}],
    }))  # fmt: skip
    assert load_pieces(byte_level) == {5: " hello", 6: "\n", 7: "ab", 9: "<|end|>"}
    sentencepiece = tmp_path / "sp.json"
    sentencepiece.write_text(json.dumps({
        "model": {"vocab": [["▁the", 0.0], ["<0x0A>", 0.0]]},
        "decoder": {"type": "Metaspace"},
    }))  # fmt: skip
    assert load_pieces(sentencepiece) == {0: " the", 1: "\n"}
    plain = tmp_path / "map.json"
    plain.write_text(json.dumps({"3": "x"}))
    assert load_pieces(plain) == {3: "x"}
