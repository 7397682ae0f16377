"""The verdict does not depend on what the client asked: the official SDK at its defaults streams
without usage, and the report must read the same traffic as it does with ``include_usage``.

Ground truth: scripted upstreams (:mod:`tests.fakes.scripted_llm`) answer the very same 48 tokens;
the candidate streams them 2.5× faster per token (two tokens every 16 ms against one every 20 ms),
so its TPOT speed-up is known from the script, its output is byte-identical, and nothing
about it may read as "not equivalent" or "do not adopt". The gateway is the policy-free start
(``--primary`` and ``--shadow``), the client the ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import openai
import pytest

from records.reader import read
from records.sqlite_store import query_records
from report.analysis import ALL, analyze
from report.front import front
from tests.conftest import start_server
from tests.fakes.scripted_llm import ANSWER, ScriptedLLM

REQUESTS = 24
CONCURRENCY = 8
TEXT = "".join(ANSWER)


async def scripted(servers: list[Any], llm: ScriptedLLM) -> str:
    server = await start_server(llm.app())
    servers.append(server)
    return str(server.make_url("")).rstrip("/")


async def traffic(
    gateway: Any,
    servers: list[Any],
    tmp_path: Path,
    *,
    candidates: dict[str, ScriptedLLM],
    route: str = "chat",
    stream: bool = True,
    include_usage: bool | None = False,
    temperature: float | None = None,
    requests: int = REQUESTS,
    answer: tuple[str, ...] = ANSWER,
) -> list[dict[str, Any]]:
    """Drive ``requests`` requests through a policy-free gateway with the SDK; its records.

    ``include_usage=None``: every other request asks for usage (request ids ``u<i>``), the rest
    keep the SDK's default (``d<i>``) — one run, both at the same moment, the same load."""
    primary = await scripted(servers, ScriptedLLM(answer=answer))
    shadows = [await scripted(servers, llm) for llm in candidates.values()]
    store = tmp_path / f"{route}-{stream}-{include_usage}.sqlite"
    gw = await gateway(primary, shadow_urls=tuple(shadows), store_path=str(store))
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0)
    gate = asyncio.Semaphore(CONCURRENCY)
    base: dict[str, Any] = {} if temperature is None else {"temperature": temperature}
    usage = {"stream_options": {"include_usage": True}}

    async def one(i: int) -> str:
        asks = include_usage if include_usage is not None else i % 2 == 1
        extra = {**base, **(usage if asks else {})}
        if include_usage is None:
            extra["extra_headers"] = {"x-request-id": f"{'u' if asks else 'd'}{i}"}
        async with gate:
            if route == "chat":
                messages: Any = [{"role": "user", "content": f"question {i}"}]
                if not stream:
                    done = await client.chat.completions.create(
                        model="scripted", messages=messages, **base
                    )
                    return done.choices[0].message.content or ""
                chunks = await client.chat.completions.create(
                    model="scripted", messages=messages, stream=True, **extra
                )
                return "".join(
                    [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                )
            if not stream:
                plain = await client.completions.create(
                    model="scripted", prompt=f"question {i}", **base
                )
                return plain.choices[0].text
            pieces = await client.completions.create(
                model="scripted", prompt=f"question {i}", stream=True, **extra
            )
            return "".join([c.choices[0].text async for c in pieces if c.choices])

    try:
        answers = await asyncio.gather(*(one(i) for i in range(requests)))
        assert answers == ["".join(answer)] * requests  # the client got the primary's answer
        await gw.sink.wait_for(lambda e: len(gw.sink.exchanges) >= requests)
    finally:
        await client.close()
        await gw.server.close()  # drains the evidence pipeline into the store
    records = list(query_records(store))
    assert len(records) == requests
    return records


def candidate_backend(analysis: Any, index: int = 1) -> Any:
    return analysis.candidates[f"shadow-{index}"]


def verdict_all(cand: Any) -> Any:
    return next(v for v in cand.verdicts if v.category == ALL)


FAST = {"fast": ScriptedLLM(gap_s=0.016, tokens_per_event=2)}
LONG = ANSWER * 2  # 96 tokens: a late event on a loaded machine weighs half as much


async def default_and_usage_runs(
    gateway: Any, servers: Any, tmp_path: Any
) -> tuple[dict[str, ScriptedLLM], list[Any], list[Any]]:
    """One run, the two client settings interleaved: a direct A/B at the same load."""
    fast = {"fast": dataclasses.replace(FAST["fast"], answer=LONG)}
    both = await traffic(
        gateway, servers, tmp_path, candidates=fast, include_usage=None, requests=48, answer=LONG
    )
    default = [r for r in both if str(r["request_id"]).startswith("d")]
    with_usage = [r for r in both if str(r["request_id"]).startswith("u")]
    assert len(default) == len(with_usage) == 24
    return fast, default, with_usage


async def test_the_sdk_defaults_give_the_counts_and_equivalence_include_usage_gives(
    gateway, servers, tmp_path
):
    _fast, default, with_usage = await default_and_usage_runs(gateway, servers, tmp_path)

    # Each leg says where its count came from: the primary's stream had no usage, so it takes
    # the count of the candidate that answered the very same bytes.
    for r in map(read, default):
        primary, cand = r.primary, r.legs[1]
        assert primary is not None
        assert primary.tokens_source == "matched"
        assert primary.tokens_reported_source == "estimated"
        assert cand.tokens_source == "usage" and cand.tokens_reported_source is None
        assert primary.output_tokens == cand.output_tokens == len(LONG)
        assert primary.tokens_per_event == pytest.approx(1.0)
    for r in map(read, with_usage):
        assert {leg.tokens_source for leg in r.legs} == {"usage"}

    # The report's first screen says how the counts were compared, where any was not the leg's.
    said = {name: analyze(r).counts for name, r in (("default", default), ("usage", with_usage))}
    assert said["default"] is not None and said["usage"] is not None
    sentence = said["default"].sentence()
    assert sentence is not None and f"{len(default)} of {2 * len(default)} legs" in sentence
    assert "took the exact count of a leg that answered the same output" in sentence
    assert said["usage"].sentence() is None
    assert any(line.kind == "counts" for line in front(analyze(default)))

    for name, records in (("default", default), ("include_usage", with_usage)):
        cand = candidate_backend(analyze(records))
        for eq in cand.equivalence.values():
            assert eq.verdict != "not_equivalent", (name, eq.summary())
            length = eq.metrics.get("length_ratio")
            assert length is None or length.difference == pytest.approx(0.0, abs=1e-12)
        assert verdict_all(cand).tpot is not None


# The measured TPOT speed-up of each client setting, held to the other's and to the scripts'
# truth on the wall clock: the timing tier (docs/testing.md).
@pytest.mark.timing
async def test_the_sdk_defaults_give_the_verdict_include_usage_gives(gateway, servers, tmp_path):
    fast, default, with_usage = await default_and_usage_runs(gateway, servers, tmp_path)
    speedups = {}
    for name, records in (("default", default), ("include_usage", with_usage)):
        v = verdict_all(candidate_backend(analyze(records)))
        assert v.decision != "do_not_adopt", (name, v.reasons)
        assert v.tpot is not None
        speedups[name] = v.tpot.point
    assert speedups["default"] == pytest.approx(speedups["include_usage"], rel=0.05)
    truth = ScriptedLLM(answer=LONG).tpot_s() / fast["fast"].tpot_s()  # 2.53 by the scripts
    assert speedups["default"] == pytest.approx(truth, rel=0.15)


@pytest.mark.parametrize(
    ("route", "stream"),
    [("chat", False), ("completions", True), ("completions", False)],
    ids=["chat-whole", "completions-stream", "completions-whole"],
)
async def test_byte_identical_outputs_are_never_judged_different(
    route, stream, gateway, servers, tmp_path
):
    records = await traffic(gateway, servers, tmp_path, candidates=FAST, route=route, stream=stream)
    for r in map(read, records):
        counts = {leg.output_tokens for leg in r.legs}
        assert counts == {len(ANSWER)}, [(leg.tokens_source, leg.output_tokens) for leg in r.legs]
        assert r.comparisons[0].exact_match is True
    cand = candidate_backend(analyze(records))
    for eq in cand.equivalence.values():
        assert eq.verdict != "not_equivalent", eq.summary()
    if stream:  # the counts above make TPOT a figure (its value against the truth: timing tier)
        assert verdict_all(cand).tpot is not None


# A measured speed-up decides the pick: the timing tier (docs/testing.md), run alone, once.
@pytest.mark.timing
async def test_three_candidates_without_usage_recommend_the_fast_lossless_one(
    gateway, servers, tmp_path
):
    """The lossy candidate (another answer, exact-match judged on greedy requests) is never
    recommended; of the two lossless ones the faster is. The bound: the primary sends a token every
    20 ms, "slow" one every 18 ms and "fast" two every 16 ms (1.1× and 2.5× the primary by the
    scripts' schedule); the assumption is that the machine's delays, shared by the legs of an
    exchange, leave "fast" adopted with the larger paired speed-up."""
    other = tuple(" " + w for w in ("A", "different", "answer", "entirely") * 12)
    candidates = {
        "slow": ScriptedLLM(gap_s=0.018),
        "fast": ScriptedLLM(gap_s=0.016, tokens_per_event=2),
        "lossy": ScriptedLLM(answer=other, gap_s=0.012, tokens_per_event=3),
    }
    # Greedy requests (temperature 0, otherwise the SDK's defaults): the exact-match path judges
    # quality, so a few dozen exchanges decide.
    records = await traffic(gateway, servers, tmp_path, candidates=candidates, temperature=0)
    for r in map(read, records):
        by = {leg.backend: leg for leg in r.legs}
        # The lossy candidate's output differs, so no leg was matched to it; the primary is
        # matched to the identical ones, and every count is exact.
        assert by["primary"].tokens_source == "matched"
        assert by["shadow-3"].tokens_source == "usage"
    a = analyze(records)
    assert a.recommendations[ALL] is not None
    assert a.recommendations[ALL].backend == "shadow-2", {
        b: [(v.decision, v.reasons) for v in c.verdicts] for b, c in a.candidates.items()
    }
