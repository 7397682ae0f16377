"""Route handlers: the thin aiohttp shell around the gateway's request path.

``completions`` serves ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST
/v1/responses`` (the Responses API) through
:func:`gateway.proxy.serve_completion`; ``passthrough`` relays any other ``/v1/*`` request to the
primary untouched and untimed; ``healthz``, ``readyz`` and ``metrics`` are the operator's probes.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from core import jsonx
from core.exchange import ROUTE_PATHS
from core.wire import REQUEST_ID_HEADER
from gateway.errors import UpstreamError, error_response
from gateway.forward import relay
from gateway.headers import upstream_request_headers
from gateway.proxy import request_id_of, serve_completion
from gateway.state import GATEWAY


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve_completion(request.app[GATEWAY], request, ROUTE_PATHS[request.path])


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other ``/v1/*`` request: relayed to the primary untouched and untimed."""
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    headers = upstream_request_headers(request.headers, request_id=request_id)
    data = request.content.iter_any() if request.body_exists else None
    try:
        async with gw.primary.open(
            request.method, request.path_qs, headers=headers, data=data, retry=False
        ) as up:
            downstream, _outcome, _error = await relay(request, up, request_id=request_id, tee=None)
    except UpstreamError as exc:
        return error_response(exc, headers={REQUEST_ID_HEADER: request_id})
    return downstream


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=jsonx.dumps(body), status=status, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    ok, detail = await gw.ready.check()
    body = {"status": "ready" if ok else "not_ready", "primary": detail}
    store = gw.rollout.store_health() if gw.rollout is not None else None
    if store is not None:  # detail only: without its store a replica serves its last decision
        body["rollout_store"] = store[1]
    return _json(body, 200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition of the gateway's OTel metrics (rendered off the event loop)."""
    body, content_type = await asyncio.to_thread(request.app[GATEWAY].telemetry.render_prometheus)
    return web.Response(body=body, headers={"Content-Type": content_type})
