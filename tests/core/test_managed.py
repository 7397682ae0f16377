"""core.exchange.managed: the one test of whether a sink has a lifecycle to start and stop."""

from __future__ import annotations

from core.exchange import Exchange, managed


class Plain:
    def submit(self, exchange: Exchange) -> None: ...


class WithLifecycle(Plain):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StartOnly(Plain):
    async def start(self) -> None: ...


class NotCallable(Plain):
    start = None
    stop = 1


def test_a_sink_is_managed_only_with_a_callable_start_and_stop() -> None:
    sink = WithLifecycle()
    assert managed(sink) is sink
    assert managed(Plain()) is None
    assert managed(StartOnly()) is None
    assert managed(NotCallable()) is None
