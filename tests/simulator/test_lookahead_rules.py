"""The simulator's dynamic lookahead: each rule's law step by step, checked by hand, and the
confidence exit of the simulated drafter."""

from __future__ import annotations

import math

import pytest

from simulator.acceptance import replay_steps
from simulator.config import SimConfig
from simulator.drafter import confidences, drafter_proposer, predictions, prompt_logprobs
from simulator.lookahead import parse, schedule


def test_the_heuristic_grows_by_two_on_a_full_accept_and_shrinks_by_one_otherwise() -> None:
    s = schedule("heuristic:start=4,floor=2,cap=7")
    assert s is not None
    seen = [s.k]
    for drafted, accepted in ((4, 4), (6, 6), (7, 3), (6, 6), (7, 7), (5, 5), (0, 0), (5, 0)):
        s.verified(s.k, drafted, accepted)
        seen.append(s.k)
    # 4 → 6 (full) → 7 (full, capped) → 6 (miss) → 7 (full: capped at 7 from 8) → 7 (full) →
    # 6 (a draft of 5 < 7 is a miss, though all accepted) → 5 (no draft) → 4.
    assert seen == [4, 6, 7, 6, 7, 7, 6, 5, 4]
    floor = schedule("heuristic:start=2,floor=2,cap=8")
    assert floor is not None
    floor.verified(2, 2, 0)
    assert floor.k == 2


def test_ema_tiers_move_one_tier_with_hysteresis() -> None:
    s = schedule("ema_tiers:tiers=1/2/4,start=2,weight=0.5,up=0.8,down=0.4")
    assert s is not None and s.k == 2  # ema starts at 2 × 0.6 = 1.2
    s.verified(2, 2, 2)  # ema 1.6 ≥ 0.8 × 2: up to 4
    assert s.k == 4
    s.verified(4, 4, 2)  # ema 1.8: not < 0.4 × 4 = 1.6, not ≥ 3.2: stays
    assert s.k == 4
    s.verified(4, 4, 0)  # ema 0.9 < 1.6: down to 2
    assert s.k == 2
    s.verified(2, 0, 0)  # no draft: the EMA does not move
    assert s.k == 2


def test_elastic_picks_the_tier_by_the_acceptance_rates_ewma() -> None:
    s = schedule("elastic:weight=1")
    assert s is not None and s.k == 4  # initial rate 0.5: ≥ 0.3, ≥ 0.5, < 0.7
    s.verified(4, 4, 3)  # rate 0.75
    assert s.k == 8
    s.verified(8, 8, 2)  # rate 0.25
    assert s.k == 1


def test_unknown_rules_and_constants_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        parse("nope")
    with pytest.raises(ValueError, match="no constant 'bogus'"):
        SimConfig(lookahead="heuristic:bogus=1")
    assert schedule(None) is None


def test_the_confidence_exit_stops_after_the_first_unsure_token() -> None:
    tokens = list(range(40, 100))
    match = 0.9
    probs = confidences(tokens, match)
    # The probabilities are prompt_logprobs' rank-1 logprobs, exponentiated.
    teacher = prompt_logprobs(tokens, match, 1)
    for i in range(1, len(tokens)):
        (best,) = [v for v in teacher[i].values() if v["rank"] == 1]
        assert probs[i] == pytest.approx(math.exp(best["logprob"]))
    preds = predictions(tokens, match)
    propose = drafter_proposer(tokens, match, threshold=0.7)
    for start in range(5, 50):
        draft = propose(tokens[:start], 6)
        stop = next((i for i in range(start, start + 6) if (probs[i] or 1.0) < 0.7), start + 5)
        assert draft == preds[start : stop + 1]
    steps = replay_steps(tokens[:5], tokens[5:], k=4, propose=propose,
                         lookahead=schedule("confidence:threshold=0.7,cap=6"))  # fmt: skip
    assert sum(s.accepted + 1 for s in steps) == len(tokens) - 5
