"""vLLM's ``return_token_ids`` over HTTP: where the prompt's and the output's ids go (vLLM 0.32's
shapes, key order included), streamed ids that rebuild the whole answer's, one engine step's ids
per chunk on a replaying speculative server, and nothing changed without the field."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from simulator import SimConfig, SimServer
from simulator.tokens import chat_ids, piece_id, text_ids
from tests.simulator.conftest import StartSim
from tests.simulator.helpers import replayed_steps, split_events
from tests.simulator.test_replay import CODE, REPLAY, code_messages, ngram

K = REPLAY.num_speculative_tokens
PLAIN = SimConfig(mode="plain", prefill_base_s=0.0, step_s=0.0)
SPEC = SimConfig(
    mode="speculative", acceptance=0.7, num_speculative_tokens=4, prefill_base_s=0.0, step_s=0.0
)
MESSAGES = [{"role": "user", "content": "Tell me a story about token ids"}]
PROMPT = "Once upon a time"
ROUTES = ["chat/completions", "completions"]


def body_for(route: str, **extra: Any) -> dict[str, Any]:
    if route == "completions":
        return {"model": "sim-model", "prompt": PROMPT, **extra}
    return {"model": "sim-model", "messages": MESSAGES, **extra}


def prompt_ids_for(route: str) -> list[int]:
    return text_ids(PROMPT) if route == "completions" else chat_ids(MESSAGES)


async def post(
    session: aiohttp.ClientSession, server: SimServer, route: str, body: dict[str, Any], rid: str
) -> bytes:
    async with session.post(
        f"{server.base_url}/v1/{route}", json=body, headers={"x-request-id": rid}
    ) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        return raw


def chunks_of(raw: bytes) -> list[dict[str, Any]]:
    events = split_events(raw)
    assert events[-1].data == "[DONE]"
    return [e.json() for e in events[:-1]]


def text_of(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def without_created(raw: bytes) -> list[Any]:
    """The body (or each SSE chunk) with ``created`` zeroed: the only field that depends on time."""
    docs = chunks_of(raw) if raw.rstrip().endswith(b"data: [DONE]") else [json.loads(raw)]
    for doc in docs:
        if "created" in doc:
            doc["created"] = 0
    return docs


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("config", [PLAIN, SPEC], ids=["plain", "speculative"])
async def test_streamed_ids_rebuild_the_whole_answers_ids_and_its_text(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str, config: SimConfig
) -> None:
    server = await start_sim(config)
    prompt = prompt_ids_for(route)
    whole = json.loads(
        await post(session, server, route, body_for(route, return_token_ids=True), "w")
    )
    choice = whole["choices"][0]
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    assert choice["token_ids"] == text_ids(text)
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] > 1
    if route == "completions":
        assert choice["prompt_token_ids"] == prompt and "prompt_token_ids" not in whole
    else:
        assert whole["prompt_token_ids"] == prompt and "prompt_token_ids" not in choice
    assert len(prompt) == whole["usage"]["prompt_tokens"]

    body = body_for(
        route, return_token_ids=True, stream=True, stream_options={"include_usage": True}
    )
    chunks = chunks_of(await post(session, server, route, body, "s"))
    *outputs, final = chunks
    assert final["choices"] == [] and "prompt_token_ids" not in final
    if route == "chat/completions":
        role, *outputs = outputs
        assert role["prompt_token_ids"] == prompt
        assert role["choices"][0] == {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        assert all("prompt_token_ids" not in c for c in outputs)
    else:
        firsts = [c["choices"][0]["prompt_token_ids"] for c in outputs]
        assert firsts == [prompt] + [None] * (len(outputs) - 1)
    streamed: list[int] = []
    for chunk in outputs:
        (c,) = chunk["choices"]
        assert c["token_ids"] == text_ids(text_of(c)) and c["token_ids"]
        streamed += c["token_ids"]
    assert streamed == choice["token_ids"]
    assert len(streamed) == final["usage"]["completion_tokens"]
    if config.speculative:
        assert len(outputs) < len(streamed)  # some chunks carry several tokens
    else:
        assert len(outputs) == len(streamed)


@pytest.mark.parametrize("route", ROUTES)
async def test_the_ids_sit_where_vllm_writes_them(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str
) -> None:
    server = await start_sim(PLAIN)
    body = body_for(route, max_tokens=3, return_token_ids=True)
    whole = json.loads(await post(session, server, route, body, "shape"))
    stream_body = {**body, "stream": True}
    chunks = chunks_of(await post(session, server, route, stream_body, "shape-s"))
    if route == "chat/completions":
        assert list(whole) == [
            "id", "object", "created", "model", "choices", "usage",
            "service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids",
        ]  # fmt: skip
        assert list(whole["choices"][0]) == [
            "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
        ]  # fmt: skip
        assert list(chunks[0]) == [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "prompt_token_ids",
        ]
        assert list(chunks[1]["choices"][0]) == [
            "index", "delta", "logprobs", "finish_reason", "token_ids",
        ]  # fmt: skip
        assert list(chunks[-1]["choices"][0]) == [
            "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids",
        ]  # fmt: skip
    else:
        assert "prompt_token_ids" not in whole
        assert list(whole["choices"][0]) == [
            "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
            "prompt_logprobs", "prompt_token_ids",
        ]  # fmt: skip
        for chunk in chunks:
            assert list(chunk) == ["id", "object", "created", "model", "choices"]
            assert list(chunk["choices"][0]) == [
                "index", "text", "logprobs", "finish_reason", "stop_reason",
                "prompt_token_ids", "token_ids",
            ]  # fmt: skip
            assert chunk["choices"][0]["stop_reason"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks[-3:]] == [None, None, "length"]


async def test_continuous_usage_comes_before_the_prompt_ids_on_the_role_chunk(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    server = await start_sim(PLAIN)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = body_for(
        "chat/completions", max_tokens=3, return_token_ids=True, stream=True, stream_options=options
    )
    chunks = chunks_of(await post(session, server, "chat/completions", body, "cu"))
    assert list(chunks[0]) == [
        "id", "object", "created", "model", "choices", "usage", "prompt_token_ids",
    ]  # fmt: skip
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert [len(c["choices"][0]["token_ids"]) for c in chunks[1:-1]] == [1, 1, 1]
    assert [c["usage"]["completion_tokens"] for c in chunks[1:-1]] == [1, 2, 3]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
async def test_without_the_field_or_with_false_nothing_changes(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str, stream: bool
) -> None:
    server = await start_sim(SPEC)
    extra: dict[str, Any] = (
        {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    )
    base = without_created(await post(session, server, route, body_for(route, **extra), "same"))
    for value in (False, None):
        body = body_for(route, return_token_ids=value, **extra)
        assert without_created(await post(session, server, route, body, "same")) == base
    # With it, dropping the added keys gives the same documents back.
    added = without_created(
        await post(session, server, route, body_for(route, return_token_ids=True, **extra), "same")
    )
    for doc in added:
        doc.pop("prompt_token_ids", None)
        for choice in doc["choices"]:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            if route == "completions" and stream and choice["finish_reason"] is None:
                choice.pop("stop_reason")
    assert added == base
    raw = await post(session, server, route, body_for(route, **extra), "same")
    assert b"token_ids" not in raw


async def test_responses_ignore_the_field_and_a_non_boolean_is_a_400(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    server = await start_sim(PLAIN)
    body: dict[str, Any] = {
        "model": "sim-model",
        "input": "Tell me a story",
        "max_output_tokens": 5,
    }
    base = without_created(await post(session, server, "responses", body, "r"))
    for value in (True, "yes"):
        got = without_created(
            await post(session, server, "responses", {**body, "return_token_ids": value}, "r")
        )
        assert got == base
    assert b"token_ids" not in json.dumps(base).encode()
    for route in ROUTES:
        async with session.post(
            f"{server.base_url}/v1/{route}", json=body_for(route, return_token_ids="yes")
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "return_token_ids"


async def test_a_prompt_given_as_ids_comes_back_as_given_and_tool_calls_carry_their_ids(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    server = await start_sim(PLAIN)
    ids = [5, 77, 1234567, 3]
    body = {"prompt": ids, "max_tokens": 4, "return_token_ids": True}
    whole = json.loads(await post(session, server, "completions", body, "ids"))
    assert whole["choices"][0]["prompt_token_ids"] == ids
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    body = body_for("chat/completions", tools=[tool], return_token_ids=True)
    whole = json.loads(await post(session, server, "chat/completions", body, "tool"))
    choice = whole["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    assert choice["token_ids"] == [piece_id("get_weather"), *text_ids(call["arguments"])]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert whole["prompt_token_ids"] == chat_ids(MESSAGES, tools=[tool])
    chunks = chunks_of(
        await post(session, server, "chat/completions", {**body, "stream": True}, "ts")
    )
    streamed = [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]


@pytest.mark.parametrize("route", ROUTES)
async def test_a_replay_servers_chunks_carry_one_engine_steps_ids_each(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str
) -> None:
    server = await start_sim(REPLAY)
    multi = 0
    for i in range(3):
        if route == "completions":
            body: dict[str, Any] = {"prompt": f"# Task {i}\n{CODE}"}
        else:
            body = {"messages": code_messages(i)}
        body |= {
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rid = f"replay-{route}-{i}"
        *outputs, final = chunks_of(await post(session, server, route, body, rid))
        if route == "chat/completions":
            role, *outputs = outputs
            prompt = role["prompt_token_ids"]
        else:
            prompt = outputs[0]["choices"][0]["prompt_token_ids"]
        per_chunk = [c["choices"][0]["token_ids"] for c in outputs]
        out = [t for ids in per_chunk for t in ids]
        assert len(out) == final["usage"]["completion_tokens"]
        # The steps recomputed from the ids alone, and the server's own record, agree per chunk.
        steps = replayed_steps(prompt, out, K, ngram)
        record = server.state.requests[rid]
        assert [a for _, a in steps] == list(record.per_step_accepted)
        assert [len(ids) for ids in per_chunk] == [a + 1 for _, a in steps]
        for chunk, ids in zip(outputs, per_chunk, strict=True):
            assert text_ids(text_of(chunk["choices"][0])) == ids
        multi += sum(1 for ids in per_chunk if len(ids) > 1)
    assert multi > 5
