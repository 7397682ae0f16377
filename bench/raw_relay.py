"""The physical floor for a Python proxy: a minimal aiohttp streaming relay (no policy, no timing).

``python -m bench.raw_relay --port P --upstream URL`` relays ``POST /v1/*`` to ``URL`` and streams the
answer back chunk by chunk (``readany`` → ``write``), on uvloop, with one pooled client session —
the same libraries and loop as the gateway, none of its work. ``GET /healthz`` answers 200.
Benchmarks put it next to the gateway so "added latency" can be read against what any aiohttp
proxy on this machine costs (issue 8's "raw relay" arm).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def session_ctx(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[SESSION] = session
        yield


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"content-type": request.headers.get("content-type", "application/json")}
    url = request.app[UPSTREAM] + request.path_qs
    async with request.app[SESSION].post(url, data=body, headers=headers) as up:
        content_type = up.headers.get("content-type", "application/octet-stream")
        response = web.StreamResponse(status=up.status, headers={"content-type": content_type})
        await response.prepare(request)
        while chunk := await up.content.readany():
            await response.write(chunk)
        await response.write_eof()
        return response


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.raw_relay", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    args = p.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/{tail:.*}", relay)
    app.router.add_get("/healthz", healthz)
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        loop=uvloop.new_event_loop(),
        access_log=None,
        print=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
