"""ThreadedSink: batched hand-off to a worker thread, bounded, never raising into the caller."""

from __future__ import annotations

import dataclasses
import threading

from core.exchange import Exchange, RequestId
from core.sinks import FanoutSink, ThreadedSink
from tests.otel.exchanges import make_exchange


def exchange_with(*, request_id: str) -> Exchange:
    return dataclasses.replace(make_exchange(), request_id=RequestId(request_id))


def test_every_submitted_exchange_is_handled_in_order_on_the_worker_thread() -> None:
    seen: list[tuple[str, str]] = []
    sink: ThreadedSink[Exchange] = ThreadedSink(
        "t", lambda e: seen.append((e.request_id, threading.current_thread().name))
    )
    try:
        for i in range(500):
            sink.submit(exchange_with(request_id=f"r{i}"))
        assert sink.join(5.0)
    finally:
        sink.close()
    assert [rid for rid, _ in seen] == [f"r{i}" for i in range(500)]
    assert {thread for _, thread in seen} == {"sink:t"}


def test_join_wakes_the_worker_instead_of_waiting_for_its_interval() -> None:
    seen: list[Exchange] = []
    sink = ThreadedSink("t", seen.append, interval_s=30.0)
    try:
        sink.submit(exchange_with(request_id="now"))
        assert sink.join(5.0)  # True: drained, where waiting for the 30 s interval is False
    finally:
        sink.close()
    assert [e.request_id for e in seen] == ["now"]


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    gate = threading.Event()
    handled: list[Exchange] = []

    def slow(exchange: Exchange) -> None:
        gate.wait(5.0)
        handled.append(exchange)

    drops: list[int] = []
    sink = ThreadedSink("t", slow, maxsize=3, interval_s=30.0, on_drop=lambda: drops.append(1))
    try:
        for i in range(10):
            sink.submit(exchange_with(request_id=f"r{i}"))
        assert sink.dropped == 7 and len(drops) == 7
        gate.set()
        assert sink.join(5.0)
    finally:
        sink.close()
    assert [e.request_id for e in handled] == ["r0", "r1", "r2"]


def test_a_failing_handler_is_counted_and_the_worker_keeps_going() -> None:
    handled: list[str] = []

    def flaky(exchange: Exchange) -> None:
        if exchange.request_id == "bad":
            raise ValueError("boom")
        handled.append(exchange.request_id)

    sink = ThreadedSink("t", flaky)
    try:
        for rid in ("a", "bad", "b"):
            sink.submit(exchange_with(request_id=rid))
        assert sink.join(5.0)
    finally:
        sink.close()
    assert handled == ["a", "b"]
    assert sink.failed == 1


def test_close_handles_what_was_queued_then_stops_the_worker() -> None:
    handled: list[Exchange] = []
    sink = ThreadedSink("t", handled.append, interval_s=30.0)
    for i in range(20):
        sink.submit(exchange_with(request_id=f"r{i}"))
    sink.close(5.0)
    assert len(handled) == 20
    assert not any(t.name == "sink:t" and t.is_alive() for t in threading.enumerate())


def test_fanout_isolates_a_failing_sink_from_its_peers() -> None:
    class Broken:
        def submit(self, exchange: Exchange) -> None:
            raise RuntimeError("sink bug")

    got: list[Exchange] = []

    class Keeper:
        def submit(self, exchange: Exchange) -> None:
            got.append(exchange)

    FanoutSink([Broken(), Keeper()]).submit(exchange_with(request_id="x"))
    assert [e.request_id for e in got] == ["x"]
