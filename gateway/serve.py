"""Running the gateway process: uvloop, aiohttp's ``run_app``, handler cancellation, the GIL
switch interval — the one way an application is served, by ``specshadow serve`` and by benchmarks
that must measure the process a user runs."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from aiohttp import web

from gateway.settings import Settings


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve_app(
    app: web.Application, settings: Settings, *, print_: Callable[[str], None] | None = None
) -> None:
    """Run ``app`` the way ``specshadow serve`` does: the process's GIL switch interval, uvloop,
    handler cancellation, no access log. Benchmarks that wrap the gateway use this too, so they
    measure the process a user runs."""
    if settings.gil_switch_interval_s is not None:
        sys.setswitchinterval(settings.gil_switch_interval_s)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        loop=new_event_loop(),
        shutdown_timeout=settings.shutdown_timeout_s,
        # Cancel the handler the moment the client disconnects: the upstream request is closed
        # at once even while the upstream is silent (no write would notice otherwise).
        handler_cancellation=True,
        access_log=None,
        print=print_,
    )
