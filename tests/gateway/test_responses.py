"""The Responses API through the gateway: the official SDK's ``client.responses``, byte-exact relay,
timing from the first output-bearing event, mirroring with ``store: false``, records compared,
and ``previous_response_id`` counted instead of mirrored."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai

from records.sqlite_store import query_records
from tests.fakes.upstream import Script
from tests.gateway.test_shadow import policy_yaml

_RESP: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "model": "m",
    "output": [],
    "usage": None,
}


def _event(kind: str, **fields: object) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def deltas(stream: Any, kind: str = "response.output_text.delta") -> str:
    """The joined ``delta`` of every ``kind`` event of an SDK stream."""
    return "".join([event.delta async for event in stream if event.type == kind])


def scripted_stream(ack_gap_s: float) -> list[tuple[float, bytes]]:
    """An OpenAI-style stream: acknowledgements, ``ack_gap_s`` of silence, three text deltas,
    the done events and ``response.completed`` with usage — and no ``[DONE]``."""
    done = {
        **_RESP,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello there!", "annotations": []}],
            }
        ],
        "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
    }
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress"}
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    return [
        (0.0, _event("response.created", sequence_number=0, response={**_RESP, "status": "in_progress"})),
        (0.0, _event("response.in_progress", sequence_number=1, response={**_RESP, "status": "in_progress"})),
        (0.0, _event("response.output_item.added", sequence_number=2, output_index=0, item={**item, "content": []})),
        (0.0, _event("response.content_part.added", sequence_number=3, part=part, **where)),
        (ack_gap_s, _event("response.output_text.delta", sequence_number=4, delta="Hello", logprobs=[], **where)),
        (0.01, _event("response.output_text.delta", sequence_number=5, delta=" there", logprobs=[], **where)),
        (0.01, _event("response.output_text.delta", sequence_number=6, delta="!", logprobs=[], **where)),
        (0.0, _event("response.output_text.done", sequence_number=7, text="Hello there!", logprobs=[], **where)),
        (0.0, _event("response.completed", sequence_number=8, response=done)),
    ]  # fmt: skip


async def test_sdk_stream_gets_the_primarys_bytes_and_ttft_starts_at_the_first_delta(
    fake_upstream, gateway
):
    chunks = scripted_stream(ack_gap_s=0.15)
    _fake, up = await fake_upstream(Script(chunks=chunks))
    gw = await gateway(up)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        async with client.responses.with_streaming_response.create(
            model="m", input="hi", stream=True
        ) as raw:
            body = b"".join([piece async for piece in raw.iter_bytes()])
        assert body == b"".join(c for _d, c in chunks)
        events = [
            e async for e in await client.responses.create(model="m", input="hi", stream=True)
        ]
    assert [e.type for e in events][-1] == "response.completed"
    first = await gw.sink.wait_for()
    second = await gw.sink.wait_for(lambda e: e is not first)
    for exchange in (first, second):
        assert exchange.route == "responses"
        rec = exchange.primary.recording
        assert rec is not None and exchange.primary.outcome == "completed"
        assert rec.choices[0].text == "Hello there!"
        assert rec.done  # the terminal event ends the stream; there is no [DONE]
        assert rec.output_events == 3 and rec.events == 9
        assert (rec.output_tokens, rec.prompt_tokens, rec.tokens_source) == (3, 7, "usage")
        assert rec.choices[0].finish_reason == "stop"
        # response.created/in_progress arrive at once; the first token 150 ms later.
        assert rec.timings.ttft_s is not None and rec.timings.ttft_s >= 0.15
        assert rec.timings.e2e_s is not None and rec.timings.e2e_s >= rec.timings.ttft_s + 0.02


async def test_sdk_responses_text_matches_the_record_and_the_simulators_truth(sims, gateway):
    sim = await sims(step_s=0.002)
    gw = await gateway(sim.base_url)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.responses.create(
            model="sim-model", input="Explain KV caches.", max_output_tokens=20, stream=True
        )
        text = await deltas(stream)
        exchange = await gw.sink.wait_for()
        whole = await client.responses.create(
            model="sim-model", input="Explain KV caches.", max_output_tokens=20
        )
    rec = exchange.primary.recording
    assert rec is not None
    truth = sim.state.requests[exchange.request_id]
    assert "".join(truth.tokens) == text == rec.choices[0].text == whole.output_text
    assert rec.output_tokens == 20 and rec.choices[0].finish_reason == "length"  # incomplete
    assert rec.output_events == sum(1 for e in truth.events if e.kind == "output")
    body_rec = (await gw.sink.wait_for(lambda e: not e.stream)).primary.recording
    assert body_rec is not None and body_rec.choices[0].text == whole.output_text
    assert whole.usage is not None and body_rec.output_tokens == whole.usage.output_tokens


async def test_tool_calls_over_responses_are_merged_by_the_recorder(sims, gateway):
    sim = await sims(step_s=0.001)
    gw = await gateway(sim.base_url)
    tools: list[Any] = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.responses.create(
            model="sim-model", input="Weather?", tools=tools, stream=True
        )
        arguments = await deltas(stream, "response.function_call_arguments.delta")
    rec = (await gw.sink.wait_for()).primary.recording
    assert rec is not None
    (call,) = rec.choices[0].tool_calls
    assert call.name == "get_weather" and call.arguments == arguments and json.loads(arguments)
    assert rec.choices[0].finish_reason == "tool_calls"
    # TTFT is the first arguments delta, not the item announcing the call.
    assert rec.timings.ttft_s is not None and rec.output_events >= 1


async def test_a_mirrored_responses_request_is_recorded_with_both_legs_timed_and_compared(
    sims, gateway, write_policy, tmp_path
):
    primary = await sims(step_s=0.002)
    candidate = await sims(mode="speculative", num_speculative_tokens=3, acceptance=0.8)
    store = tmp_path / "r.sqlite"
    gw = await gateway(
        None,
        policy_path=write_policy(policy_yaml(primary.base_url, candidate.base_url)),
        store_path=str(store),
    )
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.responses.create(
            model="sim-model", input="Tell me a story.", max_output_tokens=48, stream=True
        )
        text = await deltas(stream)
        reply = await client.responses.create(  # not streamed by the client; the shadow is
            model="sim-model", input="Tell me a story.", max_output_tokens=48
        )
    assert reply.output_text == text
    exchanges = [await gw.sink.wait_for(), await gw.sink.wait_for(lambda e: not e.stream)]
    await gw.server.close()  # flushes the records
    records = {r["request_id"]: r for r in query_records(store)}
    for exchange in exchanges:
        record = records[exchange.request_id]
        assert record["route"] == "responses"
        primary_leg, candidate_leg = record["legs"]
        assert (primary_leg["role"], candidate_leg["role"]) == ("primary", "candidate")
        assert candidate_leg["outcome"] == "completed" and candidate_leg["ttft_s"] is not None
        assert candidate_leg["output_tokens"] == primary_leg["output_tokens"] == 48
        assert candidate_leg["acceptance"]["source"] == "vllm_metrics"
        assert candidate_leg["tokens_per_event"] > 1.0  # speculative: several tokens per pass
        (comparison,) = record["comparisons"]
        assert comparison["exact_match"] is True and comparison["b"] == "candidate"
        if exchange.stream:
            assert primary_leg["ttft_s"] is not None and primary_leg["tokens_per_event"] == 1.0
        else:
            assert primary_leg["ttft_s"] is None and primary_leg["e2e_s"] is not None


async def test_shadows_never_store_and_the_primary_body_is_untouched(
    fake_upstream, sims, gateway, write_policy
):
    primary_fake, primary_url = await fake_upstream(Script(chunks=scripted_stream(0.0)))
    shadow_fake, shadow_url = await fake_upstream(Script(chunks=scripted_stream(0.0)))
    gw = await gateway(None, policy_path=write_policy(policy_yaml(primary_url, shadow_url)))
    request = {"model": "m", "input": "hi", "store": True, "stream": False}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}/v1/responses", json=request) as resp,
    ):
        await resp.read()
    await gw.sink.wait_for()
    (to_primary,) = [r for r in primary_fake.received if r.method == "POST"]
    (to_shadow,) = [r for r in shadow_fake.received if r.method == "POST"]
    assert json.loads(to_primary.body) == request
    sent = json.loads(to_shadow.body)
    assert sent["store"] is False and sent["stream"] is True
    assert "stream_options" not in sent  # a chat field; the Responses API reports usage anyway
    assert sent["input"] == "hi"


async def test_previous_response_id_is_not_mirrored_and_is_counted(
    fake_upstream, gateway, write_policy
):
    _primary, primary_url = await fake_upstream(Script(chunks=scripted_stream(0.0)))
    shadow_fake, shadow_url = await fake_upstream(Script(chunks=scripted_stream(0.0)))
    gw = await gateway(None, policy_path=write_policy(policy_yaml(primary_url, shadow_url)))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        events = await client.responses.create(
            model="m", input="and then?", previous_response_id="resp_0", stream=True
        )
        assert [e async for e in events]
    exchange = await gw.sink.wait_for()
    assert exchange.shadows == ()
    assert [r for r in shadow_fake.received if r.method == "POST"] == []
    assert exchange.sampled and exchange.drop_reason == "previous_response_id"
    assert exchange.dropped == (("cand", "candidate", "previous_response_id"),)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/admin/shadow") as resp:
            counts = (await resp.json())["counts"]
        async with session.get(f"{gw.url}/metrics") as resp:
            metrics = await resp.text()
    assert {"event": "dropped", "role": "candidate", "backend": "cand", "reason": "previous_response_id", "count": 1} in counts  # fmt: skip
    (line,) = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("specshadow_shadow_requests_total") and "previous_response_id" in ln
    ]
    assert line.endswith(" 1") and 'specshadow_outcome="dropped"' in line


async def test_a_bad_body_gets_an_openai_shaped_error(gateway, fake_upstream):
    path = "/v1/responses"
    fake, up = await fake_upstream(Script())
    gw = await gateway(up)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}{path}", data=b"[1, 2]") as resp,
    ):
        body = await resp.json()
    assert resp.status == 400 and body["error"]["type"] == "invalid_request_error"
    assert fake.received == []
