"""The whole path on real sockets, against a simulator whose drafts are vLLM's n-gram proposer.

A plain simulator is the primary; a speculative simulator in replay mode (its drafts really are
vLLM's n-gram proposer over its own token ids, accepted iff equal to its predetermined output)
is the live candidate and the tokenizer. The gateway's token tap puts ids in the records; the
counterfactual matrix over them must predict, for the configuration the candidate runs, exactly
the acceptance the candidate reported — request by request, so pooled too — and the grid's
other depths are checked against the simulator run at those depths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from core import jsonx
from core.exchange import Exchange
from counterfactual.matrix import ALL, build_matrix
from counterfactual.replay import ngram_offers, replay
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.readback import iter_records
from records.sqlite_store import query_records
from specshadow.inprocess import running_gateway
from specshadow.main import main as cli_main

CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    "    return result\n\nRename result to subtotal and add a docstring to total(items)."
)
CHAT = "Tell me about the weather in spring and what to wear on a walk."
COPY = {"copy": 0.0, "category_copy": {"code": 0.85, "chat": 0.0}}


def policy(primary: str, candidate: str, *, share: float = 1.0) -> PolicyStore:
    raw: dict[str, Any] = {
        "version": 1,
        "backends": {
            "primary": {"url": primary, "kind": "sim"},
            "ngram": {"url": candidate, "kind": "sim"},
        },
        "primary": "primary",
        "default": {"ratio": 1.0, "legs": [{"backend": "ngram", "role": "candidate"}]},
        "shaping": {"include_metrics": True},
        "counterfactual": {"tokenizer": "ngram", "share": share},
    }
    return PolicyStore(parse_policy(raw, source="counterfactual test"))


def has_id(request_id: str) -> Callable[[Exchange], bool]:
    return lambda exchange: exchange.request_id == request_id


async def run(
    sims: Callable[..., Awaitable[Any]], store: Path, n: int, *, k: int = 4, share: float = 1.0
) -> None:
    plain = await sims(model="sim-model", **COPY, max_output_tokens=96)
    spec = await sims(
        model="sim-model", mode="speculative", drafting="replay", proposer="ngram",
        num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4, **COPY,
        max_output_tokens=96,
    )  # fmt: skip
    async with (
        running_gateway(policy(plain.base_url, spec.base_url, share=share), store_path=store) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
    ):
        for i in range(n):
            prompt = CODE if i % 2 == 0 else CHAT
            await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": f"{prompt} (variant {i})"}],
                max_tokens=64,
                temperature=0 if i % 3 else 0.8,
                extra_headers={
                    "x-request-id": f"cf-{i}",
                    "x-specshadow-category": "code" if i % 2 == 0 else "chat",
                },
            )
        for i in range(n):
            await gw.sink.wait_for(has_id(f"cf-{i}"), timeout_s=30)


async def test_the_prediction_for_the_live_configuration_equals_what_the_candidate_reported(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    store = tmp_path / "r.sqlite"
    await run(sims, store, 24)
    records = list(query_records(store))
    assert len(records) == 24
    assert all(r["tokens"] is not None for r in records)
    for r in records:
        t = r["tokens"]
        assert t["source"] == "tokenize:ngram" and t["leg"] == "primary"
        assert len(t["output"]) == t["output_tokens_reported"]  # re-tokenizing lost nothing
    m = build_matrix(lambda: iter_records([store]))
    (live,) = m.live
    assert (
        live["num_speculative_tokens"],
        live["prompt_lookup_min"],
        live["prompt_lookup_max"],
    ) == (4, 2, 4)
    # The engine reports no speculative block for a request none of whose steps drafted (as
    # vLLM does); those requests are left out of the pairing — and the replay drafted nothing
    # on them either.
    reported = [
        r for r in records
        if next(leg for leg in r["legs"] if leg["role"] == "candidate")["acceptance"]["num_drafts"] is not None
    ]  # fmt: skip
    assert live["predicted_mean_acceptance_length"]["n"] == len(reported) >= 12
    silent = [r for r in records if r not in reported]
    for r in silent:
        t = r["tokens"]
        offers = ngram_offers(t["prompt"], t["output"], 2, 4, 4)
        assert replay(len(t["output"]), 4, *offers).drafts == 0
    assert live["predicted_mean_acceptance_length"]["estimate"] == pytest.approx(
        live["measured_mean_acceptance_length"]["estimate"], rel=1e-12
    )
    assert not live["flag"]
    overall = {
        r["num_speculative_tokens"]: r
        for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL
        and (r["prompt_lookup_min"], r["prompt_lookup_max"]) == (2, 4)
    }  # fmt: skip
    assert sorted(overall) == list(range(1, 9))
    live_rows = {
        r["category"]: r["mean_acceptance_length"]["estimate"]
        for r in m.rows
        if r["output_length_bucket"] == ALL and r["num_speculative_tokens"] == 4
        and (r["prompt_lookup_min"], r["prompt_lookup_max"]) == (2, 4)
    }  # fmt: skip
    assert live_rows["code"] > 2.0 > live_rows["chat"] >= 1.0
    assert set(m.picks) == {"all", "code", "chat"}


async def test_other_depths_match_the_simulator_run_at_that_depth(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """Scored from a k=4 candidate's run, the k=2 row equals what a k=2 candidate reports."""
    at4, at2 = tmp_path / "k4.sqlite", tmp_path / "k2.sqlite"
    await run(sims, at4, 12, k=4)
    await run(sims, at2, 12, k=2)
    m4 = build_matrix(lambda: iter_records([at4]))
    (measured2,) = build_matrix(lambda: iter_records([at2])).live
    row = next(
        r for r in m4.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL
        and r["num_speculative_tokens"] == 2 and r["prompt_lookup_max"] == 4 and r["prompt_lookup_min"] == 2
    )  # fmt: skip
    assert row["mean_acceptance_length"]["estimate"] == pytest.approx(
        measured2["measured_mean_acceptance_length"]["estimate"], rel=1e-12
    )


