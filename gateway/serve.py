"""``specshadow serve``: run the gateway in front of a primary upstream (uvloop, aiohttp)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.app import create_app
from gateway.settings import Settings, UpstreamSettings
from otel.setup import TelemetrySettings, build_telemetry
from policies.errors import PolicyError

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the gateway in front of the primary upstream"
    )
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to bind (default 8080)")
    p.add_argument(
        "--primary",
        default=None,
        help="the primary upstream's base URL, e.g. http://127.0.0.1:8000",
    )
    p.add_argument(
        "--policy", default=None, help="policy file (YAML); hot-reloaded on change/SIGHUP"
    )
    p.add_argument(
        "--shadow",
        action="append",
        default=[],
        metavar="URL",
        help="policy-free start: mirror to this candidate (repeatable)",
    )
    p.add_argument(
        "--baseline", default=None, metavar="URL", help="policy-free start: a baseline leg"
    )
    p.add_argument(
        "--shadow-ratio", type=float, default=None, help="policy-free start: share mirrored (0..1)"
    )
    p.add_argument(
        "--store", default=None, metavar="PATH", help="write comparison records to this SQLite file"
    )
    p.add_argument(
        "--scrape-interval", type=float, default=None, help="seconds between vLLM /metrics scrapes"
    )
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger bodies get 413")
    p.add_argument("--connect-timeout", type=float, default=None, help="seconds (default 10)")
    p.add_argument(
        "--idle-timeout", type=float, default=None, help="max seconds between reads (default 600)"
    )
    p.add_argument("--max-connections", type=int, default=None, help="pool size per upstream")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = Settings.from_env()
    up = base.upstream
    up_overrides = {
        "connect_timeout_s": args.connect_timeout,
        "idle_timeout_s": args.idle_timeout,
        "max_connections": args.max_connections,
    }
    upstream = UpstreamSettings(
        **{
            **{f: getattr(up, f) for f in up.__dataclass_fields__},
            **{k: v for k, v in up_overrides.items() if v is not None},
        }
    )
    return Settings.from_env(
        host=args.host,
        port=args.port,
        primary_url=args.primary,
        max_body_bytes=args.max_body_bytes,
        upstream=upstream,
        policy_path=args.policy,
        shadow_urls=tuple(args.shadow) or None,
        baseline_url=args.baseline,
        shadow_ratio=args.shadow_ratio,
        reload_on_sighup=True,
        store_path=args.store,
        scrape_interval_s=args.scrape_interval,
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        telemetry = build_telemetry(TelemetrySettings.from_env())
        app = create_app(settings, telemetry=telemetry)
    except (PolicyError, OSError, ValueError) as exc:
        # Startup fails fast, with the same message a reload would log.
        print(f"specshadow serve: {exc}", file=sys.stderr)
        return 2
    serve_app(app, settings, print_=lambda msg: log.info("%s", msg))
    return 0


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
