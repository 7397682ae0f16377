"""Exchange sinks: where finished exchanges go (comparison, records and telemetry plug in here).

``submit`` is called on the event loop once per exchange, after every leg ended; it must return
quickly and never raise. Heavy work (comparison, disk) belongs in the sink's own worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable

from gateway.exchange import Exchange, ExchangeSink

log = logging.getLogger(__name__)


class MemorySink:
    """Keeps the last ``maxlen`` exchanges in memory; tests and the demo read them."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self.exchanges: deque[Exchange] = deque(maxlen=maxlen)
        self._waiters: list[tuple[Callable[[Exchange], bool], asyncio.Future[Exchange]]] = []

    def submit(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)
        for entry in list(self._waiters):
            predicate, future = entry
            if not future.done() and predicate(exchange):
                future.set_result(exchange)
                self._waiters.remove(entry)

    async def wait_for(
        self, predicate: Callable[[Exchange], bool] = lambda _: True, *, timeout_s: float = 10.0
    ) -> Exchange:
        """The first exchange (already seen or future) that satisfies ``predicate``."""
        for exchange in self.exchanges:
            if predicate(exchange):
                return exchange
        future: asyncio.Future[Exchange] = asyncio.get_running_loop().create_future()
        entry = (predicate, future)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)


class FanoutSink:
    """Hands each exchange to several sinks; one failing sink never stops the others."""

    def __init__(self, sinks: Iterable[ExchangeSink]) -> None:
        self.sinks = tuple(sinks)

    def submit(self, exchange: Exchange) -> None:
        for sink in self.sinks:
            try:
                sink.submit(exchange)
            except Exception:  # a sink bug must not break the data path or its peers
                log.exception("exchange sink %r failed", sink)
