"""The live check under batching: greedy answers that drifted from production's are not paired
with a prediction made on production's text, are counted, and never raise the flag — while a
candidate that does not run what it declares is still caught on the answers that agree."""

from __future__ import annotations

import random
from typing import Any

from counterfactual.matrix import build_matrix
from counterfactual.replay import ngram_offers, replay
from tests.counterfactual.test_matrix import leg, record, structured_request

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip


def _records(n: int, drift: float, engine_k: int, seed: int) -> list[dict[str, Any]]:
    """Greedy requests through a candidate whose engine runs n-gram k = ``engine_k`` (honest at
    4); a share ``drift`` of its answers drifted from production's after a few tokens into
    fresh text (as a batch-variant engine does), and so did the baseline's on those requests."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, output = structured_request(rng, repeat=0.9)
        drifted = rng.random() < drift
        # A drifted answer goes on copying the prompt, but with every third token changed:
        # the n-gram proposer keeps drafting there and keeps being rejected.
        tail = [t if j % 3 else rng.randrange(400, 600) for j, t in enumerate(prompt * 3)]
        own = output[:6] + tail[: len(output) - 6] if drifted else output
        r = replay(len(own), engine_k, *ngram_offers(prompt, own, 2, 4, 8))
        cand = leg("candidate", 0.01, 1, len(own), speculative=SPEC, backend="ngram",
                   acceptance={"num_drafts": r.drafts, "num_accepted_tokens": r.accepted})  # fmt: skip
        base = leg("baseline", 0.01, 1, len(own), backend="plain-2")
        rec = record(i, prompt, output, "code", [cand, base])
        rec["tokens"]["legs"] = {"ngram": own, "plain-2": own if drifted else output}
        out.append(rec)
    return out


def test_drifted_greedy_answers_are_counted_and_not_blamed_on_the_replay() -> None:
    records = _records(60, drift=0.6, engine_k=4, seed=1)
    (live,) = build_matrix(lambda: iter(records), depths=(4,), windows=((2, 4),)).live
    drift = live["drift"]
    assert drift["greedy_drifted"] + drift["greedy_compared"] == 60
    assert 25 <= drift["greedy_drifted"] <= 45
    assert drift["baseline_drifted"] == drift["greedy_drifted"]
    assert "not batch-invariant" in drift["note"]
    assert not live["flag"], live["note"]
    assert abs(live["greedy"]["relative_gap"]) < 1e-12  # exact on the answers that agree
    assert not live["engine_check"]["flag"]
    # Paired as before (every greedy answer against production's text), the drifted answers'
    # lower acceptance would have flagged the replay as wrong.
    from core.stats import RatioStats
    from counterfactual.live import compare

    predicted, measured = RatioStats(), RatioStats()
    for rec in records:
        t = rec["tokens"]
        p = replay(len(t["output"]), 4, *ngram_offers(t["prompt"], t["output"], 2, 4, 8))
        predicted.add(p.drafts, p.accepted)
        acc = rec["legs"][0]["acceptance"]
        measured.add(acc["num_drafts"], acc["num_accepted_tokens"])
    assert compare(predicted, measured)["flag"]


def test_a_candidate_that_runs_another_k_is_still_flagged_among_drifted_answers() -> None:
    records = _records(60, drift=0.5, engine_k=2, seed=2)
    (live,) = build_matrix(lambda: iter(records), depths=(4,), windows=((2, 4),)).live
    assert live["flag"] and live["drift"]["greedy_drifted"] > 0
    assert live["greedy"]["flag"] and live["engine_check"]["flag"]


def test_adaptive_verification_makes_the_configured_depth_an_upper_bound() -> None:
    """A candidate declaring k = 4 that verifies an adaptive budget (here: k = 2 every step,
    within its cap) is not flagged when it reports adaptive verification — the replay at k = 4
    bounds it — and is flagged when it does not; a measured value above the bound is flagged."""
    records = _records(40, drift=0.0, engine_k=2, seed=3)
    (strict,) = build_matrix(lambda: iter(records), depths=(4,), windows=((2, 4),)).live
    assert strict["flag"] and not strict["adaptive_verification"]
    for rec in records:
        rec["legs"][0]["speculative"] = {**SPEC, "adaptive_verification": True}
    (adaptive,) = build_matrix(lambda: iter(records), depths=(4,), windows=((2, 4),)).live
    assert adaptive["adaptive_verification"] and not adaptive["flag"], adaptive["note"]
    assert adaptive["greedy"]["relative_gap"] > 0  # the bound sits above what was measured
    from core.stats import RatioStats
    from counterfactual.live import compare

    low, high = RatioStats(), RatioStats()
    for _ in range(30):
        low.add(10, 5)
        high.add(10, 25)
    assert compare(low, high, upper_bound=True)["flag"]
    assert not compare(high, low, upper_bound=True)["flag"]
