"""Application wiring: ``create_app()``, the route table and the cleanup contexts.

Cleanup contexts run in order at startup and in reverse at shutdown: upstream sessions open
first; background tasks drain before the sessions close.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway import errors, handlers
from gateway.exchange import ExchangeSink
from gateway.settings import Settings
from gateway.sinks import MemorySink
from gateway.state import GATEWAY, Gateway, ReadyProbe
from gateway.upstream import UpstreamClient, UpstreamTarget


def create_app(settings: Settings, *, sink: ExchangeSink | None = None) -> web.Application:
    """The gateway as an aiohttp application (not yet started)."""
    if not settings.primary_url:
        raise ValueError("a primary upstream URL is required (--primary URL)")
    app = web.Application(
        middlewares=[errors.middleware],
        # Checked by handlers.read_body first (OpenAI-shaped 413); this is the hard backstop.
        client_max_size=settings.max_body_bytes,
        handler_args={"max_line_size": 65536, "max_field_size": 65536},
    )
    sink = sink if sink is not None else MemorySink(maxlen=1000)

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        assert settings.primary_url is not None
        primary = UpstreamClient(UpstreamTarget("primary", settings.primary_url), settings.upstream)
        gw = Gateway(
            settings=settings,
            primary=primary,
            sink=sink,
            ready=ReadyProbe(settings.primary_url, cache_s=settings.ready_cache_s),
        )
        app[GATEWAY] = gw
        try:
            yield
        finally:
            await gw.tasks.drain(settings.shutdown_timeout_s)
            await primary.close()

    app.cleanup_ctx.append(gateway_ctx)
    add_routes(app)
    return app


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    # GET /v1/models and every other /v1/* request: relayed untouched and untimed.
    app.router.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
