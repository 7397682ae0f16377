"""Dynamic lookahead rules replayed: by hand, against the simulator's own rule-following
proposers request by request, and end to end through the gateway against what a simulated
candidate running the rule reported."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from core.classify import ALL
from counterfactual.grid import Config
from counterfactual.matrix import build_matrix
from counterfactual.render import policy_fragment, render_markdown
from counterfactual.replay import confidence_offers, drafter_offers, ngram_offers, replay
from counterfactual.rules import (
    batch_schedule,
    confidence,
    elastic,
    ema_tiers,
    heuristic,
    parse_rule,
)
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.readback import iter_records
from records.sqlite_store import query_records
from simulator.acceptance import replay_steps
from simulator.drafter import confidences, drafter_proposer, predictions
from simulator.lookahead import schedule
from simulator.ngram import find_longest_matched_ngram_and_propose_tokens as vllm_port
from specshadow.inprocess import running_gateway
from tests.counterfactual.test_gateway import has_id
from tests.counterfactual.test_matrix import record, structured_request

RULES = {
    "heuristic:start=4,floor=1,cap=8": heuristic(4, 1, 8),
    "heuristic:start=2,floor=2,cap=6": heuristic(2, 2, 6),
    "ema_tiers": ema_tiers(),
    "ema_tiers:tiers=1/3/5,start=3,weight=0.5,up=0.9,down=0.3": ema_tiers((1, 3, 5), 3, 0.5, 0.9, 0.3),
    "elastic": elastic(),
    "elastic:tiers=2/4,thresholds=0.6": elastic((2, 4), (0.6,)),
}  # fmt: skip


def test_the_heuristic_by_hand() -> None:
    """n = 4: a full accept (n → 6), a miss (n → 5), a full accept (n → 7), then a draft the
    output's end cut to 4 < 7 — a miss, though every drafted token was accepted."""
    n = 20
    match = [0] * n
    match[1], match[6], match[9], match[15] = 4, 2, 5, 4
    r = replay(n, 0, [8] * n, match, rule=heuristic(4, 1, 8))
    assert (r.drafts, r.draft_tokens, r.accepted, r.passes) == (4, 4 + 6 + 5 + 4, 15, 5)
    assert r.mean_acceptance_length == 1 + 15 / 4
    assert r.rejected_at == (8,)  # the step at 6 accepted 2 of 6: output token 8 was rejected
    assert r.accepted_by_position[:6] == (4, 4, 3, 3, 1, 0)


def _sim_totals(steps: Sequence[Any]) -> tuple[int, int, int]:
    drafting = [s for s in steps if s.drafted]
    return len(drafting), sum(s.drafted for s in drafting), sum(s.accepted for s in drafting)


@pytest.mark.parametrize("spec", RULES)
def test_ngram_rules_replay_what_the_simulators_proposer_did_request_by_request(spec: str) -> None:
    rule = RULES[spec]
    assert parse_rule(spec) == rule
    rng = random.Random(5)
    for _ in range(150):
        prompt, output = structured_request(rng, repeat=rng.choice([0.3, 0.7, 0.95]))

        def propose(context: Sequence[int], k: int) -> list[int]:
            return vllm_port(context, 2, 4, 4096, k)

        truth = replay_steps(prompt, output, k=4, propose=propose, lookahead=schedule(spec))
        mine = replay(len(output), 0, *ngram_offers(prompt, output, 2, 4, rule.cap), rule=rule)
        assert (mine.drafts, mine.draft_tokens, mine.accepted) == _sim_totals(truth), spec
        assert mine.passes == len(truth)


def test_draft_model_rules_and_the_confidence_exit_replay_the_simulated_drafter() -> None:
    """A draft model under every rule; under the confidence exit the accepted counts and drafting
    steps are exact and the drafted tokens a lower bound (past a wrong prediction the drafter's
    context is its own token, which no record holds)."""
    rng = random.Random(8)
    specs = {**RULES, "confidence:threshold=0.7,cap=6": confidence(0.7, 6)}
    strictly_fewer = 0
    for spec, rule in specs.items():
        for _ in range(60):
            prompt = [rng.randrange(40, 200) for _ in range(rng.randint(5, 20))]
            output = [rng.randrange(40, 200) for _ in range(rng.randint(10, 60))]
            full = [*prompt, *output]
            match = 0.8
            threshold = rule.get("threshold") if rule.name == "confidence" else None
            propose = drafter_proposer(full, match, threshold=threshold)
            truth = _sim_totals(
                replay_steps(prompt, output, k=4, propose=propose, lookahead=schedule(spec))
            )
            predicted = predictions(full, match)[len(prompt) :]
            assert all(p is not None for p in predicted)
            if rule.name == "confidence":
                probs = confidences(full, match)[len(prompt) :]
                offers = confidence_offers(output, predicted, probs, threshold, rule.cap)  # type: ignore[arg-type]
            else:
                offers = drafter_offers(output, predicted)  # type: ignore[arg-type]
            mine = replay(len(output), 0, *offers, rule=rule)
            if rule.name == "confidence":
                assert (mine.drafts, mine.accepted) == (truth[0], truth[2])
                assert mine.draft_tokens <= truth[1]
                strictly_fewer += mine.draft_tokens < truth[1]
            else:
                assert (mine.drafts, mine.draft_tokens, mine.accepted) == truth, spec
    assert strictly_fewer > 0  # the bound is a bound, not an accident of equal counts


