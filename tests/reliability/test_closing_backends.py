"""A backend that closes its connection after every response without saying so (no
``Connection: close``) — llama.cpp's server after every streamed answer. A pooled connection
reused after such a response is dead; the gateway must lose no leg and give no client an error
(docs/reliability.md, "Backends that close after a response").

The backend is a real aiohttp server whose handler closes the transport after the response's last
chunk. Both peers run on one event loop, so the order of events is fixed and so are the outcomes
(checked: 25 of 50 sequential requests of a bare pooled aiohttp client fail, every run):

- ``at_once``: the close is sent with the last chunk. The client's next request takes the pooled
  connection, and by the time its first write runs the close has arrived: aiohttp fails it with
  "cannot write to closing transport" — nothing was written, so the gateway sends it again on a
  fresh connection (the *resend*) and stops pooling for that backend (the *learning*);
- ``after``: the close comes one loop turn later, after the next request was written. The handler
  never reads it either, but from the client's side that is a server that dropped a request it
  may have read: never resent. Only the learning saves the requests after the first.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Literal

import aiohttp
import openai
from aiohttp import web

from gateway.errors import UpstreamError
from gateway.settings import UpstreamSettings
from gateway.upstream import UpstreamClient, UpstreamTarget
from tests.reliability.helpers import wait_for_exchanges

Mode = Literal["at_once", "after"]
REQUESTS = 40
EVENTS = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n',
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
    b"data: [DONE]\n\n",
)
SETTINGS = UpstreamSettings(retry_initial_s=0.01)


class ClosingBackend:
    """Streams a one-token answer, then closes the connection (no ``Connection: close``)."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.requests = 0  # requests the handler read
        self.peers: set[tuple[str, int]] = set()  # distinct client connections seen
        self.runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.requests += 1
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer is not None:
            self.peers.add(peer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for event in EVENTS:
            await resp.write(event)
        await resp.write_eof()
        transport = request.transport
        assert transport is not None
        if self.mode == "at_once":
            transport.close()
        else:
            asyncio.get_running_loop().call_soon(transport.close)
        return resp

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
HEADERS = {"Content-Type": "application/json"}


async def _through_client(client: UpstreamClient) -> Counter[str]:
    out: Counter[str] = Counter()
    for _ in range(REQUESTS):
        try:
            async with client.open(
                "POST", "/v1/chat/completions", headers=HEADERS, data=BODY, retry=False
            ) as resp:
                body = await resp.read()
                out["ok" if body.endswith(b"data: [DONE]\n\n") else "short"] += 1
        except UpstreamError as exc:
            out[type(exc.__cause__).__name__] += 1
    return out


async def _bare(url: str) -> Counter[str]:
    out: Counter[str] = Counter()
    async with aiohttp.ClientSession() as session:
        for _ in range(REQUESTS):
            try:
                async with session.post(f"{url}/v1/chat/completions", data=BODY) as resp:
                    await resp.read()
                    out["ok"] += 1
            except aiohttp.ClientError as exc:
                out[type(exc).__name__] += 1
    return out


async def test_a_bare_pooled_client_loses_every_reused_connection():
    """The backend double is what it claims: a pooled client fails every other request."""
    for mode, error in (("at_once", "ClientOSError"), ("after", "ServerDisconnectedError")):
        backend = ClosingBackend(mode)  # type: ignore[arg-type]
        url = await backend.start()
        try:
            got = await _bare(url)
        finally:
            await backend.stop()
        assert got == {"ok": REQUESTS // 2, error: REQUESTS // 2}, mode
        # Neither reached the handler; only at once can the client know it (nothing written).
        assert backend.requests == REQUESTS // 2


async def test_an_unsent_request_is_resent_once_and_the_backend_is_learned():
    backend = ClosingBackend("at_once")
    url = await backend.start()
    client = UpstreamClient(UpstreamTarget("llama", url), SETTINGS)
    try:
        got = await _through_client(client)
    finally:
        await client.close()
        await backend.stop()
    assert got == {"ok": REQUESTS}
    # Only the second request met a dead pooled connection: the first write failed, it was sent
    # again on a fresh one, and from then on nothing was pooled (without the learning: 20 resends).
    assert client.resent == 1
    assert client.closes_connections
    assert backend.requests == REQUESTS  # each request reached the backend exactly once
    assert len(backend.peers) == REQUESTS  # one connection each


async def test_a_request_that_may_have_been_read_is_never_resent_and_learning_saves_the_rest():
    backend = ClosingBackend("after")
    url = await backend.start()
    client = UpstreamClient(UpstreamTarget("llama", url), SETTINGS)
    try:
        got = await _through_client(client)
    finally:
        await client.close()
        await backend.stop()
    # The second request was written before the close arrived. This backend never read it, but
    # the client cannot know that (a server that read it and died looks the same): not resent.
    # Learned, so the 38 after it had connections of their own (without the learning: 20 lost).
    assert got == {"ok": REQUESTS - 1, "ServerDisconnectedError": 1}
    assert client.resent == 0
    assert client.closes_connections
    assert backend.requests == REQUESTS - 1


async def test_a_backend_known_to_close_is_never_pooled_and_loses_nothing():
    """A ``llamacpp`` backend is known to close (``closes_connections``): no request is ever sent
    on a reused connection, so even the unprovable case never happens."""
    backend = ClosingBackend("after")
    url = await backend.start()
    client = UpstreamClient(UpstreamTarget("llama", url), SETTINGS, closes_connections=True)
    try:
        got = await _through_client(client)
    finally:
        await client.close()
        await backend.stop()
    assert got == {"ok": REQUESTS}
    assert client.resent == 0
    assert backend.requests == len(backend.peers) == REQUESTS


async def test_the_gateway_loses_no_leg_and_no_answer_to_a_closing_primary_and_candidate(
    gateway, write_policy
):
    """End to end, the official SDK without retries. In one process the gateway's relay gives the
    loop a turn to see each close before the next request, so this passes without the fix too:
    the tests above are the ones that fail without it, and the llama.cpp tier
    (tests/llamacpp) runs the same check against the real server in its own process."""
    primary, candidate = ClosingBackend("at_once"), ClosingBackend("at_once")
    p_url, c_url = await primary.start(), await candidate.start()
    policy = write_policy(
        "version: 1\n"
        f"backends:\n  prim: {{url: '{p_url}', kind: openai}}\n"
        f"  cand: {{url: '{c_url}', kind: openai}}\n"
        "primary: prim\n"
        "default:\n  ratio: 1.0\n  legs: [{backend: cand, role: candidate}]\n"
        "budgets: {max_in_flight: 1000, breaker: {failures: 100000, window_s: 1}}\n"
    )
    try:
        gw = await gateway(None, policy_path=policy, upstream=SETTINGS)
        sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        texts = []
        for _ in range(REQUESTS):
            stream = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            texts.append(
                "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            )
        await sdk.close()
        exchanges = await wait_for_exchanges(gw.sink, REQUESTS)
    finally:
        await primary.stop()
        await candidate.stop()
    assert texts == ["hi"] * REQUESTS  # max_retries=0: no client-side retry hides a 502
    assert Counter(ex.primary.outcome for ex in exchanges) == {"completed": REQUESTS}
    outcomes = Counter(leg.outcome for ex in exchanges for leg in ex.shadows)
    assert outcomes == {"completed": REQUESTS}
    assert primary.requests == candidate.requests == REQUESTS
