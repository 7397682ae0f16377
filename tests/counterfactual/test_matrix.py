"""The matrix over records: intervals that cover, rows for every depth, picks, the live check,
and the step-time model against timings generated from known parameters."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from typing import Any

import pytest

from core.stats import RatioStats
from counterfactual.grid import Config, parse_depths, parse_windows
from counterfactual.matrix import ALL, build_matrix, live_config
from counterfactual.render import policy_fragment, render_markdown
from counterfactual.replay import ngram_offers, replay
from counterfactual.speed import fit_step_model


def structured_request(rng: random.Random, repeat: float) -> tuple[list[int], list[int]]:
    """A prompt of random 'code' and an output that copies spans of it with prob. ``repeat``."""
    prompt = [rng.randrange(200) for _ in range(rng.randint(20, 60))]
    return prompt, output_for(rng, prompt, repeat)


def output_for(rng: random.Random, prompt: list[int], repeat: float) -> list[int]:
    """An output for ``prompt``: spans copied from it with probability ``repeat``, else fresh."""
    output: list[int] = []
    while len(output) < rng.randint(16, 48):
        if rng.random() < repeat:
            start = rng.randrange(len(prompt) - 4)
            output.extend(prompt[start : start + rng.randint(3, 10)])
        else:
            output.extend(rng.randrange(200, 400) for _ in range(rng.randint(1, 6)))
    return output


def test_the_mean_acceptance_length_interval_covers_at_its_nominal_rate() -> None:
    """Population: 4,000 requests; 1,000 samples of 60 requests each, drawn with replacement.

    The interval is a delta-method interval for a ratio of sums over requests; at n = 60 its
    coverage must be near 95 % (binomial SE over 1,000 trials ≈ 0.7 pts).
    """
    rng = random.Random(11)
    units = []
    for _ in range(4000):
        prompt, output = structured_request(rng, repeat=rng.choice([0.2, 0.5, 0.8]))
        r = replay(len(output), 4, *ngram_offers(prompt, output, 2, 4, 4))
        units.append((r.drafts, r.accepted))
    truth = sum(a for _, a in units) / sum(d for d, _ in units)
    covered = trials = 0
    for _ in range(1000):
        stats = RatioStats()
        for d, a in rng.choices(units, k=60):
            stats.add(d, a)
        ci = stats.interval()
        assert ci is not None
        trials += 1
        covered += ci[0] <= truth <= ci[1]
    assert 0.925 <= covered / trials <= 0.975, covered / trials


def record(
    i: int,
    prompt: list[int],
    output: list[int],
    category: str,
    legs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "exchange_id": f"x{i}",
        "category": category,
        "greedy": True,
        "legs": legs or [],
        "tokens": {
            "source": "test",
            "leg": "primary",
            "prompt": prompt,
            "output": output,
            "drafters": {},
        },
    }


def leg(role: str, tpot: float, batch: float, out: int, **extra: Any) -> dict[str, Any]:
    return {
        "role": role,
        "backend": extra.pop("backend", role),
        "outcome": "completed",
        "status": 200,
        "tpot_s": tpot,
        "output_tokens": out,
        "load": {"scraped": {"num_requests_running": batch}, "per_replica_in_flight": batch},
        **extra,
    }


def test_every_depth_and_window_gets_a_row_and_repetitive_traffic_picks_a_deep_lookup() -> None:
    rng = random.Random(3)
    records = []
    for i in range(80):
        cat = "code" if i % 2 else "chat"
        prompt, output = structured_request(rng, repeat=0.9 if cat == "code" else 0.05)
        records.append(record(i, prompt, output, cat))
    m = build_matrix(lambda: iter(records))
    assert m.records == m.scored == 80
    overall = [
        r
        for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL and r["rule"] is None
    ]
    windows = {(r["prompt_lookup_min"], r["prompt_lookup_max"]) for r in overall}
    assert windows == {(1, 3), (2, 4), (3, 5), (5, 5)}
    for lo, hi in windows:
        ks = sorted(
            (r["num_speculative_tokens"], r["tokens_per_pass"]["estimate"])
            for r in overall
            if (r["prompt_lookup_min"], r["prompt_lookup_max"]) == (lo, hi)
        )
        assert [k for k, _ in ks] == list(range(1, 9))
        tpp = [v for _, v in ks]
        assert all(b >= a - 1e-12 for a, b in itertools.pairwise(tpp)), (lo, hi, tpp)
    code = m.picks["code"]
    chat = m.picks["chat"]
    assert code["mean_acceptance_length"]["estimate"] > chat["mean_acceptance_length"]["estimate"]
    assert code["config"]["num_speculative_tokens"] >= 4
    assert m.deploy and policy_fragment(m) is not None
    assert "Picks per category" in render_markdown(m)
    # Per-position rates are vLLM's: accepted at position i / drafts, non-increasing.
    for r in overall:
        rates = [v for v in r["acceptance_by_position"] if v is not None]
        assert all(b <= a + 1e-12 for a, b in itertools.pairwise(rates))


def test_a_live_candidate_is_checked_against_its_prediction_and_flagged_when_it_differs() -> None:
    rng = random.Random(5)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 3,
    }
    honest: list[dict[str, Any]] = []
    liar: list[dict[str, Any]] = []
    for i in range(60):
        prompt, output = structured_request(rng, repeat=0.7)
        r = replay(len(output), 3, *ngram_offers(prompt, output, 2, 3, 3))
        truth = {"num_drafts": r.drafts, "num_accepted_tokens": r.accepted}
        half = {"num_drafts": r.drafts, "num_accepted_tokens": r.accepted // 3}
        for out, acc in ((honest, truth), (liar, half)):
            cand = leg("candidate", 0.01, 1, len(output), speculative=spec, acceptance=acc)
            out.append(record(i, prompt, output, "code", [cand]))
    (ok,) = build_matrix(lambda: iter(honest)).live
    assert ok["relative_gap"] == pytest.approx(0.0, abs=1e-12) and not ok["flag"]
    (bad,) = build_matrix(lambda: iter(liar)).live
    assert bad["flag"] and bad["relative_gap"] > 0.2
    assert live_config({"speculative": spec}) == Config("ngram", 3, 2, 3)
    # The live configuration (window 2-3) is scored although the default grid lacks it.
    assert any(
        r["prompt_lookup_max"] == 3 and r["prompt_lookup_min"] == 2
        for r in build_matrix(lambda: iter(honest)).rows
    )


def test_a_candidate_without_a_live_check_is_named_with_the_reason() -> None:
    """``live: []`` is never silent: each candidate the replay cannot check says why."""
    rng = random.Random(6)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
             "prompt_lookup_max": 3}  # fmt: skip
    cases = {
        "eagle": ({"method": "eagle3", "num_speculative_tokens": 3}, {"num_drafts": 5}, "eagle3"),
        "bare": (None, {}, "no speculative configuration"),
        "quiet": (ngram, {}, "no per-request draft counts"),
    }
    records = []
    for i in range(20):
        prompt, output = structured_request(rng, repeat=0.7)
        legs = [
            leg("candidate", 0.01, 1, len(output), backend=name, speculative=spec, acceptance=acc)
            for name, (spec, acc, _) in cases.items()
        ]
        records.append(record(i, prompt, output, "code", legs))
    m = build_matrix(lambda: iter(records))
    assert m.live == []
    assert set(m.live_skipped) == set(cases)
    for name, (_, _, why) in cases.items():
        assert why in m.live_skipped[name], m.live_skipped[name]
    assert m.as_json()["live_skipped"][0] == {"backend": "bare", "reason": m.live_skipped["bare"]}


def test_the_step_model_recovers_known_parameters_and_predicts_from_them() -> None:
    base, slot = 0.004, 0.0005
    rng = random.Random(9)
    points = []
    for _ in range(200):
        b = rng.randint(1, 32)
        slots = rng.choice([1.0, 1.0, 3.5])
        points.append((float(b), slots, (base + slot * b * slots) * rng.uniform(0.98, 1.02)))
    model = fit_step_model(points, [8.0] * 10)
    assert model is not None and model.identified
    assert model.base_s == pytest.approx(base, rel=0.1)
    assert model.slot_s == pytest.approx(slot, rel=0.05)
    # tokens per pass 2.0 with 1.5 drafted per pass, at batch 8: 2 × (base + 8 slot) / (base + 8 slot × 2.5)
    expected = 2.0 * (base + 8 * slot) / (base + 8 * slot * 2.5)
    assert model.speedup(2.0, 1.5) == pytest.approx(expected, rel=0.05)
    flat = fit_step_model([(4.0, 1.0, 0.01)] * 5, [4.0])
    assert flat is not None and not flat.identified and flat.speedup(2.0, 3.0) == pytest.approx(2.0)


def test_speed_points_come_from_the_primary_and_live_candidates() -> None:
    legs_ = [
        leg("primary", 0.010, 4, 64),
        leg("candidate", 0.006, 4, 64, speculative={"num_speculative_tokens": 4},
            acceptance={"tokens_per_pass": 2.0, "num_draft_tokens": 96}),
    ]  # fmt: skip
    recs: Iterable[dict[str, Any]] = [{"exchange_id": "a", "legs": legs_}]
    m = build_matrix(lambda: iter(recs))
    assert m.scored == 0 and m.model is not None and m.model.points == 2


def test_grid_arguments_are_checked_with_the_piece_named() -> None:
    assert parse_depths("1-3,6") == (1, 2, 3, 6)
    assert parse_windows("2-4,5") == ((2, 4), (5, 5))
    with pytest.raises(ValueError, match="'4-2'"):
        parse_windows("4-2")
    with pytest.raises(ValueError, match="'x'"):
        parse_depths("x")


# How repetitive each request's output is: ``common`` (every request copies from its prompt
# now and then), ``rare`` (real vLLM's sampled traffic in tests/vllm/test_counterfactual.py: most
# sampled answers never repeat — all 48 accepted nothing in one run — and one in twelve repeats a
# lot). In the rare regime a delta-method interval has no width on a side that drew no
# repetition, and two such intervals "disagree" on an honest candidate.
REPEATS = {"common": [0.3, 0.6, 0.9], "rare": [0.0] * 11 + [0.9]}


def run_live_check(
    rng: random.Random,
    n: int,
    *,
    engine_k: int,
    sampled: bool,
    regime: str = "common",
    own_ids: bool = False,
) -> bool:
    """One live check on ``n`` synthetic requests of a candidate that declares n-gram k=4 and
    runs ``engine_k``; returns whether it was flagged. Sampled: the engine's output is an
    independent draw of the same process (its own run), so it agrees only in expectation.
    ``own_ids``: the records carry the candidate's generated ids (the token tap), so the engine
    check runs too."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    records = []
    for i in range(n):
        repeat = rng.choice(REPEATS[regime])
        prompt, output = structured_request(rng, repeat)
        # The engine's own output: production's (greedy), or a fresh draw for the same prompt.
        own = output_for(rng, prompt, repeat) if sampled else output
        r = replay(len(own), engine_k, *ngram_offers(prompt, own, 2, 4, 8))
        acc = {"num_drafts": r.drafts, "num_accepted_tokens": r.accepted}
        cand = leg("candidate", 0.01, 1, len(output), speculative=spec, acceptance=acc)
        r_ = record(i, prompt, output, "code", [cand])
        if own_ids:
            r_["tokens"]["legs"] = {"candidate": own}
        records.append({**r_, "greedy": not sampled})
    (live,) = build_matrix(lambda: iter(records), depths=(4,), windows=((2, 4),)).live
    assert (live["greedy"] is None) == sampled and (live["sampled"] is None) != sampled
    return bool(live["flag"])


