"""Fault knobs, per request (x-sim-fault) and from config defaults."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
import pytest

from simulator import SimConfig, SimServer, parse_faults, run_simulator
from tests.simulator.helpers import split_events

STREAM = {"messages": [{"role": "user", "content": "faulty"}], "max_tokens": 20, "stream": True}
WHOLE = {"messages": [{"role": "user", "content": "faulty"}], "max_tokens": 20}
SLOWISH = SimConfig(prefill_base_s=0.0, step_s=0.001)


def url(server: SimServer) -> str:
    return f"{server.base_url}/v1/chat/completions"


async def read_until_stall(resp: aiohttp.ClientResponse) -> tuple[bytes, BaseException | None]:
    body = b""
    try:
        while chunk := await resp.content.readany():
            body += chunk
    except (TimeoutError, aiohttp.ClientError) as exc:
        return body, exc
    return body, None


async def wait_for(predicate: Callable[[], object], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_status_fault_answers_an_openai_error_with_that_status(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    async with session.post(
        url(server), json=STREAM, headers={"x-sim-fault": "status=503", "x-request-id": "f"}
    ) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == 503 and error["message"]
    assert (
        server.state.requests["f"].status == 503
        and server.state.requests["f"].outcome == "error_status"
    )


async def test_hang_before_headers_sends_nothing_and_ends_when_the_client_leaves(
    start_sim, session
):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    with pytest.raises(TimeoutError):
        async with session.post(
            url(server),
            json=STREAM,
            headers={"x-sim-fault": "hang_before_headers", "x-request-id": "h"},
            timeout=aiohttp.ClientTimeout(total=0.3),
        ):
            pass
    record = server.state.requests["h"]
    assert record.outcome == "hung" and record.events == []
    await wait_for(lambda: record.finished_ns is not None)


async def test_hang_after_stops_after_n_events_but_keeps_the_connection_open(start_sim, session):
    server = await start_sim(SLOWISH)
    timeout = aiohttp.ClientTimeout(sock_read=0.3)
    async with session.post(
        url(server),
        json=STREAM,
        headers={"x-sim-fault": "hang_after=3", "x-request-id": "ha"},
        timeout=timeout,
    ) as resp:
        assert resp.status == 200
        body, exc = await read_until_stall(resp)
    assert isinstance(exc, TimeoutError)
    assert len(split_events(body)) == 3
    await wait_for(lambda: server.state.requests["ha"].finished_ns is not None)
    assert server.state.requests["ha"].outcome == "hung"


async def test_drop_after_aborts_the_connection_after_n_events(start_sim, session):
    server = await start_sim(SLOWISH)
    async with session.post(
        url(server), json=STREAM, headers={"x-sim-fault": "drop_after=3", "x-request-id": "d"}
    ) as resp:
        assert resp.status == 200
        body, exc = await read_until_stall(resp)
    assert isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError)
    assert len(split_events(body)) == 3
    assert server.state.requests["d"].outcome == "dropped"


async def test_drop_after_on_a_non_streaming_request_aborts_before_the_body(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    with pytest.raises(aiohttp.ClientError):
        async with session.post(
            url(server), json=WHOLE, headers={"x-sim-fault": "drop_after=0"}
        ) as resp:
            await resp.read()


async def test_slow_headers_delays_the_response_headers(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    t0 = time.perf_counter()
    async with session.post(
        url(server), json=STREAM, headers={"x-sim-fault": "slow_headers=0.2"}
    ) as resp:
        headers_s = time.perf_counter() - t0
        await resp.read()
    assert headers_s >= 0.2


async def test_malformed_emits_one_broken_event_and_the_stream_still_completes(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    async with session.post(url(server), json=STREAM, headers={"x-sim-fault": "malformed"}) as resp:
        events = split_events(await resp.read())
    broken = []
    for e in events[:-1]:
        try:
            e.json()
        except json.JSONDecodeError:
            broken.append(e)
    assert len(broken) == 1 and events[-1].data == "[DONE]"
    async with session.post(url(server), json=WHOLE, headers={"x-sim-fault": "malformed"}) as resp:
        with pytest.raises(json.JSONDecodeError):
            json.loads(await resp.read())


async def test_config_faults_apply_to_every_request_and_the_header_overrides_them(
    start_sim, session
):
    server = await start_sim(
        SimConfig(faults=parse_faults("status=429"), prefill_base_s=0.0, step_s=0.0)
    )
    async with session.post(url(server), json=WHOLE) as resp:
        assert resp.status == 429
    async with session.post(url(server), json=WHOLE, headers={"x-sim-fault": "status=500"}) as resp:
        assert resp.status == 500


async def test_an_unparseable_fault_header_is_a_400(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    async with session.post(url(server), json=WHOLE, headers={"x-sim-fault": "explode"}) as resp:
        assert resp.status == 400 and "x-sim-fault" in (await resp.json())["error"]["message"]


async def test_shutdown_releases_a_hung_request_promptly():
    # The hung request never ends by itself: that the block exits at all is the claim (the
    # server's 1 s shutdown timeout cancels it); a hang fails on the test's timeout.
    async with aiohttp.ClientSession() as session:
        async with run_simulator(SimConfig(prefill_base_s=0.0, step_s=0.0)) as server:
            task = asyncio.create_task(
                session.post(
                    url(server),
                    json=STREAM,
                    headers={"x-sim-fault": "hang_after=1", "x-request-id": "s"},
                )
            )
            await wait_for(
                lambda: "s" in server.state.requests and server.state.requests["s"].events
            )
        async with await task as resp:
            await read_until_stall(resp)


async def test_a_client_leaving_mid_stream_is_recorded_and_frees_the_engine(start_sim, session):
    server = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.005))
    body = {**STREAM, "max_tokens": 200}
    async with session.post(url(server), json=body, headers={"x-request-id": "gone"}) as resp:
        await resp.content.readany()
        resp.close()
    record = server.state.requests["gone"]
    await wait_for(lambda: record.outcome == "client_disconnected")
    assert len(record.events) < len(record.per_step_drafted)
    labels = {"model_name": "sim-model", "engine": "0"}
    assert server.metrics.registry.get_sample_value("vllm:num_requests_running", labels) == 0
