"""Process settings: fixed for the life of the process, from the environment and the CLI.

Policy (what is mirrored where) is separate, file-based and hot-reloaded (``policies``).
Every field can be set by an environment variable ``SPECSHADOW_<FIELD>`` (upper case); CLI flags
override the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    """How the gateway talks to one upstream (the primary, or a shadow pool)."""

    max_connections: int = 1000  # pooled connections (aiohttp TCPConnector limit)
    connect_timeout_s: float = 10.0  # TCP connect (and TLS) — not a total timeout
    idle_timeout_s: float = 600.0  # max silence between two reads; long streams are fine
    retry_attempts: int = 3  # connect failures only, before anything reached the client
    retry_initial_s: float = 0.05
    retry_max_s: float = 1.0
    retry_deadline_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    primary_url: str | None = None
    policy_path: str | None = None
    policy_poll_s: float = 1.0  # how often the policy file's fingerprint is checked
    reload_on_sighup: bool = False  # `serve` turns this on (signal handlers need the main thread)
    shadow_urls: tuple[str, ...] = ()  # policy-free start: candidate legs (--shadow)
    baseline_url: str | None = None  # policy-free start: a baseline leg (--baseline)
    shadow_ratio: float = 1.0  # policy-free start: share of requests mirrored (--shadow-ratio)
    max_body_bytes: int = 32 * MIB  # long RAG prompts fit; larger → 413
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    shutdown_timeout_s: float = 30.0  # in-flight streams and shadow legs get this long to finish
    ready_cache_s: float = 1.0  # /readyz probes the primary at most this often
    admin_token: str | None = None  # bearer token for /admin/* from non-loopback peers
    # Worker threads (metric recording, comparisons, span export) take the GIL in turns with the
    # event loop every switch interval. None keeps CPython's 5 ms: an A/B on the 2-core machine
    # (docs/benchmarks.md) found 0.5 ms no better for latency and 3-12 % costlier in CPU.
    gil_switch_interval_s: float | None = None
    store_path: str | None = None  # comparison records (embedded SQLite store); None: not kept
    scrape_interval_s: float = 15.0  # how often vLLM backends' /metrics are scraped (with --store)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> Settings:
        """Build from ``SPECSHADOW_*`` variables, then apply non-``None`` ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"SPECSHADOW_{f.name.upper()}")
            if raw is None or f.name == "upstream":
                continue
            values[f.name] = _coerce(f.type, raw)
        up: dict[str, Any] = {}
        for f in fields(UpstreamSettings):
            raw = environ.get(f"SPECSHADOW_UPSTREAM_{f.name.upper()}")
            if raw is not None:
                up[f.name] = _coerce(f.type, raw)
        settings = cls(**values, upstream=UpstreamSettings(**up))
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def _coerce(annotation: Any, raw: str) -> Any:
    text = str(annotation)
    if "int" in text and "str" not in text:
        return int(raw)
    if "float" in text:
        return float(raw)
    return raw
