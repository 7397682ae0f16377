"""Exchange sinks: where finished exchanges go (comparison, records and telemetry plug in here).

``submit`` is called on the event loop once per exchange, after every leg ended; it must return
quickly and never raise. Heavy work (comparison, disk) belongs in the sink's own worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
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


class ThreadedSink:
    """Runs ``handle(exchange)`` on one worker thread, fed by a bounded queue.

    For CPU-bound consumers (metric recording walks every chunk gap): the event loop only
    enqueues. A full queue drops the exchange and counts it in :attr:`dropped` — telemetry is
    bounded in memory and never back-pressures the data path.
    """

    def __init__(
        self, name: str, handle: Callable[[Exchange], None], *, maxsize: int = 10_000
    ) -> None:
        self.name = name
        self.handle = handle
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=self._run, name=f"sink:{name}", daemon=True)
        self._thread.start()

    def submit(self, exchange: Exchange) -> None:
        try:
            self._queue.put_nowait(exchange)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while (exchange := self._queue.get()) is not None:
            try:
                self.handle(exchange)
            except Exception:  # the worker must outlive a bad exchange
                self.failed += 1
                log.exception("sink %s failed on an exchange", self.name)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far was handled."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish what is queued (bounded), then stop the worker."""
        self.join(timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=max(0.0, timeout_s))