@pytest.mark.parametrize(
    ("sampled", "regime", "own_ids", "power_min"),
    [
        (False, "common", False, 80),
        (True, "common", False, 80),
        (True, "rare", False, None),
        (True, "rare", True, 80),
    ],
)
def test_the_live_checks_false_alarms_and_power(
    sampled: bool, regime: str, own_ids: bool, power_min: int | None
) -> None:
    """Measured over 100 seeds of 60 requests. Greedy requests: the flag needs two 95 % intervals
    to be disjoint (exact agreement per request, so honest candidates are never flagged).
    Sampled ones: a paired sign-flip permutation test at α = 1 %, whose level holds whatever the
    shape of per-request acceptance — so at most 5 false alarms in 100 (P ≈ 0.0006 at α = 1 %).
    Power against a candidate that runs k = 2 while declaring k = 4: at least 80 % when requests
    repeat often. In the rare regime only about five of 60 requests can show the difference
    between two independent draws, and the sampled test alone catches it 7 times in 100 (no bound
    is held: that is what 60 such requests can tell); with the candidate's own ids in the records
    the engine check compares the same text exactly and catches it at least 80 % of the time."""
    rng = random.Random(21 + sampled + 7 * (regime == "rare") + 3 * own_ids)
    kw: dict[str, Any] = {"sampled": sampled, "regime": regime, "own_ids": own_ids}
    honest = sum(run_live_check(rng, 60, engine_k=4, **kw) for _ in range(100))
    liar = sum(run_live_check(rng, 60, engine_k=2, **kw) for _ in range(100))
    print(f"sampled={sampled} {regime} ids={own_ids}: false alarms {honest}/100, power {liar}/100")
    assert honest <= 5
    if power_min is not None:
        assert liar >= power_min
