"""Application wiring: ``create_app()``, the route table and the cleanup context.

Startup order: policy (fails fast on an invalid file), primary pool, shadow dispatcher, policy
watcher. Shutdown runs in reverse: the watcher stops, background tasks (shadow legs, exchange
assembly) drain within ``shutdown_timeout_s``, then the pools close.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from gateway import admin, errors, handlers
from gateway.exchange import ExchangeSink
from gateway.settings import Settings
from gateway.shadow import ShadowDispatcher
from gateway.sinks import MemorySink
from gateway.state import GATEWAY, Gateway, ReadyProbe
from gateway.tasks import TaskSet
from gateway.upstream import UpstreamClient, UpstreamTarget
from policies.compile import policy_from_flags
from policies.store import PolicyStore
from policies.watch import watch_policy_file


def open_policy(settings: Settings) -> PolicyStore:
    """The policy store from ``--policy FILE`` or from the quick flags (PolicyError if invalid)."""
    if settings.policy_path:
        return PolicyStore.open(settings.policy_path, primary_url=settings.primary_url)
    policy = policy_from_flags(
        primary_url=settings.primary_url,
        shadow_urls=settings.shadow_urls,
        baseline_url=settings.baseline_url,
        ratio=settings.shadow_ratio,
    )
    return PolicyStore(policy, primary_url=settings.primary_url)


def create_app(
    settings: Settings, *, sink: ExchangeSink | None = None, policy: PolicyStore | None = None
) -> web.Application:
    """The gateway as an aiohttp application (not yet started).

    Raises PolicyError (invalid policy) or ValueError (no primary) at once: startup fails fast.
    """
    store = policy if policy is not None else open_policy(settings)
    primary_url = settings.primary_url or (
        store.current.primary.url if store.current.primary is not None else None
    )
    if not primary_url:
        raise ValueError(
            "a primary upstream is required: --primary URL or `primary:` in the policy"
        )
    app = web.Application(
        middlewares=[errors.middleware],
        # Checked by handlers.read_body first (OpenAI-shaped 413); this is the hard backstop.
        client_max_size=settings.max_body_bytes,
        handler_args={"max_line_size": 65536, "max_field_size": 65536},
    )
    sink = sink if sink is not None else MemorySink(maxlen=1000)

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        tasks = TaskSet()
        primary = UpstreamClient(UpstreamTarget("primary", primary_url), settings.upstream)
        gw = Gateway(
            settings=settings,
            primary=primary,
            sink=sink,
            ready=ReadyProbe(primary_url, cache_s=settings.ready_cache_s),
            policy=store,
            shadows=ShadowDispatcher(tasks, settings.upstream),
            tasks=tasks,
        )
        app[GATEWAY] = gw
        watcher = None
        if settings.policy_path:
            watcher = tasks.spawn(
                watch_policy_file(
                    settings.policy_path,
                    store,
                    interval_s=settings.policy_poll_s,
                    sighup=settings.reload_on_sighup,
                ),
                name="policy-watcher",
            )
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await tasks.drain(settings.shutdown_timeout_s)
            await gw.shadows.close()
            await primary.close()

    app.cleanup_ctx.append(gateway_ctx)
    add_routes(app)
    return app


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/admin/policy", admin.policy_status)
    app.router.add_get("/admin/shadow", admin.shadow_status)
    # GET /v1/models and every other /v1/* request: relayed untouched and untimed.
    app.router.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
