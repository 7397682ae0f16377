"""What every off-path tap in front of the evidence worker shares: its downstream sink, its
tracked tasks and its HTTP session, started and stopped with the downstream (the token tap,
:mod:`evidence.tokens`; the token-count tap, :mod:`evidence.counts`)."""

from __future__ import annotations

import aiohttp

from core.exchange import ExchangeSink, managed
from core.tasks import TaskSet
from core.wire import BACKEND_KEEPALIVE_S


class Tap:
    """A sink in front of ``downstream`` that calls backends off the request path."""

    def __init__(
        self,
        downstream: ExchangeSink,
        *,
        keepalive_s: float = BACKEND_KEEPALIVE_S,
        drain_s: float = 10.0,
    ) -> None:
        """``keepalive_s``: how long an idle connection to a backend is kept (the gateway's
        ``upstream.keepalive_s``; below the backends' own keep-alive, as there). ``drain_s``:
        how long :meth:`stop` waits for calls in flight (the gateway's ``shutdown_timeout_s``)."""
        self._downstream = downstream
        self._keepalive_s = keepalive_s
        self._drain_s = drain_s
        self._tasks = TaskSet()
        self._session: aiohttp.ClientSession | None = None

    @property
    def downstream(self) -> ExchangeSink:
        return self._downstream

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=self._keepalive_s)
        )
        downstream = managed(self._downstream)
        if downstream is not None:
            await downstream.start()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Finish what is in flight (within ``timeout_s``, else ``drain_s``), then stop the
        downstream sink."""
        await self._tasks.drain(self._drain_s if timeout_s is None else timeout_s)
        if self._session is not None:
            await self._session.close()
            self._session = None
        downstream = managed(self._downstream)
        if downstream is not None:
            await downstream.stop()
