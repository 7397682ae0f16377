"""llama.cpp's n-gram proposers replayed against the real servers (``pytest -m llamacpp``).

The tier's ``ngram-mod`` (n_match 4, drafts of 1–8) and ``ngram-map-k`` (key 2, drafts of up to
8) servers, 2 slots of 1,024 tokens each, as two candidates behind a plain llama.cpp primary, with
the token tap on (the ``ngram-map-k`` server tokenizes: llama.cpp's ``/apply-template`` and
``/tokenize``; the output's ids are the primary's, from the logprobs the client asked for). One
exchange at a time, so each server serves one request at a time in the records' order.

The replay (counterfactual/llamacpp_ngram.py) then serves the same requests in the same order —
the servers' warm-up request first, the one request they saw before this test — and must give
each request exactly the drafted and accepted counts the server reported in its ``timings``; the
matrix's live check (which knows only the records, not the warm-up) is printed beside it. This
module runs before test_llamacpp.py (file order), while the n-gram servers have served only their
warm-up: the test checks that first, since the shared pool makes every count depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest

from backends.llamacpp import LlamaServer
from core.exchange import Exchange
from core.sinks import MemorySink
from counterfactual.llamacpp_ngram import LlamaKnobs
from counterfactual.matrix import build_matrix
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.readback import read_records
from specshadow.inprocess import running_gateway
from tests.llamacpp.test_llamacpp import PROMPTS, ask

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]

# The tier's servers (backends/llamacpp_launch.py's defaults, LlamaServerSpec's slots and context).
KNOBS = {
    "ngram-mod": LlamaKnobs("ngram-mod", 4, 1, 8, slots=2, n_ctx=1024),
    "ngram-map-k": LlamaKnobs("ngram-map-k", 2, 1, 8, slots=2, n_ctx=1024),
}
# LlamaServer.warm_up's request: what the n-gram servers served before this test.
WARM_UP = {
    "messages": [{"role": "user", "content": "one two three one two three one two"}],
    "max_tokens": 16,
    "temperature": 0,
}


async def call(base: str, method: str, path: str, body: Any = None) -> Any:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, base + path, json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def warm_up_ids(plain: LlamaServer, ngram: LlamaServer) -> tuple[list[int], list[int]]:
    """The warm-up's prompt ids (the n-gram server's own template and tokenizer) and output ids
    (the plain server's greedy answer: speculation is lossless)."""
    prompt = await call(
        ngram.base_url, "POST", "/apply-template", {"messages": WARM_UP["messages"]}
    )
    ids = await call(
        ngram.base_url,
        "POST",
        "/tokenize",
        {"content": prompt["prompt"], "add_special": True, "parse_special": True},
    )
    answer = await call(
        plain.base_url,
        "POST",
        "/v1/chat/completions",
        {**WARM_UP, "logprobs": True, "top_logprobs": 1},
    )
    return ids["tokens"], [e["id"] for e in answer["choices"][0]["logprobs"]["content"]]


def policy(servers: dict[str, LlamaServer]) -> PolicyStore:
    backends: dict[str, Any] = {"plain": {"url": servers["plain"].base_url, "kind": "llamacpp"}}
    for name, knobs in KNOBS.items():
        # Declared, as docs/llamacpp.md tells a user to: llama.cpp serves its depth only once a
        # request drafted (the warm-up drafts nothing on these servers), and the probe asks every
        # 2 s until then, so the 24 exchanges (about 2 s) could all end before it knew (one CI run:
        # no record said what the candidates run, and the matrix had no live check for them).
        backends[name] = {
            "url": servers[name].base_url,
            "kind": "llamacpp",
            "speculative": {"method": name, "num_speculative_tokens": knobs.n_max},
        }
    raw = {
        "version": 1,
        "backends": backends,
        "primary": "plain",
        "default": {"ratio": 1.0, "legs": [{"backend": n, "role": "candidate"} for n in KNOBS]},
        "counterfactual": {"tokenizer": "ngram-map-k", "share": 1.0},
    }
    return PolicyStore(parse_policy(raw, source="llamacpp counterfactual"))


def served(sink: MemorySink, n: int) -> Callable[[Exchange], bool]:
    """True once the sink has ``n`` exchanges (the tap hands each on when its ids are in)."""
    return lambda _: len(sink.exchanges) >= n


async def test_the_ngram_replay_predicts_every_request_of_both_llamacpp_servers(
    llamacpp_servers: dict[str, LlamaServer], tmp_path: Any
) -> None:
    for name in KNOBS:
        slots = await call(llamacpp_servers[name].base_url, "GET", "/slots")
        assert [(s["id"], s.get("id_task")) for s in slots] == [(0, None), (1, 0)], (
            f"{name} served more than its warm-up before this test (it must run first: the "
            "replay needs the server's whole history)"
        )
    store = tmp_path / "records.sqlite"
    started = time.perf_counter()
    async with (
        running_gateway(policy(llamacpp_servers), store_path=store) as gw,
        openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client,
    ):
        for i, body in enumerate(PROMPTS):
            # The client asks the (plain) primary for logprobs, not streamed: its ids, all of
            # them. llama.cpp's streams carry fewer (a speculating server sends none for the
            # drafted tokens it accepted; on the structured prompts the plain one sent 22 of
            # 32), so the candidates' streamed ids are incomplete and the tap keeps none.
            await ask(client, {**body, "logprobs": True, "top_logprobs": 1}, stream=False)
            # One exchange at a time: each server serves one request at a time, in order.
            await gw.sink.wait_for(served(gw.sink, i + 1), timeout_s=60)
    elapsed = time.perf_counter() - started
    records = read_records([f"sqlite://{store}"])
    assert len(records) == len(PROMPTS)
    ordered = records  # the store's order: the order served
    warm = await warm_up_ids(llamacpp_servers["plain"], llamacpp_servers["ngram-mod"])

    for name, knobs in KNOBS.items():
        server = knobs.server()
        server.serve(*warm, max_tokens=16)
        equal, predicted, measured = 0, [0, 0], [0, 0]
        for r in ordered:
            tokens = r["tokens"]
            assert tokens is not None, "the token tap kept no ids"
            leg = next(leg for leg in r["legs"] if leg["backend"] == name)
            spec = leg["speculative"] or {}  # declared, and reported once the server said it
            assert (spec.get("method"), spec.get("num_speculative_tokens")) == (name, 8), spec
            assert not spec.get("mismatches"), spec
            assert tokens["output_source"] == "engine"  # the primary's own ids
            assert name not in tokens["legs"]  # incomplete: not kept
            # Greedy and lossless: the candidate generated production's output.
            got = server.serve(tokens["prompt"], tokens["output"], max_tokens=32)
            acc = leg["acceptance"]
            reported = (acc.get("num_draft_tokens") or 0, acc.get("num_accepted_tokens") or 0)
            equal += (got.draft_tokens, got.accepted) == reported
            predicted = [predicted[0] + got.draft_tokens, predicted[1] + got.accepted]
            measured = [measured[0] + reported[0], measured[1] + reported[1]]
        print(f"{name}: replay {predicted[1]}/{predicted[0]}, server {measured[1]}/{measured[0]}, "
              f"{equal} of {len(ordered)} requests equal")  # fmt: skip
        assert measured[0] > 0 and measured[1] > 0  # the servers drafted
        assert equal == len(ordered)  # every request: drafted and accepted, exactly

    # The product's own path: the matrix's live check, declared knobs, records only (it lacks
    # the warm-up, so a request or two near the start may differ: printed, bounded loosely).
    matrix = build_matrix(
        lambda: iter(read_records([f"sqlite://{store}"])),
        depths=(8,),
        windows=((2, 4),),
        llamacpp=tuple(KNOBS.values()),
    )
    rows = {r["proposer"] for r in matrix.rows}
    assert {"ngram-mod", "ngram-map-k"} <= rows
    live = {entry["backend"]: entry for entry in matrix.live_llamacpp}
    for name in KNOBS:
        entry = live[name]
        print(f"matrix live check {name}: {entry['note']}; predicted {entry['predicted']}, "
              f"measured {entry['measured']}")  # fmt: skip
        assert entry["requests"] == len(PROMPTS) and entry["unreplayed"] == 0
        assert entry["requests_equal"] >= len(PROMPTS) - 2
    print(f"{len(PROMPTS)} exchanges one at a time in {elapsed:.1f} s")
