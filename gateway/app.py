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
from gateway.evidence import comparison_hook, metrics_handler, record_log_hook
from gateway.exchange import ExchangeSink
from gateway.records.sink import build_record_sink
from gateway.settings import Settings
from gateway.shadow import ShadowDispatcher
from gateway.sinks import FanoutSink, ThreadedSink
from gateway.state import GATEWAY, Gateway, ReadyProbe
from gateway.tasks import TaskSet
from gateway.upstream import UpstreamClient, UpstreamTarget
from otel.setup import TelemetrySettings, build_telemetry
from otel.telemetry import Telemetry
from policies.compile import policy_from_flags
from policies.compiled import CompiledPolicy
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
    settings: Settings,
    *,
    sink: ExchangeSink | None = None,
    policy: PolicyStore | None = None,
    telemetry: Telemetry | None = None,
) -> web.Application:
    """The gateway as an aiohttp application (not yet started).

    ``telemetry`` is built by the caller (``serve`` reads the ``OTEL_*`` variables); by default
    metrics are served at ``/metrics`` and nothing is exported. The app shuts it down on cleanup.
    Raises PolicyError (invalid policy) or ValueError (no primary) at once: startup fails fast.
    """
    store = policy if policy is not None else open_policy(settings)
    tel = telemetry if telemetry is not None else build_telemetry(TelemetrySettings.from_env({}))
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
    metrics_sink = ThreadedSink(
        "telemetry",
        metrics_handler(tel),
        # Visible as specshadow.telemetry.dropped{signal=metrics, reason=queue_full}.
        on_drop=lambda: tel.count_telemetry_dropped("metrics", "queue_full", 1),
    )
    records = (
        build_record_sink(
            settings.store_path,
            capture_default=store.current.capture,
            scrape_targets=scrape_targets(store.current),
            scrape_interval_s=settings.scrape_interval_s,
            hooks=[comparison_hook(tel)] + ([record_log_hook(tel)] if tel.exports_records else []),
        )
        if settings.store_path
        else None
    )
    sinks: list[ExchangeSink] = [metrics_sink]
    sinks += [s for s in (sink, records) if s is not None]
    tel.bind_policy_status(lambda: (store.generation, store.last_reload_ok))
    store.listeners.append(lambda ok: tel.count_policy_reload("ok" if ok else "error"))

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        tasks = TaskSet()
        primary = UpstreamClient(UpstreamTarget("primary", primary_url), settings.upstream)
        gw = Gateway(
            settings=settings,
            primary=primary,
            sink=FanoutSink(sinks),
            ready=ReadyProbe(primary_url, cache_s=settings.ready_cache_s),
            policy=store,
            shadows=ShadowDispatcher(tasks, settings.upstream, tel),
            telemetry=tel,
            tasks=tasks,
        )
        app[GATEWAY] = gw
        if records is not None:
            # Its own task set: the scraper runs until records.stop(), after the drain below
            # (in the gateway's set, the drain would wait out shutdown_timeout_s for it).
            await records.start()
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
            if records is not None:
                await records.stop()
            await asyncio.to_thread(metrics_sink.close, 2.0)
            # Bounded even with a black-holed collector (the exporters run on their own threads).
            await asyncio.to_thread(tel.shutdown, 5.0)

    app.cleanup_ctx.append(gateway_ctx)
    add_routes(app)
    return app


def scrape_targets(policy: CompiledPolicy) -> dict[str, str]:
    """Backend name → its ``/metrics`` URL, for backends that expose vLLM's counters."""
    return {name: b.metrics_url for name, b in policy.backends.items() if b.metrics_url}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/admin/policy", admin.policy_status)
    app.router.add_get("/admin/shadow", admin.shadow_status)
    # GET /v1/models and every other /v1/* request: relayed untouched and untimed.
    app.router.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
