"""A switchable backend: one address in front of several simulators, forwarding every request to
the one selected now — "the candidate changed mid-run" (a regression, a bad deploy) with known
ground truth: the selected simulator's own plan. The demo injects its regression with it; the
rollout tests drive every guard with it. Streams are relayed chunk by chunk, unbuffered."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

SESSION = web.AppKey("switch_session", aiohttp.ClientSession)


@dataclass
class Switch:
    """``targets``: name → simulator base URL; ``current``: the one requests go to (assign it to
    switch); ``served``: POSTs forwarded per target."""

    targets: Mapping[str, str]
    current: str
    served: dict[str, int] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)

        async def open_session(app: web.Application) -> AsyncIterator[None]:
            app[SESSION] = aiohttp.ClientSession(auto_decompress=False)
            yield
            await app[SESSION].close()

        app.cleanup_ctx.append(open_session)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Relay ``request`` to the current target, streaming its answer back unchanged."""
        name = self.current
        if request.method == "POST":
            self.served[name] = self.served.get(name, 0) + 1
        session = request.app[SESSION]
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        async with session.request(
            request.method,
            self.targets[name] + request.path_qs,
            headers=headers,
            data=await request.read(),
        ) as up:
            out = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    out.headers[k] = v
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
