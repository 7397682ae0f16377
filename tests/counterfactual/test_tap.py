"""The token tap on real sockets: off the request path, bounded, counted, never the primary.

The tokenizer here is a small aiohttp server of the test's (real socket) that answers vLLM's
``/tokenize`` shape and can be told to stall or fail, so the budget and error paths are driven
for real; the gateway, the primary and the candidate are the product and simulators.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from core import jsonx
from policies.errors import PolicyError
from policies.parse import validate_policy
from records.sqlite_store import query_records
from tests.conftest import start_server
from tests.fakes.upstream import Script


@dataclass
class Tokenizer:
    """``POST /tokenize`` → one id per character; ``stall_s`` delays, ``release`` holds every
    answer until the test sets it, ``fail`` answers 500."""

    stall_s: float = 0.0
    release: asyncio.Event | None = None
    fail: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        body = jsonx.loads(await request.read())
        self.calls.append(body)
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.release is not None:
            await self.release.wait()
        if self.fail:
            return web.json_response({"error": {"message": "down"}}, status=500)
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        ids = [ord(c) for c in text]
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})


@pytest.fixture
async def tokenizer() -> AsyncIterator[Callable[..., Awaitable[tuple[Tokenizer, str]]]]:
    started: list[TestServer] = []

    async def start(**options: Any) -> tuple[Tokenizer, str]:
        tok = Tokenizer(**options)
        server = await start_server(tok.app())
        started.append(server)
        return tok, str(server.make_url("")).rstrip("/")

    yield start
    for server in started:
        await server.close()


def policy_text(primary: str, candidate: str, tokenizer: str, *, max_in_flight: int = 4) -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n  cand: {{url: '{candidate}', kind: sim}}\n"
        f"  tok: {{url: '{tokenizer}', kind: openai}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: cand, role: candidate}]}\n"
        f"counterfactual: {{tokenizer: tok, share: 1.0, max_in_flight: {max_in_flight}, timeout_s: 5}}\n"
    )


async def chat(session: aiohttp.ClientSession, url: str, i: int, *, text: str = "say hi") -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    async with session.post(
        f"{url}/v1/chat/completions", json=body, headers={"x-request-id": f"t{i}"}
    ) as r:
        assert r.status == 200
        await r.read()


async def dropped(session: aiohttp.ClientSession, url: str, reason: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    pattern = rf'specshadow_telemetry_dropped_total\{{[^}}]*reason="{reason}"[^}}]*signal="tokens"[^}}]*\}} (\S+)'
    values = [float(v) for v in re.findall(pattern, text)]
    return sum(values)


async def test_ids_come_from_the_tokenizer_and_the_candidates_own_ids_and_the_primary_is_untouched(
    sims: Any, gateway: Any, write_policy: Callable[[str], str], tokenizer: Any, tmp_path: Path
) -> None:
    primary, candidate = await sims(), await sims(mode="speculative")
    tok, tok_url = await tokenizer()
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy_text(primary.base_url, candidate.base_url, tok_url)),
                       store_path=str(store))  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for i in range(3):
            await chat(session, gw.url, i)
        await gw.sink.wait_for(lambda _: len(gw.sink.exchanges) >= 3)
    await gw.server.close()
    records = list(query_records(store))
    assert len(records) == 3 and all(r["tokens"] for r in records)
    t = records[0]["tokens"]
    # The prompt through the tokenizer (chat template applied there, generation prompt on) ...
    assert t["source"] == "tokenize:tok" and t["prompt"] == [ord(c) for c in "say hi"]
    assert tok.calls[0]["add_generation_prompt"] is True
    # ... the output from the candidate's generated ids, since it answered the same text.
    assert t["output_source"] == "leg:cand" and t["legs"]["cand"] == t["output"]
    assert len(t["output"]) == t["output_tokens_reported"]


async def test_shadow_legs_ask_for_token_ids_and_the_primary_gets_the_clients_bytes(
    fake_upstream: Any, gateway: Any, write_policy: Callable[[str], str], tokenizer: Any
) -> None:
    answer = Script(headers=[("Content-Type", "application/json")], chunks=[(0, b"{}")])
    primary, primary_url = await fake_upstream(answer)
    shadow, shadow_url = await fake_upstream(answer)
    _, tok_url = await tokenizer()
    gw = await gateway(
        None, policy_path=write_policy(policy_text(primary_url, shadow_url, tok_url))
    )
    client_body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=client_body,
                                headers={"content-type": "application/json"}) as r:  # fmt: skip
            await r.read()
        await gw.sink.wait_for(lambda _: len(gw.sink.exchanges) >= 1)
    await gw.server.close()
    (relayed,) = [r for r in primary.received if r.path_qs == "/v1/chat/completions"]
    assert relayed.body == client_body
    (mirrored,) = [r for r in shadow.received if r.path_qs == "/v1/chat/completions"]
    sent = jsonx.loads(mirrored.body)
    assert sent["return_token_ids"] is True and sent["stream"] is True


async def test_past_its_budget_the_tap_records_without_tokens_and_counts_it(
    sims: Any, gateway: Any, write_policy: Callable[[str], str], tokenizer: Any, tmp_path: Path
) -> None:
    primary, candidate = await sims(), await sims(mode="speculative")
    release = asyncio.Event()  # the tokenizer answers nothing until the test says so
    _, slow_url = await tokenizer(release=release)
    store = tmp_path / "r.sqlite"
    text = policy_text(primary.base_url, candidate.base_url, slow_url, max_in_flight=1)
    text = text.replace("timeout_s: 5", "timeout_s: 120")
    gw = await gateway(None, policy_path=write_policy(text), store_path=str(store))
    async with aiohttp.ClientSession() as session:
        # The client never waited for the tokenizer: four answers while it has answered nothing
        # (a client that waited would hang here; the deadline only turns that into a failure).
        async with asyncio.timeout(60):
            for i in range(4):
                await chat(session, gw.url, i)
        await gw.sink.wait_for(lambda _: len(gw.sink.exchanges) >= 4)
        assert await dropped(session, gw.url, "budget") >= 2
        release.set()
    await gw.server.close()
    records = list(query_records(store))
    assert len(records) == 4  # nothing lost
    assert 1 <= sum(r["tokens"] is not None for r in records) <= 2


async def test_a_failing_tokenizer_costs_the_tokens_only(
    sims: Any, gateway: Any, write_policy: Callable[[str], str], tokenizer: Any, tmp_path: Path
) -> None:
    primary, candidate = await sims(), await sims(mode="speculative")
    _, bad_url = await tokenizer(fail=True)
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy_text(primary.base_url, candidate.base_url, bad_url)),
                       store_path=str(store))  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for i in range(2):
            await chat(session, gw.url, i)
        await gw.sink.wait_for(lambda _: len(gw.sink.exchanges) >= 2)
        for _ in range(50):
            if await dropped(session, gw.url, "error") >= 2:
                break
            await asyncio.sleep(0.1)
        assert await dropped(session, gw.url, "error") == 2
    await gw.server.close()
    records = list(query_records(store))
    assert len(records) == 2 and all(r["tokens"] is None for r in records)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tokenizer": "nope"}, "counterfactual.tokenizer: unknown backend 'nope'"),
        ({"tokenizer": "prim"}, "counterfactual.tokenizer: 'prim' is the primary"),
        (
            {"tokenizer": "cand", "drafters": ["prim"]},
            "counterfactual.drafters[0]: 'prim' is the primary",
        ),
        ({"tokenizer": "cand", "share": 1.5}, "counterfactual.share"),
        ({"share": 0.5}, "counterfactual.tokenizer"),
    ],
)
def test_the_policy_section_is_checked_with_its_field_path(
    section: dict[str, Any], message: str
) -> None:
    raw = {
        "version": 1,
        "backends": {
            "prim": {"url": "http://a:1", "kind": "openai"},
            "cand": {"url": "http://b:1", "kind": "vllm"},
        },
        "primary": "prim",
        "counterfactual": section,
    }
    with pytest.raises(PolicyError, match=re.escape(message)):
        validate_policy(raw, source="test")


def test_logprob_tokens_written_as_ids_are_ids_and_anything_else_is_not() -> None:
    from evidence.tokens import logprob_ids, prediction_ids

    assert logprob_ids(["token_id:5", "token_id:17"]) == (5, 17)
    assert logprob_ids(["token_id:5", " the"]) is None
    assert logprob_ids(None) is None
    # vLLM's prompt_logprobs: null first, then per position the actual token and the rank-1 one.
    rows = [
        None,
        {"7": {"logprob": -0.1, "rank": 1}},
        {"3": {"logprob": -2.0, "rank": 4}, "9": {"logprob": -0.5, "rank": 1}},
    ]
    assert prediction_ids(rows, 1, 2) == (7, 9)
    assert prediction_ids(rows, 1, 3) is None  # too short
    assert prediction_ids([None, {"x": {"logprob": 0.0, "rank": 1}}], 1, 1) is None


async def test_a_tokenizer_that_hangs_past_shutdown_loses_no_record(
    sims: Any, write_policy: Callable[[str], str], tokenizer: Any, tmp_path: Path
) -> None:
    from gateway.settings import Settings
    from specshadow.app import build_app
    from tests.conftest import FAST_UPSTREAM

    primary, candidate = await sims(), await sims(mode="speculative")
    _, hung_url = await tokenizer(stall_s=60)
    store = tmp_path / "r.sqlite"
    text = policy_text(primary.base_url, candidate.base_url, hung_url).replace(
        "timeout_s: 5", "timeout_s: 120"
    )
    settings = Settings(policy_path=write_policy(text), store_path=str(store), shutdown_timeout_s=1.0,
                        upstream=FAST_UPSTREAM)  # fmt: skip
    app = build_app(settings)
    server = await start_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        for i in range(2):
            await chat(session, url, i)
    await server.close()  # the tap's drain gives up on the hung tokenizer
    records = list(query_records(store))
    assert len(records) == 2 and all(r["tokens"] is None for r in records)