def test_rule_rows_are_labelled_and_a_batch_schedule_is_a_bound_between_its_depths() -> None:
    rng = random.Random(3)
    records = []
    for i in range(40):
        prompt, output = structured_request(rng, repeat=0.8 if i % 2 else 0.2)
        records.append(record(i, prompt, output, "code" if i % 2 else "chat"))
    sched = batch_schedule(((1, 6), (8, 2), (32, 0)))
    m = build_matrix(
        lambda: iter(records), windows=((2, 4),), rules=(heuristic(), ema_tiers(), sched)
    )
    rows = [r for r in m.rows if r["output_length_bucket"] == ALL and r["category"] == ALL]
    by_rule = {r["rule_name"]: r for r in rows if r["rule"] is not None}
    assert set(by_rule) == {"heuristic", "ema_tiers", "batch_schedule"}
    h = by_rule["heuristic"]
    assert h["replay_class"] == "exact" and h["rule"].startswith("heuristic start=4 floor=1 cap=8")
    assert h["rule_params"] == {"start": 4, "floor": 1, "cap": 8, "up": 2, "down": 1}
    assert h["label"] == "ngram lookup 2-4 " + h["rule"]
    # Recomputed from the records by hand: the pooled ratio of the per-request replays.
    drafts = accepted = 0
    for rec in records:
        t = rec["tokens"]
        r = replay(len(t["output"]), 0, *ngram_offers(t["prompt"], t["output"], 2, 4, 8),
                   rule=heuristic())  # fmt: skip
        drafts, accepted = drafts + r.drafts, accepted + r.accepted
    assert h["mean_acceptance_length"]["estimate"] == pytest.approx(1 + accepted / drafts)
    b = by_rule["batch_schedule"]
    assert b["replay_class"] == "bound" and b["mean_acceptance_length"]["estimate"] is None
    fixed = {
        r["num_speculative_tokens"]: r["mean_acceptance_length"]["estimate"]
        for r in rows
        if r["rule"] is None and r["prompt_lookup_max"] == 4
    }
    assert b["mean_acceptance_length"]["low"] == 1.0  # k = 0 at batch 32: plain decoding
    assert b["mean_acceptance_length"]["high"] == pytest.approx(max(fixed[2], fixed[6]))
    # Every fixed row is exact, the rules' classes are in the summary with where they run.
    assert all(r["replay_class"] == "exact" for r in rows if r["rule"] is None)
    rules = {r["rule_name"]: r for r in m.as_json()["rules"]}
    assert "num_assistant_tokens_schedule='heuristic'" in rules["heuristic"]["how_to_run"]
    assert "Dynamic lookahead" in render_markdown(m)
    # A rule may be the pick; the fragment then says how to run it where it exists.
    assert m.picks["code"]["config"] is not None
    fragment = policy_fragment(m)
    assert fragment is not None
    if any(c.rule is not None for c in m.deploy):
        assert "transformers" in fragment or "SGLang" in fragment or "no engine" in fragment


def test_parse_rule_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        parse_rule("fancy")
    with pytest.raises(ValueError, match="floor <= start <= cap"):
        parse_rule("heuristic:start=9,cap=8")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_rule("heuristic:start")
    assert parse_rule("batch_schedule:1=8/16=2").text == "batch_schedule batches=1/16 tiers=8/2"
    assert Config("ngram", 8, 2, 4, rule=heuristic()).replay_class == "exact"
    assert Config("draft_model", 8, drafter="d", rule=confidence()).replay_class == (
        "exact_given_drafter"
    )


