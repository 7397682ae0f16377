"""A client that read the terminal event read the whole answer: the official SDKs close the
connection the moment they see ``data: [DONE]``, and that exchange's primary leg is complete and
comparable — not ``client_disconnected``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai

from tests.fakes.upstream import Script, sse

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "model": "m"}


def chat_stream() -> list[tuple[float, bytes]]:
    events = [
        json.dumps({**CHUNK, "choices": [{"index": 0, "delta": {"content": piece}}]})
        for piece in ("Hello", " there", " friend")
    ]
    done = sse(
        *events,
        json.dumps({**CHUNK, "choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 2}}),
        "[DONE]",
    )
    # The upstream keeps the connection open a while after [DONE] (as servers may): the client
    # has everything, leaves, and the gateway is still waiting for the upstream's end.
    return [*done, (0.3, b"")]


async def test_a_client_that_leaves_right_after_done_leaves_a_complete_leg(
    fake_upstream: Any, gateway: Any
) -> None:
    _fake, upstream = await fake_upstream(Script(chunks=chat_stream()))
    gw = await gateway(upstream)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession() as session:
        for i in range(5):
            async with session.post(
                f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": f"d{i}"}
            ) as resp:
                got = b""
                while b"data: [DONE]" not in got:
                    got += await resp.content.readany()
                resp.close()  # leave at once, as the SDK does
    exchanges = [await gw.sink.wait_for(lambda e, i=i: e.request_id == f"d{i}") for i in range(5)]
    assert [e.primary.outcome for e in exchanges] == ["completed"] * 5
    assert all(e.primary.recording is not None and e.primary.recording.done for e in exchanges)


async def test_the_openai_sdk_under_load_loses_no_exchange(sims: Any, gateway: Any) -> None:
    sim = await sims()
    gw = await gateway(sim.base_url)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    gate = asyncio.Semaphore(16)

    async def one(i: int) -> str:
        async with gate:
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=12,
                stream=True,
                extra_headers={"x-request-id": f"s{i}"},
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(120)))
    await client.close()
    assert all(texts)
    exchanges = [await gw.sink.wait_for(lambda e, i=i: e.request_id == f"s{i}") for i in range(120)]
    assert {e.primary.outcome for e in exchanges} == {"completed"}
