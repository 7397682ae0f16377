"""Application wiring: ``create_app()``, the route table and the cleanup context.

Startup order: policy (fails fast on an invalid file), the sinks that have a lifecycle, the
primary pool, the shadow dispatcher, the policy watcher. Shutdown runs in reverse, each resource
closed by its own step (one failing close never skips the rest): the watcher stops, background
tasks (shadow legs, exchange assembly) drain within ``shutdown_timeout_s``, the pools close, the
sinks stop (after the last exchange reached them), telemetry shuts down (bounded).

The gateway hands finished exchanges to its ``sinks`` and knows nothing of what they do with them:
the evidence pipeline, records and metrics are composed on top (``specshadow.app``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import cast

from aiohttp import web

from core.exchange import ExchangeSink, managed
from core.sinks import FanoutSink
from core.tasks import TaskSet
from gateway import admin, errors, handlers
from gateway.load import LoadBook
from gateway.settings import Settings
from gateway.shadow import ShadowDispatcher
from gateway.state import GATEWAY, Gateway, ReadyProbe
from gateway.upstream import CLOSING_KINDS, UpstreamClient, UpstreamTarget
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from otel.telemetry import Telemetry
from policies.compile import policy_from_flags
from policies.compiled import BackendKind
from policies.store import PolicyStore
from policies.watch import watch_policy_file
from rollout.controller import RolloutController


def open_policy(settings: Settings) -> PolicyStore:
    """The policy store from ``--policy FILE`` or from the quick flags (PolicyError if invalid)."""
    if settings.policy_path:
        return PolicyStore.open(settings.policy_path, primary_url=settings.primary_url)
    # Stated kinds only: ``specshadow serve`` also detects the rest before it gets here.
    kinds = settings.shadow_kinds
    per_shadow = [kinds[0]] * len(settings.shadow_urls) if len(kinds) == 1 else list(kinds)
    policy = policy_from_flags(
        primary_url=settings.primary_url,
        shadow_urls=settings.shadow_urls,
        baseline_url=settings.baseline_url,
        ratio=settings.shadow_ratio,
        primary_kind=_kind(settings.primary_kind),
        shadow_kinds=[k for k in map(_kind, per_shadow) if k is not None],
        baseline_kind=_kind(settings.baseline_kind),
    )
    return PolicyStore(policy, primary_url=settings.primary_url)


def _kind(value: str | None) -> BackendKind | None:
    return cast(BackendKind, value) if value is not None else None  # Settings validated it


def create_app(
    settings: Settings,
    *,
    sinks: Sequence[ExchangeSink] = (),
    policy: PolicyStore | None = None,
    telemetry: Telemetry | None = None,
    rollout: RolloutController | None = None,
) -> web.Application:
    """The gateway as an aiohttp application (not yet started).

    ``sinks`` receive every finished exchange; those with ``start()``/``stop()`` are started
    before the first request and stopped after the last. ``telemetry`` is built by the caller
    (``serve`` reads the ``OTEL_*`` variables); by default metrics are served at ``/metrics`` and
    nothing is exported. The app shuts it down on cleanup. Raises PolicyError (invalid policy) or
    ValueError (no primary) at once: startup fails fast.
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
    if rollout is None or not rollout.guarded:
        rolling = [r.name for r in store.current.all_rules
                   if r.rollout is not None and r.rollout.stage != "shadow"]  # fmt: skip
        if rolling:
            raise ValueError(
                f"rules {', '.join(rolling)} start in canary or live, but nothing would feed their "
                "guards: build the gateway with its evidence pipeline (specshadow.app.build_app)"
            )
    app = web.Application(
        middlewares=[errors.middleware],
        # Checked by proxy.read_body first (OpenAI-shaped 413); this is the hard backstop.
        client_max_size=settings.max_body_bytes,
        handler_args={"max_line_size": 65536, "max_field_size": 65536},
    )
    tel.bind_policy_status(lambda: (store.generation, store.last_reload_ok))
    store.listeners.append(lambda ok: tel.count_policy_reload("ok" if ok else "error"))
    lifecycles = [m for m in map(managed, sinks) if m is not None]

    async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            # Pushed first, run last: telemetry outlives everything that reports into it.
            # Bounded even with a black-holed collector (the exporters run on their own threads).
            stack.push_async_callback(asyncio.to_thread, tel.shutdown, 5.0)
            # Without a controller from the caller nothing feeds the guards (the evidence worker
            # is the product's, specshadow.app.build_app): candidates then answer nothing.
            controller = rollout or RolloutController(
                settings.state_path, telemetry=tel, guarded=False
            )
            # A shared store: stop following it once the sinks stopped (the last observations
            # are published).
            stack.push_async_callback(asyncio.to_thread, controller.close)
            for sink in lifecycles:
                await sink.start()
                stack.push_async_callback(sink.stop)
            tasks = TaskSet()
            # Named as the policy names it, so its scraped /metrics and its legs share one name.
            name = store.current.primary.name if store.current.primary is not None else "primary"
            closing = (
                store.current.primary is not None and store.current.primary.kind in CLOSING_KINDS
            )
            primary = UpstreamClient(
                UpstreamTarget(name, primary_url), settings.upstream, closes_connections=closing
            )
            stack.push_async_callback(primary.close)
            loads = LoadBook(settings.load_window_s)
            shadows = ShadowDispatcher(tasks, settings.upstream, tel, loads)
            stack.push_async_callback(shadows.close)
            # Shadow legs and exchange assembly finish (or are cancelled) before the pools close
            # and before the sinks stop, so every exchange reaches them.
            stack.push_async_callback(tasks.drain, settings.shutdown_timeout_s)
            controller.reconcile(store.current)
            # A reload takes effect on the rollouts at once, not at the next request.
            store.listeners.append(lambda ok: controller.reconcile(store.current) if ok else None)
            app[GATEWAY] = Gateway(
                settings=settings,
                primary=primary,
                sink=FanoutSink(sinks),
                ready=ReadyProbe(primary_url, cache_s=settings.ready_cache_s),
                policy=store,
                shadows=shadows,
                telemetry=tel,
                tasks=tasks,
                loads=loads,
                rollout=controller,
            )
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
                stack.push_async_callback(_cancel, watcher)
            yield

    app.cleanup_ctx.append(gateway_ctx)
    add_routes(app)
    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handlers.completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/responses", handlers.completions)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/readyz", handlers.readyz)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/admin/policy", admin.policy_status)
    app.router.add_get("/admin/shadow", admin.shadow_status)
    app.router.add_get("/admin/rollout", admin.rollout_status)
    app.router.add_post("/admin/rollout/{rule}/promote", admin.rollout_promote)
    app.router.add_post("/admin/rollout/{rule}/rollback", admin.rollout_rollback)
    # GET /v1/models and every other /v1/* request: relayed untouched and untimed.
    app.router.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
