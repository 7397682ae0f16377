"""The one-pass n-gram index and the replay against a literal port of vLLM's proposer."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from counterfactual.ngram import NO_DRAFT, draft_starts
from counterfactual.replay import drafter_offers, ngram_offers, replay
from tests.counterfactual.vllm_reference import propose, replay_reference

sequences = st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=60)
windows = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


def test_the_reference_port_on_a_worked_example() -> None:
    # Suffix [1, 2, 3] (n = 3 ≤ max 3) occurs at 0; the draft copies what followed it.
    assert propose([1, 2, 3, 4, 1, 2, 3], 2, 3, 1024, 2) == [4, 1]
    # Two earlier occurrences of [5, 6]: the earliest wins.
    assert propose([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 1024, 1) == [7]
    # No n-gram of the window matches.
    assert propose([1, 2, 3, 4], 2, 3, 1024, 2) == []
    # Overlap with the suffix is allowed: [9, 9] occurs at 0 in [9, 9, 9].
    assert propose([9, 9, 9], 2, 2, 1024, 3) == [9]


@settings(max_examples=400, deadline=None)
@given(sequences, windows, st.integers(1, 8))
def test_draft_starts_equal_vllms_proposer_at_every_context_length(
    tokens: list[int], window: tuple[int, int], k: int
) -> None:
    lo, hi = window
    starts = draft_starts(tokens, 1, lo, hi)
    for context, start in enumerate(starts, start=1):
        expected = propose(tokens[:context], lo, hi, 1 << 30, k)
        got = [] if start == NO_DRAFT else tokens[start : start + min(k, context - start)]
        assert got == expected, (tokens[:context], lo, hi, k)


@settings(max_examples=300, deadline=None)
@given(sequences, sequences, windows, st.integers(1, 8))
def test_replay_equals_stepping_vllms_proposer(
    prompt: list[int], output: list[int], window: tuple[int, int], k: int
) -> None:
    lo, hi = window
    available, match = ngram_offers(prompt, output, lo, hi, max_k=8)
    r = replay(len(output), k, available, match)
    steps = replay_reference(prompt, output, lo, hi, k)
    drafting = [(d, a) for d, a in steps if d > 0]
    assert r.passes == (1 + len(steps) if output else 0)
    assert r.drafts == len(drafting)
    assert r.draft_tokens == sum(d for d, _ in drafting)
    assert r.accepted == sum(a for _, a in drafting)
    assert r.accepted_by_position == tuple(sum(1 for _, a in drafting if a > i) for i in range(k))
    assert sum(a + 1 for _, a in steps) + (1 if output else 0) == len(output)


def test_a_draft_model_accepts_its_runs_of_correct_predictions() -> None:
    output = [1, 2, 3, 4, 5, 6, 7, 8]
    predicted = [1, 2, 0, 4, 5, 6, 0, 8]  # wrong at 2 and 6
    available, match = drafter_offers(output, predicted)
    assert match == [2, 1, 0, 3, 2, 1, 0, 1]
    r = replay(len(output), 3, available, match)
    # j=1: d=3, match 1 → emits 2 (j=3); j=3: d=3, match 3 → 4 (j=7); j=7: r=1 → no draft.
    assert (r.drafts, r.accepted, r.passes) == (2, 4, 4)


def test_repetitive_text_is_accepted_and_random_text_is_not() -> None:
    rng = random.Random(7)
    code = [rng.randrange(50) for _ in range(40)]
    echo = replay(40, 4, *ngram_offers(code, code, 2, 4, 4))
    noise = [rng.randrange(10_000) for _ in range(40)]
    fresh = replay(40, 4, *ngram_offers(code, noise, 2, 4, 4))
    assert echo.mean_acceptance_length is not None and echo.mean_acceptance_length > 4.0
    assert fresh.drafts == 0 and fresh.mean_acceptance_length is None
