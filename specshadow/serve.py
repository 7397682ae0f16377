"""``specshadow serve``: the command line of the gateway process.

Flags and ``SPECSHADOW_*`` variables become :class:`~gateway.settings.Settings`, the ``OTEL_*``
variables telemetry settings, and :func:`specshadow.app.build_app` the application — all inside
one fail-fast path: any bad value ends the command with exit status 2 and one line that names
what was wrong, before anything listens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from gateway.serve import serve_app
from gateway.settings import Settings, SettingsError, default_state_path
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from policies.errors import PolicyError
from specshadow.app import build_app

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
    p.add_argument(
        "--state",
        default=None,
        metavar="PATH",
        help="rollout state (stages, sticky rollbacks); default "
        "$XDG_STATE_HOME/specshadow/rollout.json",
    )
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger bodies get 413")
    p.add_argument("--connect-timeout", type=float, default=None, help="seconds (default 10)")
    p.add_argument(
        "--idle-timeout", type=float, default=None, help="max seconds between reads (default 600)"
    )
    p.add_argument("--max-connections", type=int, default=None, help="pool size per upstream")
    p.set_defaults(func=run)


# Settings field (or upstream_<field>) → the flag that sets it, for error messages.
FLAGS: dict[str, str] = {
    "host": "--host",
    "port": "--port",
    "primary_url": "--primary",
    "policy_path": "--policy",
    "shadow_urls": "--shadow",
    "baseline_url": "--baseline",
    "shadow_ratio": "--shadow-ratio",
    "store_path": "--store",
    "state_path": "--state",
    "scrape_interval_s": "--scrape-interval",
    "max_body_bytes": "--max-body-bytes",
    "upstream_connect_timeout_s": "--connect-timeout",
    "upstream_idle_timeout_s": "--idle-timeout",
    "upstream_max_connections": "--max-connections",
}


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> Settings:
    """Flags over ``SPECSHADOW_*`` variables; raises SettingsError naming the flag or variable."""
    return Settings.from_env(
        environ,
        flags=FLAGS,
        host=args.host,
        port=args.port,
        primary_url=args.primary,
        policy_path=args.policy,
        shadow_urls=tuple(args.shadow) or None,
        baseline_url=args.baseline,
        shadow_ratio=args.shadow_ratio,
        store_path=args.store,
        state_path=args.state
        or environ.get("SPECSHADOW_STATE_PATH")
        or default_state_path(environ),
        scrape_interval_s=args.scrape_interval,
        max_body_bytes=args.max_body_bytes,
        upstream_connect_timeout_s=args.connect_timeout,
        upstream_idle_timeout_s=args.idle_timeout,
        upstream_max_connections=args.max_connections,
        reload_on_sighup=True,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        telemetry = build_telemetry(TelemetrySettings.from_env())
        app = build_app(settings, telemetry=telemetry)
    except SettingsError as exc:
        for problem in exc.problems:
            print(f"specshadow serve: {problem}", file=sys.stderr)
        return 2
    except (PolicyError, OSError, ValueError) as exc:
        # Startup fails fast, with the same message a reload would log.
        print(f"specshadow serve: {exc}", file=sys.stderr)
        return 2
    serve_app(app, settings, print_=lambda msg: log.info("%s", msg))
    return 0
