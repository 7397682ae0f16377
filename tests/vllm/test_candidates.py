"""Two real speculative candidates side by side (``pytest -m vllm``): the n-gram and the
draft-model vLLM servers mirrored the same requests, each named by what it reports, compared
head to head, and the report's per-candidate sections and recommendation built from them."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.server import VllmServer
from core.exchange import Exchange
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.sqlite_store import query_records
from report import build_report
from specshadow.inprocess import running_gateway
from tests.vllm.conftest import trace_requests

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = trace_requests("healthbench_chat.jsonl", 6, max_tokens=32)


def two_candidates(servers: Mapping[str, VllmServer]) -> PolicyStore:
    backends: dict[str, Any] = {
        name: {"url": servers[name].base_url, "kind": "vllm"}
        for name in ("plain", "ngram", "draft")
    }
    raw = {
        "version": 1,
        "backends": backends,
        "primary": "plain",
        "default": {
            "ratio": 1.0,
            "legs": [
                {"backend": "ngram", "role": "candidate"},
                {"backend": "draft", "role": "candidate"},
            ],
        },
        "capture": {"text": "full"},
    }
    return PolicyStore(parse_policy(raw, source="two candidates"))


def has_id(request_id: str) -> Callable[[Exchange], bool]:
    return lambda exchange: exchange.request_id == request_id


async def run(servers: Mapping[str, VllmServer], store: Path) -> list[dict[str, Any]]:
    async with running_gateway(two_candidates(servers), store_path=store) as gw:
        async with openai.AsyncOpenAI(
            base_url=gw.openai_base_url, api_key="k", max_retries=0
        ) as client:
            # Warm-up exchanges until a record shows what both candidates report of themselves
            # (the server-info probe's first round can miss a server still busy with the last
            # module's traffic; a fixed sleep failed a clean CI run).
            deadline = time.monotonic() + 120
            for k in itertools.count():
                warm: dict[str, Any] = {**PROMPTS[0], "max_tokens": 2}
                await client.chat.completions.create(
                    **warm, extra_headers={"x-request-id": f"warm-{k}"}
                )
                await gw.sink.wait_for(has_id(f"warm-{k}"), timeout_s=120)
                await asyncio.sleep(0.5)  # the record's batch commits when the queue runs empty
                if _reported(store) >= {"ngram", "draft"}:
                    break
                assert time.monotonic() < deadline, (
                    "the candidates' /server_info never reached a record"
                )
            for i, body in enumerate(PROMPTS):
                request: dict[str, Any] = dict(body)
                stream = await client.chat.completions.create(
                    **request, stream=True, extra_headers={"x-request-id": f"two-{i}"}
                )
                assert [chunk async for chunk in stream]
        for i in range(len(PROMPTS)):
            await gw.sink.wait_for(has_id(f"two-{i}"), timeout_s=120)
    return [r for r in query_records(store) if str(r["request_id"]).startswith("two-")]


def _reported(store: Path) -> set[str]:
    """The backends whose own report of their speculation reached a record."""
    if not store.exists():
        return set()
    return {
        leg["backend"]
        for r in query_records(store)
        for leg in r["legs"]
        if ((leg.get("speculative") or {}).get("reported") or {}).get("source")
    }


@pytest.fixture(scope="module")
def records(
    vllm_servers: dict[str, VllmServer], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return asyncio.run(run(vllm_servers, tmp_path_factory.mktemp("two") / "r.sqlite"))


def test_every_request_reaches_both_candidates_with_the_same_text(
    records: list[dict[str, Any]],
) -> None:
    assert len(records) == len(PROMPTS)
    for record in records:
        legs = {leg["backend"]: leg for leg in record["legs"]}
        assert set(legs) == {"plain", "ngram", "draft"}
        assert all(leg["outcome"] == "completed" for leg in legs.values())
        assert len({leg["output"]["sha256"] for leg in legs.values()}) == 1  # lossless, greedy
        assert {c["b_backend"] for c in record["comparisons"]} == {"ngram", "draft"}


def test_the_report_names_each_candidate_and_compares_them(
    records: list[dict[str, Any]], tmp_path: Path
) -> None:
    paths = build_report(records, None, tmp_path / "report")
    a = paths.analysis
    assert {b: c.label for b, c in a.candidates.items()} == {
        "ngram": "ngram k=4",
        "draft": "draft_model k=4",
    }  # read from each server's /server_info
    assert all(
        c.speculation is not None and c.speculation.verification == "lossless"
        for c in a.candidates.values()
    )
    (overall,) = [h for h in a.head_to_head if h.category == "all"]
    assert (overall.a, overall.b, overall.mirrored) == ("ngram", "draft", len(records))
    assert set(a.recommendations) >= {"all"}
    html = paths.html.read_text()
    assert "Head to head" in html and "— draft_model k=4" in html and "— ngram k=4" in html
