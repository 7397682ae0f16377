"""Cross-vocabulary drafters: TLI (vLLM's token-level intersection) and SLEM (string-level).

Hand-computed cases fix the intersection rule (normalised space markers, first id wins, ids past
the vocab size left out) and every count of a TLI and a SLEM replay. The simulator check drafts
over the simulator's own vocabulary with a drafter whose tokenizer is another (its own ids, the
SentencePiece space marker, no capitalised words, no zero-padded numbers): an engine loop that
drafts *autoregressively* through the intersection, as vLLM's proposer does, must give the same
counts as the teacher-forced replay, and the tokens outside the intersection are counted from
the two piece sets directly.
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import pytest

from counterfactual.crossvocab import (
    SLEM_CLASS,
    TLI_CLASS,
    Intersection,
    normalize_token,
    slem_offers,
    slem_replay,
    summarize,
    tli_replay,
)
from simulator.textgen import WORDS, word_tokens
from simulator.tokens import VOCABULARY, ids_of, piece_id

TARGET = {"<unk>": 0, "Ġthe": 5, "cat": 6, "Ġsat": 7, "ĠSAT": 8}
DRAFT = {"<unk>": 0, "▁sat": 1, "dog": 2, "▁the": 3, "cat": 4}


def _hand() -> Intersection:
    return Intersection.build(
        TARGET, DRAFT, target_unk=0, draft_unk=0, target_prefixes=("Ġ",), draft_prefixes=("▁",)
    )


def test_intersection_normalises_space_markers_and_keeps_the_first_id() -> None:
    x = _hand()
    assert dict(x.draft_to_target) == {0: 0, 1: 7, 3: 5, 4: 6}
    assert dict(x.target_to_draft) == {0: 0, 7: 1, 5: 3, 6: 4}
    assert x.size == 4
    assert x.to_draft([5, 8, 6]) == [3, 0, 4]  # " SAT" is outside: the drafter reads its unk
    assert x.to_target([2, 1]) == [0, 7]
    # Both spell " a" after normalising: the first in the vocabulary's order wins, as in vLLM.
    y = Intersection.build({"Ġa": 10, " a": 11}, {" a": 3}, target_unk=0, draft_unk=0)
    assert dict(y.draft_to_target) == {3: 10}
    # An id at or past the declared vocab size is left out.
    z = Intersection.build(TARGET, DRAFT, target_unk=0, draft_unk=0, draft_vocab_size=4)
    assert 4 not in z.draft_to_target and 3 in z.draft_to_target
    assert normalize_token("▁x", ("Ġ", "▁")) == " x" and normalize_token("x▁", ("▁",)) == "x▁"


def test_tli_replay_counts_rejections_by_construction() -> None:
    x = _hand()
    output = [5, 6, 7, 8, 5, 6]  # the cat sat SAT the cat — SAT (8) is outside the intersection
    draft_argmax = [None, 4, 1, 1, 3, 4]  # → target 6, 7, 7, 5, 6: wrong only where 8 is
    r, outside, by_construction = tli_replay(x, output, draft_argmax, 3)
    # prefill emits 0; at j=1 d=min(3, 6−1−1)=3, match 2 → a=2, rejected at 3, j=4; at j=4
    # d=min(3, 1)=1, a=1, j=6.
    assert (r.passes, r.drafts, r.draft_tokens, r.accepted) == (3, 2, 4, 3)
    assert r.rejected_at == (3,)
    assert (outside, by_construction) == (1, 1)
    assert r.mean_acceptance_length == 2.5
    # A plain miss (the drafter names an intersection token, the wrong one) is not by construction.
    r2, outside2, by2 = tli_replay(x, [5, 6, 7, 5], [None, 4, 3, 3], 2)
    assert r2.rejected_at == (2,) and (outside2, by2) == (0, 0)


def test_slem_matches_text_across_token_boundaries() -> None:
    texts = ["The", " cat", " sat", " on", " the", " mat"]
    drafts: list[str | None] = [None, " cat sit", " sat in", " on the m", None, " mat"]
    available, match = slem_offers(texts, drafts)
    assert match == [0, 1, 1, 2, 0, 1]
    assert available == [0, 2, 2, 3, 0, 1]
    r = slem_replay(texts, drafts)
    # j=1: d=2, a=1, rejected at 2, j=3; j=3: d=min(3, 6−3−1)=2, a=2, j=6.
    assert (r.passes, r.drafts, r.draft_tokens, r.accepted, r.rejected_at) == (3, 2, 4, 3, (2,))
    # The drafter's text need not split as the target's tokens do: " cats" spells " cat", "s".
    assert slem_offers(["a", " cat", "s", "!"], [None, " cats", None, None])[1] == [0, 2, 0, 0]
    with pytest.raises(ValueError, match="expected 2 draft texts"):
        slem_offers(["a", "b"], [None])


def test_summary_per_category_states_each_replay_class() -> None:
    x = _hand()
    rows = summarize(
        x,
        [
            ("chat", [5, 6, 7, 8, 5, 6], [None, 4, 1, 1, 3, 4], None, None),
            ("code", [5, 6, 7, 5], [None, 4, 3, 3], ["a", "b", "c", "d"], [None, "bc", "x", None]),
        ],
        3,
    )
    assert list(rows) == ["chat", "code"]
    chat = rows["chat"]
    assert chat["slem"] is None
    tli = chat["tli"]
    assert isinstance(tli, dict)
    assert tli["replay_class"] == TLI_CLASS and tli["intersection_size"] == 4
    assert (tli["outside_intersection"], tli["rejections"], tli["rejections_by_construction"]) == (
        1,
        1,
        1,
    )
    assert tli["outside_share"] == 1 / 6 and tli["mean_acceptance_length"] == 2.5
    slem = rows["code"]["slem"]
    assert isinstance(slem, dict) and slem["replay_class"] == SLEM_CLASS
    # "bc" at j=1 spells "b","c": d=min(2, 4−1−1)=2, a=2, j=4: one step, two accepted.
    assert (slem["drafts"], slem["draft_tokens"], slem["accepted"]) == (1, 2, 2)


# --- the simulator check ---------------------------------------------------------------------

MATCH = 0.7


def _marked(piece: str, marker: str) -> str:
    return marker + piece[1:] if piece.startswith(" ") else piece


def _drafter_pieces() -> list[str]:
    """Another tokenizer: no capitalised words, no zero-padded numbers, its own ids (reversed)."""
    capitals = {w.capitalize() for w in WORDS} | {" " + w.capitalize() for w in WORDS}
    kept = [p for p in VOCABULARY if p not in capitals and not (len(p) > 1 and p[0] == "0")]
    return [*reversed(kept), "<unk>"]


def _vocabularies() -> tuple[dict[str, int], dict[str, int], list[str]]:
    target = {_marked(p, "Ġ"): piece_id(p) for p in VOCABULARY}
    pieces = _drafter_pieces()
    draft = {_marked(p, "▁"): i for i, p in enumerate(pieces)}
    return target, draft, pieces


def _raw(context: Sequence[int], actual: int, vocab: int) -> int:
    """The simulated drafter (draft ids): the actual next token with probability MATCH, keyed by
    the context it reads, else another id of its vocabulary."""
    h = hashlib.blake2b(b"xvocab", digest_size=16)
    for t in context:
        h.update(t.to_bytes(8, "big"))
    d = h.digest()
    u = int.from_bytes(d[:8], "big") / 2**64
    return actual if u < MATCH else int.from_bytes(d[8:], "big") % vocab


def _outputs(seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    out: list[tuple[str, list[str]]] = []
    for i in range(40):
        if i % 2 == 0:
            out.append(("prose", word_tokens(rng, rng.randint(8, 60))))
        else:
            numbers = [f"{rng.randint(0, 99):03d}" if rng.random() < 0.3 else " " + rng.choice(WORDS)
                       for _ in range(rng.randint(8, 60))]  # fmt: skip
            out.append(("numbers", numbers))
    return out


def test_tli_replay_equals_an_autoregressive_engine_on_the_simulator() -> None:
    target, draft, pieces = _vocabularies()
    unk = len(pieces) - 1
    x = Intersection.build(
        target, draft, target_unk=0, draft_unk=unk, target_prefixes=("Ġ",), draft_prefixes=("▁",)
    )
    fallback = draft["▁lorem"]  # the masked argmax where the drafter's own pick is outside

    def masked(d: int) -> int:
        return d if d in x.draft_to_target else fallback

    prompt = ids_of(["<|im_start|>", "user", "\n", "Say", " something", "<|im_end|>"])
    drafter_pieces = set(pieces)
    k = 4
    requests = []
    truth: dict[str, list[int]] = {}
    for category, out_pieces in _outputs(39):
        output = ids_of(out_pieces)
        ctx = x.to_draft(prompt + output)
        actual = x.to_draft(output)
        base = len(prompt)
        teacher = [
            None,
            *(masked(_raw(ctx[: base + i], actual[i], len(pieces))) for i in range(1, len(output))),
        ]
        requests.append((category, output, teacher, None, None))
        # The engine: each step drafts autoregressively on its own drafts, through the map.
        n = len(output)
        t = truth.setdefault(
            category, [0, 0, 0, 0, 0]
        )  # drafts, drafted, accepted, outside, by construction
        t[3] += sum(p not in drafter_pieces for p in out_pieces)
        j = 1
        while j < n:
            d = min(k, n - j - 1)
            if d <= 0:
                j += 1
                continue
            context = list(ctx[: base + j])
            proposed = []
            for i in range(d):
                tok = masked(_raw(context, actual[j + i], len(pieces)))
                proposed.append(x.draft_to_target[tok])
                context.append(tok)
            a = 0
            while a < d and proposed[a] == output[j + a]:
                a += 1
            t[0] += 1
            t[1] += d
            t[2] += a
            if a < d and out_pieces[j + a] not in drafter_pieces:
                t[4] += 1
            j += a + 1
    rows = summarize(x, requests, k)
    assert set(rows) == {"prose", "numbers"}
    for category, (drafts, drafted, accepted, outside, by_construction) in truth.items():
        tli = rows[category]["tli"]
        assert isinstance(tli, dict)
        got = (tli["drafts"], tli["draft_tokens"], tli["accepted"], tli["outside_intersection"],
               tli["rejections_by_construction"])  # fmt: skip
        assert got == (drafts, drafted, accepted, outside, by_construction)
        assert outside > 0 and by_construction > 0  # capitals / zero-padded numbers do occur
        assert 0 < accepted < drafted


def test_slem_replay_on_simulator_text_against_character_offsets() -> None:
    """Drafts spell the output's text for a hashed number of characters, then go wrong: the
    accepted tokens are those whose end offset lies within the spelled characters."""
    for category, out_pieces in _outputs(7):
        text = "".join(out_pieces)
        ends = list(accumulate(len(p) for p in out_pieces))
        starts = [0, *ends[:-1]]
        rng = random.Random(category + text)
        drafts: list[str | None] = [None]
        spelled: list[int] = [0]
        for j in range(1, len(out_pieces)):
            length = rng.randint(0, 30)
            drafts.append(text[starts[j] : starts[j] + length] + "~")
            spelled.append(min(starts[j] + length, len(text)))
        r = slem_replay(out_pieces, drafts)
        n = len(out_pieces)
        j, accepted, drafted = 1, 0, 0
        while j < n:
            m = bisect_right(ends, spelled[j]) - j  # whole tokens within the spelled text
            d = min(m + 1, n - j - 1)  # the leftover "~" is one more drafted target token
            if d <= 0:
                j += 1
                continue
            a = min(m, d)
            drafted += d
            accepted += a
            j += a + 1
        assert (r.draft_tokens, r.accepted) == (drafted, accepted)