async def test_a_simulated_candidate_running_the_heuristic_is_what_its_row_predicts(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """A simulated n-gram candidate whose proposer follows Hugging Face's heuristic (start 4,
    cap 8, floor 1): the matrix's heuristic row, replayed from production's outputs, equals
    what the candidate's engine reported, pooled over the same requests."""
    copy = {"copy": 0.0, "category_copy": {"code": 0.85, "chat": 0.0}}
    plain = await sims(model="sim-model", **copy, max_output_tokens=96)
    spec = await sims(
        model="sim-model", mode="speculative", drafting="replay", proposer="ngram",
        num_speculative_tokens=8, prompt_lookup_min=2, prompt_lookup_max=4, **copy,
        max_output_tokens=96, lookahead="heuristic:start=4,floor=1,cap=8",
    )  # fmt: skip
    raw: dict[str, Any] = {
        "version": 1,
        "backends": {
            "primary": {"url": plain.base_url, "kind": "sim"},
            "ngram": {"url": spec.base_url, "kind": "sim"},
        },
        "primary": "primary",
        "default": {"ratio": 1.0, "legs": [{"backend": "ngram", "role": "candidate"}]},
        "shaping": {"include_metrics": True},
        "counterfactual": {"tokenizer": "ngram", "share": 1.0},
    }
    store = tmp_path / "r.sqlite"
    code = (
        "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    )
    async with (
        running_gateway(PolicyStore(parse_policy(raw, source="rules")), store_path=store) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
    ):
        for i in range(16):
            prompt = code if i % 2 == 0 else "Tell me about spring walks."
            await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": f"{prompt} (variant {i})"}],
                max_tokens=64,
                temperature=0,
                extra_headers={"x-request-id": f"r-{i}",
                               "x-specshadow-category": "code" if i % 2 == 0 else "chat"},
            )  # fmt: skip
        for i in range(16):
            await gw.sink.wait_for(has_id(f"r-{i}"), timeout_s=30)
    records = list(query_records(store))
    drafts = accepted = 0
    for r in records:
        acceptance = next(leg for leg in r["legs"] if leg["role"] == "candidate")["acceptance"]
        drafts += acceptance.get("num_drafts") or 0
        accepted += acceptance.get("num_accepted_tokens") or 0
    assert drafts >= 20
    m = await asyncio.to_thread(
        build_matrix, lambda: iter_records([store]), windows=((2, 4),), rules=(heuristic(),)
    )
    (row,) = [
        r for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL and r["rule_name"] == "heuristic"
    ]  # fmt: skip
    assert row["replay_class"] == "exact"
    assert row["mean_acceptance_length"]["estimate"] == pytest.approx(1 + accepted / drafts)


async def test_the_confidence_exit_row_is_what_a_candidate_running_it_reported(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """A simulated drafter answers prompt_logprobs (the token tap keeps its rank-1 ids and their
    probabilities); the live candidate drafts with it and stops after a token under 0.7. The
    confidence row (exact given the drafter) equals what the candidate reported, pooled."""
    match = 0.7
    plain = await sims(model="sim-model", drafter_match=match)
    drafter = await sims(model="sim-model", drafter_match=match)
    candidate = await sims(model="sim-model", mode="speculative", drafting="replay",
                           proposer="draft_model", num_speculative_tokens=6, drafter_match=match,
                           lookahead="confidence:threshold=0.7,cap=6")  # fmt: skip
    raw = {
        "version": 1,
        "backends": {
            "primary": {"url": plain.base_url, "kind": "sim"},
            "draft": {"url": candidate.base_url, "kind": "sim"},
            "drafter": {"url": drafter.base_url, "kind": "sim"},
        },
        "primary": "primary",
        "default": {"ratio": 1.0, "legs": [{"backend": "draft", "role": "candidate"}]},
        "shaping": {"include_metrics": True},
        "counterfactual": {"tokenizer": "draft", "drafters": ["drafter"], "share": 1.0},
    }
    store = tmp_path / "r.sqlite"
    async with (
        running_gateway(
            PolicyStore(parse_policy(raw, source="confidence")), store_path=store
        ) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
    ):
        for i in range(12):
            await client.chat.completions.create(
                model="sim-model", max_tokens=48, temperature=0,
                messages=[{"role": "user", "content": f"Tell me a story about a lighthouse, part {i}."}],
                extra_headers={"x-request-id": f"c-{i}"},
            )  # fmt: skip
            await gw.sink.wait_for(has_id(f"c-{i}"), timeout_s=30)
    records = list(iter_records([store]))
    assert all(r["tokens"]["drafter_confidence"]["drafter"] for r in records)
    drafts = accepted = 0
    for r in records:
        acc = next(leg for leg in r["legs"] if leg["role"] == "candidate")["acceptance"]
        drafts += acc.get("num_drafts") or 0
        accepted += acc.get("num_accepted_tokens") or 0
    m = await asyncio.to_thread(
        build_matrix, lambda: iter(records), windows=(), rules=(),
        drafter_rules=(confidence(0.7, 6),),
    )  # fmt: skip
    (row,) = [
        r for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL and r["rule_name"] == "confidence"
    ]  # fmt: skip
    assert row["replay_class"] == "exact_given_drafter" and row["drafter"] == "drafter"
    assert drafts >= 20
    assert row["mean_acceptance_length"]["estimate"] == pytest.approx(1 + accepted / drafts)
