"""The gateway in front of real llama.cpp servers (PyPI ``xllamacpp``), driven by the official
``openai`` SDK at its defaults (docs/llamacpp.md).

Servers (session fixture, see conftest): ``plain``, ``draft`` (draft-simple, depth 4),
``ngram-mod`` and ``ngram-map-k``; the tiny models of ``specshadow vllm setup`` as GGUF. Prompts:
the first short rows of both vendored traces, greedy, 32 tokens at most, every other one streamed.

- The issue's "done when": ``specshadow serve --primary <plain> --shadow <draft>`` as a process,
  no policy and no kinds stated: both are found to be ``llamacpp``; every answer the SDK got equals
  what the primary answers to the same request alone; every candidate leg completed and carries
  ``llamacpp_timings`` counts whose sums equal the increase of the draft server's own
  ``/metrics`` counters exactly; its engine is ``llamacpp`` with the draft-simple block; the
  report judges the candidate equivalent (greedy).
- The n-gram servers stated as ``kind: llamacpp`` in a policy: the same exact sums.
- Connections: llama.cpp closes after every streamed answer; a bare pooled client loses requests
  to it, the gateway's upstream client none.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest

from backends.llamacpp import SERVED_MODEL_NAME, LlamaServer
from gateway.errors import UpstreamError
from gateway.settings import UpstreamSettings
from gateway.upstream import UpstreamClient, UpstreamTarget
from records.readback import read_records
from report.analysis import analyze
from tests.reliability.helpers import spawn_gateway, wait_until
from tests.vllm.conftest import trace_requests

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]

MAX_TOKENS = 32
PROMPTS = [
    *trace_requests("healthbench_chat.jsonl", 12, max_tokens=MAX_TOKENS),
    *trace_requests("id_sentiment_structured.jsonl", 12, max_tokens=MAX_TOKENS),
]
COUNTER = re.compile(r"^(llamacpp:spec_decode_num_\w+_total)(\{[^}]*\})? ([0-9.e+]+)$", re.M)


async def counters(server: LlamaServer) -> dict[str, float]:
    """The server's ``llamacpp:spec_decode_*`` counters (per position keyed with its label)."""
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{server.base_url}/metrics") as r,
    ):
        text = await r.text()
    return {name + (labels or ""): float(v) for name, labels, v in COUNTER.findall(text)}


def increase(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def alone(server: LlamaServer, body: dict[str, Any]) -> str:
    """What ``server`` answers to ``body`` by itself (non-streamed)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{server.base_url}/v1/chat/completions", json={**body, "stream": False}) as r,
    ):
        answer = await r.json()
    return str(answer["choices"][0]["message"]["content"] or "")


async def ask(client: openai.AsyncOpenAI, body: dict[str, Any], stream: bool) -> str:
    kwargs = {k: v for k, v in body.items() if k not in ("model", "messages")}
    if stream:
        chunks = await client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=body["messages"], stream=True, **kwargs
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    answer = await client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=body["messages"], **kwargs
    )
    return answer.choices[0].message.content or ""


async def mirrored_run(args: list[str], shadows: int, store: str) -> list[str]:
    """Every prompt through ``specshadow serve ARGS`` (a process), every other one streamed; waits
    for every shadow leg, stops the gateway (records flushed) and returns what the SDK got."""
    got: list[str] = []
    # Scraped every 0.1 s: a fast machine answers the 24 prompts in a second or two, and the
    # backend window needs two scrapes.
    extra = ["--shadow-ratio", "1", "--store", store, "--scrape-interval", "0.1"]
    async with spawn_gateway([*args, *extra]) as gp:
        client = openai.AsyncOpenAI(base_url=f"{gp.url}/v1", api_key="x")  # the SDK's defaults
        for i, body in enumerate(PROMPTS):
            got.append(await ask(client, body, stream=i % 2 == 1))
        await client.close()
        await wait_until(
            lambda: gp.shadow_status(),
            lambda s: (
                sum(c["count"] for c in s["counts"] if c["event"] == "completed")
                + sum(c["count"] for c in s["counts"] if c["event"] in ("failed", "dropped"))
                >= shadows * len(PROMPTS)
            ),
            timeout_s=120,
        )
        gp.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gp.proc.wait, 60) == 0, gp.stderr()
    return got


def legs_of(records: list[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    return [leg for r in records for leg in r["legs"] if leg["backend"] == backend]


def assert_counts_add_up(
    legs: list[dict[str, Any]], before: dict[str, float], after: dict[str, float]
) -> tuple[int, int]:
    """Σ per-request counts == the server's /metrics increase, exactly; returns the sums."""
    assert Counter(leg["outcome"] for leg in legs) == {"completed": len(PROMPTS)}
    sources = {leg["acceptance"]["source"] for leg in legs}
    assert sources <= {"llamacpp_timings", None}
    drafted = sum(leg["acceptance"]["num_draft_tokens"] or 0 for leg in legs)
    accepted = sum(leg["acceptance"]["num_accepted_tokens"] or 0 for leg in legs)
    assert drafted == increase(before, after, "llamacpp:spec_decode_num_draft_tokens_total")
    assert accepted == increase(before, after, "llamacpp:spec_decode_num_accepted_tokens_total")
    return drafted, accepted


async def test_policy_free_serve_finds_llamacpp_and_every_count_adds_up(
    llamacpp_servers: dict[str, LlamaServer], tmp_path: Any
) -> None:
    plain, draft = llamacpp_servers["plain"], llamacpp_servers["draft"]
    expected = [await alone(plain, body) for body in PROMPTS]
    before = await counters(draft)
    store = f"sqlite://{tmp_path}/records.sqlite"
    got = await mirrored_run(["--primary", plain.base_url, "--shadow", draft.base_url], 1, store)
    after = await counters(draft)
    records = read_records([store])

    assert got == expected  # every client answer is the primary's
    assert len(records) == len(PROMPTS)
    legs = legs_of(records, "shadow-1")
    drafted, accepted = assert_counts_add_up(legs, before, after)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the draft model drafted
    assert {leg["acceptance"]["source"] for leg in legs} == {"llamacpp_timings"}
    print(f"draft: {accepted}/{drafted} accepted over {len(legs)} legs")

    # Found, not stated: the engine and its speculation come from /props and /slots.
    engine = legs[-1]["engine"]
    assert engine["settings"]["engine"] == "llamacpp"
    assert engine["settings"]["speculative"] == {
        "method": "draft-simple",
        "num_speculative_tokens": draft.spec.draft_max,
    }
    primary_engine = legs_of(records, "primary")[-1]["engine"]
    assert primary_engine["settings"]["speculative"] is None
    assert primary_engine["base_fingerprint"] == engine["base_fingerprint"]  # no confound
    spec = legs[-1]["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"]) == (
        "draft-simple",
        draft.spec.draft_max,
    )
    # The backend window: the scraper's view of the same counters, per position included.
    windows = [leg["acceptance"]["backend_window"] for leg in legs]
    assert windows[-1] is not None, windows
    assert all(len(w["per_position"]) == draft.spec.draft_max for w in windows if w is not None)

    # The report judges it: greedy and identical outputs → equivalent.
    verdict = analyze(records).candidates["shadow-1"].equivalence["all"]
    print("verdict:", verdict.verdict, verdict.reasons)
    assert verdict.verdict == "equivalent", verdict.reasons


