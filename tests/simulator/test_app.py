"""The simulator over HTTP: shapes, determinism, speculative chunks, metrics, ground truth."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import pytest

from simulator import SimConfig, SimServer, expected_rates
from tests.simulator.helpers import Event, split_events

SPEC = SimConfig(
    mode="speculative", acceptance=0.7, num_speculative_tokens=4, prefill_base_s=0.0, step_s=0.0
)
PLAIN = SimConfig(mode="plain", prefill_base_s=0.0, step_s=0.0)


def chat_body(content: str = "Tell me a story", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def post(
    session: aiohttp.ClientSession,
    server: SimServer,
    body: dict[str, Any],
    *,
    route: str = "chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    async with session.post(f"{server.base_url}/v1/{route}", json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def post_ok(
    session: aiohttp.ClientSession, server: SimServer, body: dict[str, Any], **kw: Any
) -> bytes:
    status, raw = await post(session, server, body, **kw)
    assert status == 200, raw
    return raw


def output_text(events: list[Event]) -> str:
    return "".join(
        choice.get("text") or choice.get("delta", {}).get("content") or ""
        for e in events
        if e.data != "[DONE]"
        for choice in e.json()["choices"]
    )


async def scrape(session: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    async with session.get(f"{server.base_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


LABELS = 'engine="0",model_name="sim-model"'


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_text_is_identical_in_plain_and_speculative_streaming_and_not(
    start_sim, session, route
):
    plain, spec = await start_sim(PLAIN), await start_sim(SPEC)
    body = (
        chat_body("same prompt", max_tokens=40)
        if route.startswith("chat")
        else {"prompt": "same prompt", "max_tokens": 40}
    )
    texts = []
    for server in (plain, spec):
        status, raw = await post(session, server, body, route=route)
        assert status == 200
        choice = json.loads(raw)["choices"][0]
        texts.append(choice.get("text") or choice.get("message", {}).get("content"))
        status, raw = await post(session, server, {**body, "stream": True}, route=route)
        texts.append(output_text(split_events(raw)))
    assert len(set(texts)) == 1 and texts[0]


async def test_chat_stream_has_vllm_shape_role_first_finish_on_last_then_usage_and_done(
    start_sim, session
):
    server = await start_sim(PLAIN)
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    status, raw = await post(session, server, body, headers={"x-request-id": "shape"})
    assert status == 200
    events = split_events(raw)
    assert events[-1].data == "[DONE]"
    chunks = [e.json() for e in events[:-1]]
    assert all(set(c) >= {"id", "object", "created", "model", "choices"} for c in chunks)
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-shape" for c in chunks
    )
    assert chunks[0]["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    content = chunks[1:-1]
    assert len(content) == 5  # plain: one chunk per token
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert "metrics" not in chunks[-1]


async def test_speculative_chunks_carry_one_steps_tokens_and_metrics_match_ground_truth(
    start_sim, session
):
    server = await start_sim(SPEC)
    before = await scrape(session, server)
    body = chat_body(
        "speculate",
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
        include_metrics=True,
    )
    status, raw = await post(session, server, body, headers={"x-request-id": "spec-1"})
    assert status == 200
    record = server.state.requests["spec-1"]
    events = split_events(raw)
    outputs = [e for e in events[1:] if e.data != "[DONE]" and e.json()["choices"]]
    steps = list(zip(record.per_step_drafted, record.per_step_accepted, strict=True))
    assert len(outputs) == len(steps) < record.completion_tokens
    for event, (_drafted, accepted) in zip(outputs, steps, strict=True):
        assert (
            len(re.findall(r" ?\w+|[.,]", event.json()["choices"][0]["delta"]["content"]))
            == accepted + 1
        )
    assert output_text(events) == record.text

    sd = events[-2].json()["metrics"]["speculative_decoding"]
    drafting = [(d, a) for d, a in steps if d]
    assert sd["num_spec_steps"] == len(drafting) == record.num_drafts
    assert sd["num_draft_tokens"] == record.num_draft_tokens
    assert sd["num_accepted_draft_tokens"] == record.num_accepted_tokens
    assert sd["num_spec_tokens"] == 4
    assert sd["mean_acceptance_length"] == pytest.approx(
        1 + record.num_accepted_tokens / len(drafting)
    )
    assert sd["draft_acceptance_rate"] == pytest.approx(
        record.num_accepted_tokens / record.num_draft_tokens
    )
    assert sd["acceptance_histogram"] == [sum(1 for _, a in drafting if a == i) for i in range(5)]
    assert record.completion_tokens == len(steps) + record.num_accepted_tokens

    after = await scrape(session, server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta[f"vllm:spec_decode_num_drafts_total{{{LABELS}}}"] == record.num_drafts
    assert delta[f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}}"] == record.num_draft_tokens
    assert (
        delta[f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}}"]
        == record.num_accepted_tokens
    )
    per_pos = [
        delta[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABELS},position="{i}"}}']
        for i in range(4)
    ]
    assert per_pos == [sum(1 for _, a in drafting if a > i) for i in range(4)]
    assert delta[f"vllm:generation_tokens_total{{{LABELS}}}"] == record.completion_tokens
    assert delta[f"vllm:inter_token_latency_seconds_count{{{LABELS}}}"] == len(steps) - 1
    assert delta[f"vllm:time_to_first_token_seconds_count{{{LABELS}}}"] == 1
    assert delta[f"vllm:e2e_request_latency_seconds_count{{{LABELS}}}"] == 1
    assert after[f"vllm:num_requests_running{{{LABELS}}}"] == 0
    assert f"vllm:kv_cache_usage_perc{{{LABELS}}}" in after


async def test_plain_metrics_have_no_speculative_section_and_no_spec_counters(start_sim, session):
    server = await start_sim(PLAIN)
    raw = await post_ok(session, server, chat_body(include_metrics=True))
    metrics = json.loads(raw)["metrics"]
    assert set(metrics) == {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    }
    assert not any(k.startswith("vllm:spec_decode") for k in await scrape(session, server))


async def test_empirical_acceptance_over_300_requests_is_near_the_configured_rate(
    start_sim, session
):
    config = SimConfig(
        mode="speculative",
        acceptance=(0.8, 0.6, 0.5, 0.4),
        coverage=0.8,
        min_output_tokens=40,
        max_output_tokens=80,
        prefill_base_s=0.0,
        step_s=0.0,
    )
    server = await start_sim(config)
    before = await scrape(session, server)
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> dict[str, Any]:
        async with sem:
            status, raw = await post(
                session,
                server,
                chat_body(f"prompt number {i}", max_tokens=100, include_metrics=True),
            )
            assert status == 200
            return json.loads(raw)

    bodies = await asyncio.gather(*(one(i) for i in range(300)))
    after = await scrape(session, server)
    drafts = after[f"vllm:spec_decode_num_drafts_total{{{LABELS}}}"] - before.get(
        f"vllm:spec_decode_num_drafts_total{{{LABELS}}}", 0
    )
    accepted = after[f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}}"] - before.get(
        f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}}", 0
    )
    draft_tokens = after[f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}}"] - before.get(
        f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}}", 0
    )
    exp = expected_rates(config)
    # Drafts are cut short at the end of each output, so allow a few points of truncation bias.
    assert 1 + accepted / drafts == pytest.approx(exp.mean_acceptance_length, abs=0.12)
    assert accepted / draft_tokens == pytest.approx(exp.draft_acceptance_rate, abs=0.04)
    assert (
        sum(b["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] for b in bodies)
        == accepted
    )
    steps = sum(len(r.per_step_drafted) - 1 for r in server.state.requests.values())
    coverage = drafts / steps
    assert coverage == pytest.approx(0.8, abs=0.05)


async def test_category_header_selects_the_category_acceptance(start_sim, session):
    config = SimConfig(
        mode="speculative",
        acceptance=0.0,
        category_acceptance={"code": 1.0},
        prefill_base_s=0.0,
        step_s=0.0,
    )
    server = await start_sim(config)
    await post(
        session,
        server,
        chat_body(max_tokens=30),
        headers={"x-request-id": "c", "x-specshadow-category": "code"},
    )
    await post(session, server, chat_body(max_tokens=30), headers={"x-request-id": "d"})
    code, chat = server.state.requests["c"], server.state.requests["d"]
    assert code.category == "code" and chat.category == "chat"
    assert code.num_accepted_tokens == code.num_draft_tokens > 0
    assert chat.num_accepted_tokens == 0 and len(chat.per_step_drafted) == 30


async def test_divergence_at_makes_speculative_text_differ_from_that_token(start_sim, session):
    plain = await start_sim(PLAIN)
    spec = await start_sim(
        SimConfig(mode="speculative", divergence_at=5, prefill_base_s=0.0, step_s=0.0)
    )
    for server, rid in ((plain, "p"), (spec, "s")):
        await post(session, server, chat_body(max_tokens=20), headers={"x-request-id": rid})
    p, s = plain.state.requests["p"].tokens, spec.state.requests["s"].tokens
    assert p[:5] == s[:5] and p[5] != s[5]


async def test_tool_call_streams_name_first_then_arguments_and_ends_with_tool_calls(
    start_sim, session
):
    server = await start_sim(SPEC)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query", "limit"],
                },
            },
        }
    ]
    raw = await post_ok(session, server, chat_body(tools=tools, stream=True, max_tokens=200))
    deltas = [e.json()["choices"][0] for e in split_events(raw)[1:-1]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas]
    assert (
        calls[0]["function"]["name"] == "lookup"
        and calls[0]["type"] == "function"
        and calls[0]["id"]
    )
    assert all("name" not in c["function"] for c in calls[1:])
    args = json.loads("".join(c["function"]["arguments"] for c in calls))
    assert isinstance(args["query"], str) and isinstance(args["limit"], int)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    raw = await post_ok(session, server, chat_body(tools=tools, max_tokens=200))
    message = json.loads(raw)["choices"][0]["message"]
    assert (
        message["content"] is None
        and json.loads(message["tool_calls"][0]["function"]["arguments"]) == args
    )


async def test_logprobs_give_one_entry_per_token(start_sim, session):
    server = await start_sim(SPEC)
    raw = await post_ok(
        session, server, chat_body(max_tokens=12, logprobs=True, top_logprobs=2, stream=True)
    )
    entries = [
        lp for e in split_events(raw)[1:-1] for lp in e.json()["choices"][0]["logprobs"]["content"]
    ]
    assert len(entries) == 12
    assert all(
        e["logprob"] <= 0
        and bytes(e["bytes"]).decode() == e["token"]
        and len(e["top_logprobs"]) == 2
        for e in entries
    )
    raw = await post_ok(
        session, server, {"prompt": "p", "max_tokens": 6, "logprobs": 1}, route="completions"
    )
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6


async def test_continuous_usage_stats_put_cumulative_usage_on_every_chunk(start_sim, session):
    server = await start_sim(SPEC)
    body = chat_body(
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    raw = await post_ok(session, server, body)
    chunks = [e.json() for e in split_events(raw)[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == counts[-2] == 30


async def test_every_event_is_stamped_just_before_its_write_and_matches_ground_truth(
    start_sim, session
):
    server = await start_sim(SimConfig(mode="speculative", prefill_base_s=0.0, step_s=0.002))
    t0 = time.perf_counter_ns()
    raw = await post_ok(
        session, server, chat_body(max_tokens=10, stream=True), headers={"x-request-id": "st"}
    )
    t1 = time.perf_counter_ns()
    stamps = [e.sent_ns or 0 for e in split_events(raw)]
    assert all(stamps)
    assert stamps == server.state.requests["st"].sent_ns
    assert t0 < stamps[0] and stamps == sorted(stamps) and stamps[-1] < t1
    unstamped = await start_sim(SimConfig(stamp_events=False, prefill_base_s=0.0, step_s=0.0))
    raw = await post_ok(session, unstamped, chat_body(max_tokens=3, stream=True))
    assert b": sent_ns" not in raw and raw.startswith(b"data: ")


async def test_prefill_and_step_times_bound_the_stream_timing(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.05, step_s=0.01))
    await post(session, server, chat_body(max_tokens=6, stream=True), headers={"x-request-id": "t"})
    record = server.state.requests["t"]
    assert record.first_token_ns is not None and record.last_token_ns is not None
    assert record.first_token_ns - record.arrival_ns >= 50_000_000
    assert all(
        b - a >= 10_000_000 for a, b in zip(record.step_ns, record.step_ns[1:], strict=False)
    )


async def test_max_num_seqs_queues_the_second_request(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.01, max_num_seqs=1))
    await asyncio.gather(
        *(
            post(
                session,
                server,
                chat_body(max_tokens=5, include_metrics=True),
                headers={"x-request-id": f"q{i}"},
            )
            for i in range(2)
        )
    )
    records = [server.state.requests[f"q{i}"] for i in range(2)]
    queued = max((r.started_ns or 0) - r.arrival_ns for r in records)
    assert queued >= 30_000_000


async def test_error_responses_are_openai_shaped(start_sim, session):
    server = await start_sim(PLAIN)
    status, raw = await post(session, server, chat_body(model="nope"))
    assert status == 404 and json.loads(raw)["error"]["code"] == 404
    async with session.post(f"{server.base_url}/v1/chat/completions", data=b"{bad") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "BadRequestError"


async def test_models_health_and_ground_truth_endpoints(start_sim, session):
    server = await start_sim(SimConfig(model="m1", aliases=("m2",), prefill_base_s=0.0, step_s=0.0))
    async with session.get(f"{server.base_url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m1", "m2"]
    async with session.get(f"{server.base_url}/health") as resp:
        assert resp.status == 200
    await post(session, server, chat_body(model="m2", max_tokens=4), headers={"x-request-id": "gt"})
    async with session.get(f"{server.base_url}/sim/requests", params={"id": "gt"}) as resp:
        record = await resp.json()
    assert (
        record["model"] == "m2"
        and record["completion_tokens"] == 4
        and record["outcome"] == "completed"
    )
    async with session.get(f"{server.base_url}/sim/requests", params={"id": "missing"}) as resp:
        assert resp.status == 404


async def test_ground_truth_keeps_only_the_last_max_records(start_sim, session):
    server = await start_sim(SimConfig(max_records=3, prefill_base_s=0.0, step_s=0.0))
    for i in range(5):
        await post(session, server, chat_body(max_tokens=1), headers={"x-request-id": f"r{i}"})
    assert list(server.state.requests) == ["r2", "r3", "r4"]
