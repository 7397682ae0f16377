"""The official openai SDK through the gateway: what applications see, and what the gateway measured."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.simulator.helpers import split_events

PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Explain what a KV cache is."}
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "additionalProperties": False,
            "required": ["label", "score"],
            "properties": {
                "label": {"type": "string", "enum": ["yes", "no"]},
                "score": {"type": "number"},
            },
        },
    },
}


@pytest.fixture
async def routed(sims, gateway):
    sim = await sims(step_s=0.002)
    gw = await gateway(sim.base_url)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0)
    yield sim, gw, client
    await client.close()


async def test_streaming_chat_matches_the_recorded_text_and_usage(routed):
    sim, gw, client = routed
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=PROMPT,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    exchange = await gw.sink.wait_for()
    rec = exchange.primary.recording
    assert rec is not None
    assert rec.choices[0].text == text
    assert usage is not None and rec.output_tokens == usage.completion_tokens == 20
    assert rec.tokens_source == "usage"
    assert rec.timings.ttft_s is not None and rec.timings.tpot_s is not None
    assert rec.done
    truth = sim.state.requests[exchange.request_id]
    assert "".join(truth.tokens) == text


async def test_non_streaming_chat_and_completions(routed):
    _sim, gw, client = routed
    reply = await client.chat.completions.create(model="sim-model", messages=PROMPT, max_tokens=8)
    rec = (await gw.sink.wait_for(lambda e: e.route == "chat")).primary.recording
    assert rec is not None and not rec.streaming
    assert rec.choices[0].text == reply.choices[0].message.content
    assert rec.output_tokens == reply.usage.completion_tokens if reply.usage else False
    completion = await client.completions.create(
        model="sim-model", prompt="Once upon a time", max_tokens=6
    )
    rec = (await gw.sink.wait_for(lambda e: e.route == "completions")).primary.recording
    assert rec is not None
    assert rec.choices[0].text == completion.choices[0].text
    stream = await client.completions.create(
        model="sim-model", prompt="Once upon a time", max_tokens=6, stream=True
    )
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == completion.choices[0].text


async def test_tool_calls_stream_through_and_are_merged_by_the_recorder(routed):
    _sim, gw, client = routed
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=PROMPT,
        tools=TOOLS,
        stream=True,
    )
    name, args = "", ""
    async for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function and call.function.name:
                name += call.function.name
            if call.function and call.function.arguments:
                args += call.function.arguments
    assert name == "get_weather"
    parsed = json.loads(args)
    assert set(parsed) == {"city", "unit"}
    rec = (await gw.sink.wait_for()).primary.recording
    assert rec is not None
    (call,) = rec.choices[0].tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == parsed
    assert rec.choices[0].finish_reason == "tool_calls"


async def test_response_format_json_schema_passes_through(routed):
    _sim, gw, client = routed
    reply = await client.chat.completions.create(
        model="sim-model",
        messages=PROMPT,
        response_format=SCHEMA,
    )
    content = reply.choices[0].message.content
    assert content is not None
    value = json.loads(content)
    assert value["label"] in ("yes", "no")
    rec = (await gw.sink.wait_for()).primary.recording
    assert rec is not None and rec.choices[0].text == content


async def test_sdk_sees_openai_shaped_errors(routed, gateway):
    _sim, _gw, client = routed
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=PROMPT)
    bad = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        await bad.chat.completions.create(model="sim-model", messages=PROMPT)
    await bad.close()


async def test_recorded_timestamps_are_within_bounds_of_the_simulator_send_times(sims, gateway):
    """Each event's receive time at the gateway is after its send time and not much later."""
    import aiohttp

    sim = await sims(step_s=0.004)
    gw = await gateway(sim.base_url)
    for i in range(5):
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{gw.url}/v1/chat/completions",
                json={
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": f"q{i}"}],
                    "max_tokens": 16,
                    "stream": True,
                },
                headers={"x-request-id": f"ts-{i}"},
            ) as resp,
        ):
            body = await resp.read()
        exchange = await gw.sink.wait_for(lambda e, i=i: e.request_id == f"ts-{i}")
        rec = exchange.primary.recording
        assert rec is not None
        sent = [
            e.sent_ns for e in split_events(body) if e.sent_ns is not None and e.data != "[DONE]"
        ]
        received = [s.received_ns for s in rec.stamps]
        assert len(sent) == len(received)  # one stamp per event
        assert received == sorted(received)  # in the order they came
        for s_ns, r_ns in zip(sent, received, strict=True):
            assert r_ns >= s_ns  # never before it was sent: one monotonic clock on one machine
    # How soon after its send each event is stamped is the machine's as much as the gateway's:
    # bench/ reports that distribution; a bound here failed whenever one of 80 reads stalled.
