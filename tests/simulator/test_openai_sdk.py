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


# -- the Responses API ------------------------------------------------------------------------


async def test_sdk_responses_stream_body_and_chat_agree(client):
    """One answer three ways: a Responses body, a Responses stream read by the SDK's strict
    helper (it raises unless events arrive in the API's order), and the same prompt as chat."""
    whole = await client.responses.create(
        model="sim-model", input="Say something", max_output_tokens=400
    )
    assert whole.status == "completed" and whole.usage is not None
    async with client.responses.stream(
        model="sim-model", input="Say something", max_output_tokens=400
    ) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens
    chat = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=400
    )
    assert chat.choices[0].message.content == whole.output_text


async def test_sdk_responses_tool_call_schema_and_limits(client):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    async with client.responses.stream(model="sim-model", input="Weather?", tools=tools) as s:
        final = await s.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    fmt = {
        "type": "json_schema",
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    }
    reply = await client.responses.create(model="sim-model", input="Judge", text={"format": fmt})
    assert isinstance(json.loads(reply.output_text)["ok"], bool)
    cut = await client.responses.create(model="sim-model", input="Say", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3


async def test_sdk_responses_previous_response_id_is_not_found_without_a_store(client):
    """As on vLLM without VLLM_ENABLE_RESPONSES_API_STORE: nothing is stored, so nothing resolves."""
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(
            model="sim-model", input="and then?", previous_response_id="resp_123"
        )
