"""A draft model scored from one teacher-forced pass, against a candidate that drafts with it.

The simulated drafter's greedy prediction of each token is a function of the ids before it (the
same on every server), so a plain simulator answering ``prompt_logprobs`` is the drafter backend,
and a speculative simulator whose drafts are that drafter's (``proposer="draft_model"``, replay)
is the live candidate. The token tap asks the drafter for its predictions along production's
output; every depth of the draft-model rows must then equal what a candidate at that depth
reports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from core.exchange import Exchange
from counterfactual.matrix import ALL, build_matrix
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.readback import iter_records
from specshadow.inprocess import running_gateway

MATCH = 0.7


def has_id(request_id: str) -> Callable[[Exchange], bool]:
    return lambda exchange: exchange.request_id == request_id


async def run(sims: Callable[..., Awaitable[Any]], store: Path, k: int) -> None:
    plain = await sims(model="sim-model", drafter_match=MATCH)
    drafter = await sims(model="sim-model", drafter_match=MATCH)
    candidate = await sims(model="sim-model", mode="speculative", drafting="replay",
                           proposer="draft_model", num_speculative_tokens=k, drafter_match=MATCH)  # fmt: skip
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
    store_policy = PolicyStore(parse_policy(raw, source="drafter test"))
    async with (
        running_gateway(store_policy, store_path=store) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
    ):
        for i in range(16):
            await client.chat.completions.create(
                model="sim-model", max_tokens=48, temperature=0,
                messages=[{"role": "user", "content": f"Tell me a story about a lighthouse, part {i}."}],
                extra_headers={"x-request-id": f"d-{i}"},
            )  # fmt: skip
            await gw.sink.wait_for(has_id(f"d-{i}"), timeout_s=30)


def measured(store: Path) -> float:
    drafts = accepted = 0
    for record in iter_records([store]):
        acc = next(leg for leg in record["legs"] if leg["role"] == "candidate")["acceptance"]
        drafts += acc["num_drafts"] or 0
        accepted += acc["num_accepted_tokens"] or 0
    return 1 + accepted / drafts


@pytest.mark.parametrize("k", [2, 5])
async def test_every_depth_of_the_drafter_matches_a_candidate_at_that_depth(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path, k: int
) -> None:
    store = tmp_path / "r.sqlite"
    await run(sims, store, k)
    records = list(iter_records([store]))
    assert all(
        r["tokens"] and len(r["tokens"]["drafters"]["drafter"]) == len(r["tokens"]["output"])
        for r in records
    )
    m = build_matrix(lambda: iter_records([store]))
    rows = {
        r["num_speculative_tokens"]: r
        for r in m.rows
        if r["proposer"] == "draft_model"
        and r["category"] == ALL
        and r["output_length_bucket"] == ALL
    }
    assert sorted(rows) == list(range(1, 9)) and rows[k]["drafter"] == "drafter"
    assert rows[k]["mean_acceptance_length"]["estimate"] == pytest.approx(
        measured(store), rel=1e-12
    )
    # Every position accepted with the drafter's match rate (per position, given the previous).
    by_position = rows[8]["acceptance_by_position"]
    assert by_position[0] == pytest.approx(MATCH, abs=0.1)