async def test_only_the_share_is_tokenized_and_the_cli_writes_the_matrix(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    store = tmp_path / "r.sqlite"
    await run(sims, store, 40, share=0.3)
    records = list(query_records(store))
    with_tokens = sum(r["tokens"] is not None for r in records)
    assert len(records) == 40 and 2 <= with_tokens <= 24  # Binomial(40, 0.3): 12 ± 2.9
    out = tmp_path / "cf"
    # In a thread: the CLI asks the candidate simulator (on this loop) for token texts.
    args = ["counterfactual", "--store", str(store), "--out", str(out)]
    assert await asyncio.to_thread(cli_main, args) == 0
    assert {p.name for p in out.iterdir()} >= {
        "counterfactual.json",
        "counterfactual.md",
        "candidates.yaml",
    }
    assert "ngram" in (out / "candidates.yaml").read_text()
    # The token texts came from the simulator's /detokenize: every all-lengths row of every
    # category attributes its rejections, and the shares sum to 1.
    rows = jsonx.loads((out / "counterfactual.json").read_bytes())
    attributed = [
        r
        for r in rows
        if r["output_length_bucket"] == ALL
        and r["rejections"]
        and sum(v["rejections"] for v in r["rejections"].values())
    ]
    assert {r["category"] for r in attributed} >= {"code", "chat", ALL}
    for r in attributed:
        assert sum(v["rejection_share"] for v in r["rejections"].values()) == pytest.approx(1.0)
        assert sum(v["output_share"] for v in r["rejections"].values()) == pytest.approx(1.0)
    empty = tmp_path / "empty.sqlite"
    await run(sims, empty, 2, share=0.0)
    args = ["counterfactual", "--store", str(empty), "--out", str(tmp_path / "none")]
    assert await asyncio.to_thread(cli_main, args) == 1


async def test_a_store_without_token_ids_is_tokenized_from_its_captured_text(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """No ``counterfactual:`` section, but ``capture: full``: the command tokenizes the records'
    text with the candidate's server (found in the records; never the primary's) and scores it.
    The prompt's text lacks the chat template's tokens, so the prediction is near, not exact."""
    plain = await sims(model="sim-model", **COPY, max_output_tokens=96)
    spec = await sims(
        model="sim-model", mode="speculative", drafting="replay", proposer="ngram",
        num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, **COPY,
        max_output_tokens=96,
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
        "capture": {"text": "full"},
    }
    store = tmp_path / "r.sqlite"
    async with (
        running_gateway(
            PolicyStore(parse_policy(raw, source="capture only")), store_path=store
        ) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
    ):
        for i in range(16):
            await client.chat.completions.create(
                model="sim-model", max_tokens=64, temperature=0,
                messages=[{"role": "user", "content": f"{CODE} (variant {i})"}],
                extra_headers={"x-request-id": f"c-{i}", "x-specshadow-category": "code"},
            )  # fmt: skip
            await gw.sink.wait_for(has_id(f"c-{i}"), timeout_s=30)
    assert all(r["tokens"] is None for r in query_records(store))
    out = tmp_path / "cf"
    primary = plain.base_url
    args = ["counterfactual", "--store", str(store), "--out", str(out)]
    # The simulators share this event loop: the command (blocking HTTP) runs in a thread.
    assert await asyncio.to_thread(cli_main, [*args, "--tokenizer", primary]) == 2
    assert await asyncio.to_thread(cli_main, args) == 0
    summary = jsonx.loads((out / "counterfactual_summary.json").read_bytes())
    (live,) = summary["live"]
    assert live["predicted_mean_acceptance_length"]["n"] >= 12
    assert abs(live["relative_gap"]) <= 0.15, live
