"""The proxy relays the primary byte for byte and times it — real sockets, scripted upstream."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import time

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.settings import UpstreamSettings
from tests.fakes.upstream import Script, sse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHUNK = (
    '{"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
    '"delta":{"content":"%s"},"finish_reason":null}]}'
)


async def post(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.post(
            f"{url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as resp,
    ):
        return resp.status, CIMultiDict(resp.headers), await resp.read()  # type: ignore[return-value]


async def test_adversarial_stream_bytes_reach_the_client_unchanged(fake_upstream, gateway):
    rnd = os.urandom(4096)
    chunks = [
        (0.0, b": comment\r"),
        (0.0, b'data: {"a":\r\n'),  # CR/LF mix, then a split event
        (0.001, b"\n\ndata: \xe2\x80"),  # a UTF-8 character split across chunks
        (0.0, b"\xa8 U+2028 is not a newline\n\n"),
        (0.0, rnd),  # arbitrary bytes, including invalid UTF-8
        (0.0, b"data: " + b"x" * (5 * 1024 * 1024) + b"\n\n"),  # one 5 MiB line
        (0.0, b"data: [DONE]\n\n"),
    ]
    _fake, up = await fake_upstream(Script(chunks=chunks))
    gw = await gateway(up)
    status, _headers, body = await post(gw.url, json.dumps(CHAT).encode())
    assert status == 200
    assert body == b"".join(c for _d, c in chunks)
    exchange = await gw.sink.wait_for()
    assert exchange.primary.outcome == "completed"
    assert exchange.primary.recording is not None
    assert exchange.primary.recording.bytes_received == len(body)


async def test_request_body_reaches_the_primary_unchanged_and_request_id_round_trips(
    fake_upstream, gateway
):
    raw = b'{"model": "m",   "messages": [{"role":"user","content":"\\u00e9t\xc3\xa9"}], "zz": 1}'
    fake, up = await fake_upstream(
        Script(headers=[("Content-Type", "application/json")], chunks=[(0, b"{}")])
    )
    gw = await gateway(up)
    status, headers, _ = await post(
        gw.url, raw, {"x-request-id": "client-rid-1", "Authorization": "Bearer sk-client"}
    )
    assert status == 200
    assert fake.received[0].body == raw
    assert fake.received[0].headers["x-request-id"] == "client-rid-1"
    assert fake.received[0].headers["authorization"] == "Bearer sk-client"
    assert headers["x-request-id"] == "client-rid-1"
    status, headers, _ = await post(gw.url, raw)
    generated = headers["x-request-id"]
    assert len(generated) >= 16
    assert fake.received[1].headers["x-request-id"] == generated


async def test_end_to_end_headers_pass_and_hop_by_hop_headers_do_not(fake_upstream, gateway):
    fake, up = await fake_upstream(
        Script(
            headers=[
                ("Content-Type", "application/json"),
                ("X-Upstream", "1"),
                ("Set-Cookie", "a=1"),
                ("Set-Cookie", "b=2"),
                ("Connection", "X-Secret-Hop"),
                ("X-Secret-Hop", "should-not-pass"),
                ("Keep-Alive", "timeout=5"),
            ],
            chunks=[(0, b'{"ok": true}')],
            content_length=True,
        )
    )
    gw = await gateway(up)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gw.url}/v1/chat/completions",
            data=b"{}",
            headers={"Content-Type": "application/json", "TE": "trailers", "X-Client": "c"},
        ) as resp,
    ):
        assert resp.headers["X-Upstream"] == "1"
        assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
        assert "X-Secret-Hop" not in resp.headers
        assert "Keep-Alive" not in resp.headers
        assert resp.headers["Content-Length"] == str(len(b'{"ok": true}'))
        assert await resp.read() == b'{"ok": true}'
    assert "te" not in fake.received[0].headers
    assert fake.received[0].headers["x-client"] == "c"


async def test_gzip_body_is_relayed_encoded_and_still_recorded(fake_upstream, gateway):
    plain = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    ).encode()
    packed = gzip.compress(plain)
    _fake, up = await fake_upstream(
        Script(
            headers=[("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
            chunks=[(0, packed[:10]), (0.001, packed[10:])],
        )
    )
    gw = await gateway(up)
    status, headers, body = await post(gw.url, b'{"model":"m"}', {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert body == packed
    recording = (await gw.sink.wait_for()).primary.recording
    assert recording is not None and recording.choices[0].text == "hello"
    assert recording.output_tokens == 2


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b'"a string"', 400, "must be a JSON object"),
    ],
)
async def test_bad_request_bodies_get_openai_shaped_400(
    fake_upstream, gateway, body, status, fragment
):
    fake, up = await fake_upstream(Script())
    gw = await gateway(up)
    got_status, _h, got = await post(gw.url, body)
    assert got_status == status
    error = json.loads(got)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert fake.received == []


async def test_body_over_the_limit_gets_413_and_never_reaches_the_primary(fake_upstream, gateway):
    fake, up = await fake_upstream(Script())
    gw = await gateway(up, max_body_bytes=1024)
    status, _h, body = await post(gw.url, b'{"p": "' + b"a" * 2048 + b'"}')
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert fake.received == []


async def test_refused_primary_gets_502_after_connect_retries(gateway):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = await gateway(f"http://127.0.0.1:{port}")
    status, headers, body = await post(gw.url, b'{"model": "m"}')
    assert status == 502
    assert json.loads(body)["error"]["code"] == "upstream_unreachable"
    assert headers["x-request-id"]
    exchange = await gw.sink.wait_for()
    assert exchange.primary.outcome == "upstream_error"
    assert exchange.primary.error_type == "UpstreamConnectError"


async def test_primary_that_never_answers_gets_504(fake_upstream, gateway):
    fake, up = await fake_upstream(Script(hang_before_headers=True))
    gw = await gateway(up, upstream=UpstreamSettings(idle_timeout_s=0.3, retry_initial_s=0.01))
    status, _h, body = await post(gw.url, b'{"model": "m"}')
    assert status == 504
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    assert len(fake.received) == 1  # a timeout is never retried
    assert (await gw.sink.wait_for()).primary.outcome == "upstream_timeout"


async def test_connect_timeout_gets_504(gateway):
    # A listener whose accept queue is full: further SYNs are dropped, so connect() hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        gw = await gateway(
            f"http://127.0.0.1:{port}", upstream=UpstreamSettings(connect_timeout_s=0.3)
        )
        status, _h, body = await post(gw.url, b'{"model": "m"}')
        assert status == 504, body  # the connect timeout answered, not a hang
    finally:
        for s in fillers:
            s.close()
        listener.close()


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
async def test_upstream_error_statuses_are_relayed_unchanged(fake_upstream, gateway, status):
    payload = b'{"error": {"message": "upstream says no", "type": "x", "param": null, "code": 7}}'
    fake, up = await fake_upstream(
        Script(
            status=status,
            headers=[("Content-Type", "application/json"), ("Retry-After", "3")],
            chunks=[(0, payload)],
        )
    )
    gw = await gateway(up)
    got_status, headers, body = await post(gw.url, b'{"model": "m"}')
    assert (got_status, body, headers["Retry-After"]) == (status, payload, "3")
    leg = (await gw.sink.wait_for()).primary
    assert leg.status == status and leg.outcome == "upstream_status"
    assert len(fake.received) == 1


async def test_upstream_dying_mid_stream_ends_the_client_stream_without_done(
    fake_upstream, gateway
):
    chunks = sse(CHUNK % "a", CHUNK % "b", CHUNK % "c", "[DONE]")
    fake, up = await fake_upstream(Script(chunks=chunks, drop_after=2))
    gw = await gateway(up)
    received = b""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp,
    ):
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                received += chunk
    assert received == chunks[0][1] + chunks[1][1]
    assert b"[DONE]" not in received
    leg = (await gw.sink.wait_for()).primary
    assert leg.outcome == "upstream_error"
    assert len(fake.received) == 1  # never retried after the first byte
    assert leg.recording is not None and leg.recording.output_events == 2


async def test_client_disconnect_closes_the_upstream_request(fake_upstream, gateway):
    chunks = sse(CHUNK % "a", CHUNK % "b")
    fake, up = await fake_upstream(Script(chunks=chunks, hang_after=1))
    gw = await gateway(up)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{gw.url}/v1/chat/completions", json=CHAT)
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        resp.close()  # the client goes away while the upstream is silent
        closed_ns = time.perf_counter_ns()
    # The upstream never sends again (hang_after=1): only the gateway can end its request. How
    # soon is a wall-clock figure (a one-sample bound of 100 ms measured the machine); the 30 s
    # deadline is liveness only.
    deadline = time.perf_counter() + 30
    while not fake.disconnected_ns and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    assert fake.disconnected_ns, "the upstream request was never closed"
    assert fake.disconnected_ns[0] > closed_ns  # because the client left
    leg = (await gw.sink.wait_for()).primary
    assert leg.outcome == "client_disconnected"


async def test_models_and_other_v1_paths_pass_through_untimed(fake_upstream, gateway):
    models = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
    fake, up = await fake_upstream(
        Script(headers=[("Content-Type", "application/json")], chunks=[(0, models)])
    )
    gw = await gateway(up)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/v1/models?x=1") as resp:
            assert resp.status == 200 and await resp.read() == models
        async with session.post(f"{gw.url}/v1/embeddings", data=b"\x00raw") as resp:
            assert resp.status == 200
    assert [r.path_qs for r in fake.received] == ["/v1/models?x=1", "/v1/embeddings"]
    assert fake.received[1].body == b"\x00raw"
    assert len(gw.sink.exchanges) == 0


async def test_health_and_readiness_follow_the_primary(fake_upstream, gateway):
    _fake, up = await fake_upstream(Script())
    gw = await gateway(up, ready_cache_s=0.0)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/healthz") as resp:
            assert resp.status == 200
        async with session.get(f"{gw.url}/readyz") as resp:
            assert resp.status == 200
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    gw2 = await gateway(f"http://127.0.0.1:{dead}", ready_cache_s=0.0)
    async with aiohttp.ClientSession() as session, session.get(f"{gw2.url}/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "not_ready"
