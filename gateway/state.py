"""The gateway's runtime state, stored once in the app under :data:`GATEWAY`.

aiohttp freezes ``app[...]`` after startup, so everything that changes while serving (in-flight
counts, the readiness cache, later the policy) lives inside this holder object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web
from yarl import URL

from core.exchange import Exchange, ExchangeSink
from core.tasks import TaskSet
from gateway.load import LoadBook
from gateway.settings import Settings
from gateway.shadow import ShadowDispatcher
from gateway.upstream import UpstreamClient
from otel.telemetry import Telemetry
from policies.store import PolicyStore
from rollout.controller import RolloutController

log = logging.getLogger(__name__)


class ReadyProbe:
    """Is the primary reachable? A TCP connect, cached for ``cache_s`` seconds."""

    def __init__(self, base_url: str, *, cache_s: float, timeout_s: float = 1.0) -> None:
        url = URL(base_url)
        self.host = url.host or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._checked_ns = 0
        self._last: tuple[bool, str] = (False, "not checked")

    async def check(self) -> tuple[bool, str]:
        now = time.perf_counter_ns()
        if self._checked_ns and now - self._checked_ns < self.cache_s * 1e9:
            return self._last
        try:
            _reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.timeout_s
            )
            writer.close()
            self._last = (True, f"{self.host}:{self.port} reachable")
        except (TimeoutError, OSError) as exc:
            self._last = (False, f"{self.host}:{self.port} unreachable: {type(exc).__name__}")
        self._checked_ns = time.perf_counter_ns()
        return self._last


@dataclass(slots=True)
class Gateway:
    settings: Settings
    primary: UpstreamClient
    sink: ExchangeSink
    ready: ReadyProbe
    policy: PolicyStore
    shadows: ShadowDispatcher
    telemetry: Telemetry
    tasks: TaskSet = field(default_factory=TaskSet)
    in_flight: int = 0  # primary requests in flight
    loads: LoadBook = field(
        default_factory=LoadBook
    )  # every backend's load as this gateway sees it
    rollout: RolloutController | None = None  # which backend answers, per rolling-out rule

    def submit(self, exchange: Exchange) -> None:
        """Hand a finished exchange to the sink; a sink failure is logged, never raised."""
        try:
            self.sink.submit(exchange)
        except Exception:  # recording must never break the data path
            log.exception("exchange sink failed")


GATEWAY = web.AppKey("gateway", Gateway)
