"""A scripted upstream test double with known ground truth: exact bytes, exact timing, faults.

It plays an OpenAI-compatible server at the byte level (the simulator in ``simulator/`` plays it at
the API level). Every request it receives is kept for assertions, with its headers and body bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class Script:
    """What the fake sends: ``chunks`` are (delay_s before, bytes)."""

    status: int = 200
    headers: Sequence[tuple[str, str]] = (("Content-Type", "text/event-stream"),)
    chunks: Sequence[tuple[float, bytes]] = ()
    content_length: bool = False  # send Content-Length instead of chunked encoding
    hang_before_headers: bool = False
    hang_after: int | None = None  # send this many chunks, then go silent (connection open)
    drop_after: int | None = None  # send this many chunks, then abort the TCP connection


@dataclass
class Received:
    method: str
    path_qs: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes
    received_ns: int


@dataclass
class FakeUpstream:
    script: Script = field(default_factory=Script)
    received: list[Received] = field(default_factory=list)
    disconnected_ns: list[int] = field(default_factory=list)
    sent_ns: list[int] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(
                method=request.method,
                path_qs=request.path_qs,
                headers={k.lower(): v for k, v in request.headers.items()},
                raw_headers=[(k.decode(), v.decode()) for k, v in request.raw_headers],
                body=body,
                received_ns=time.perf_counter_ns(),
            )
        )
        script = self.script
        if script.hang_before_headers:
            await self._hang()
        resp = web.StreamResponse(status=script.status)
        for name, value in script.headers:
            resp.headers.add(name, value)
        if script.content_length:
            resp.content_length = sum(len(c) for _d, c in script.chunks)
        await resp.prepare(request)
        try:
            for i, (delay_s, chunk) in enumerate(script.chunks):
                if script.hang_after is not None and i >= script.hang_after:
                    await self._hang()
                if script.drop_after is not None and i >= script.drop_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if delay_s:
                    await asyncio.sleep(delay_s)
                self.sent_ns.append(time.perf_counter_ns())
                await resp.write(chunk)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected_ns.append(time.perf_counter_ns())
            raise
        return resp

    async def _hang(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.disconnected_ns.append(time.perf_counter_ns())
            raise


def sse(*events: bytes | str) -> list[tuple[float, bytes]]:
    """``data: …\\n\\n`` chunks with no delay, one per event."""
    out = []
    for event in events:
        data = event.encode() if isinstance(event, str) else event
        out.append((0.0, b"data: " + data + b"\n\n"))
    return out