async def test_ngram_servers_stated_as_llamacpp_count_exactly(
    llamacpp_servers: dict[str, LlamaServer], tmp_path: Any
) -> None:
    plain = llamacpp_servers["plain"]
    ngrams = [llamacpp_servers["ngram-mod"], llamacpp_servers["ngram-map-k"]]
    before = [await counters(s) for s in ngrams]
    store = f"sqlite://{tmp_path}/records.sqlite"
    args = ["--primary", plain.base_url, "--primary-kind", "llamacpp"]
    for s in ngrams:
        args += ["--shadow", s.base_url, "--shadow-kind", "llamacpp"]
    got = await mirrored_run(args, len(ngrams), store)
    after = [await counters(s) for s in ngrams]
    records = read_records([store])
    assert got == [await alone(plain, body) for body in PROMPTS]
    for i, server in enumerate(ngrams):
        drafted, accepted = assert_counts_add_up(
            legs_of(records, f"shadow-{i + 1}"), before[i], after[i]
        )
        print(f"{server.spec.name}: {accepted}/{drafted} accepted")


async def test_the_gateway_client_loses_nothing_to_llamacpp_closing_after_each_stream(
    llamacpp_servers: dict[str, LlamaServer],
) -> None:
    """llama.cpp closes the connection after every streamed answer (no ``Connection: close``): a
    bare pooled aiohttp client loses requests to it; the gateway's upstream client, told the
    backend is ``llamacpp``, none; not told, at most the one before it learns."""
    plain = llamacpp_servers["plain"]
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true}'
    n = 40
    bare: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            try:
                async with s.post(f"{plain.base_url}/v1/chat/completions", data=body) as r:
                    await r.read()
                    bare["ok"] += 1
            except aiohttp.ClientError as exc:
                bare[type(exc).__name__] += 1

    async def through(client: UpstreamClient) -> Counter[str]:
        out: Counter[str] = Counter()
        try:
            for _ in range(n):
                try:
                    async with client.open(
                        "POST",
                        "/v1/chat/completions",
                        headers={"Content-Type": "application/json"},
                        data=body,
                        retry=False,
                    ) as r:
                        done = (await r.read()).endswith(b"data: [DONE]\n\n")
                        out["ok" if done else "short"] += 1
                except UpstreamError as exc:
                    out[type(exc.__cause__).__name__] += 1
        finally:
            await client.close()
        return out

    target = UpstreamTarget("plain", plain.base_url)
    learning = UpstreamClient(target, UpstreamSettings())
    learned = await through(learning)
    known = UpstreamClient(target, UpstreamSettings(), closes_connections=True)  # kind llamacpp
    stated = await through(known)
    print("bare pooled:", dict(bare), "learning:", dict(learned), learning.resent, "known:", stated)
    assert bare["ok"] < n  # the server really closes: a bare pool loses some (measured: half)
    # Learning: the first dead reuse is resent when provably unsent (most runs); when the close
    # came after the write (2 of 20 dead reuses of a bare client in one run) that one request is
    # lost, never resent — and nothing after it.
    assert learning.closes_connections and learning.resent <= 1
    assert learned["ok"] >= n - 1 and set(learned) <= {"ok", "ServerDisconnectedError"}
    assert learned["ok"] + learning.resent >= n - 1
    # Known (what the gateway does for a llamacpp backend): never pooled, nothing lost.
    assert stated == {"ok": n} and known.resent == 0
