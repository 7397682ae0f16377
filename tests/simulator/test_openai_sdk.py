"""The official ``openai`` SDK talks to the simulator exactly as it talks to vLLM."""

from __future__ import annotations

import json

import openai
import pytest
from openai import AsyncOpenAI

from simulator import SimConfig

MESSAGES = [{"role": "user", "content": "Say something"}]


@pytest.fixture
async def client(start_sim):
    server = await start_sim(
        SimConfig(mode="speculative", aliases=("alias",), prefill_base_s=0.0, step_s=0.0)
    )
    async with AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


async def test_sdk_streams_and_non_streams_chat_with_the_same_text(client):
    whole = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=25
    )
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage is not None
    parts, usage = [], None
    stream = await client.chat.completions.create(
        model="alias",
        messages=MESSAGES,
        max_tokens=25,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_sdk_streams_and_non_streams_completions(client):
    whole = await client.completions.create(model="sim-model", prompt="Once upon", max_tokens=10)
    stream = await client.completions.create(
        model="sim-model", prompt="Once upon", max_tokens=10, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream])
    assert (
        text == whole.choices[0].text
        and whole.usage is not None
        and whole.usage.completion_tokens == 10
    )


async def test_sdk_parses_tool_calls_and_structured_output(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    result = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, tools=tools, max_tokens=100
    )
    calls = result.choices[0].message.tool_calls
    assert calls is not None and calls[0].type == "function"
    call = calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    schema = {
        "type": "object",
        "properties": {"label": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["label"],
    }
    result = await client.chat.completions.create(
        model="sim-model",
        messages=MESSAGES,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert json.loads(result.choices[0].message.content or "")["label"] in ("yes", "no")


async def test_sdk_sees_unknown_models_as_not_found(client):
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model", "alias"]
