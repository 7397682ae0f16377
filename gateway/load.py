"""The gateway's own view of each backend's load: legs in flight and dispatches per second.

A shadow sees only the mirrored share of traffic, so every leg carries the load its backend ran
at when the leg was dispatched (:class:`~core.exchange.LegLoad`). This is the part the gateway
measures itself, for any backend (with or without ``/metrics``): the legs it has in flight to the
backend, this one included, and its dispatch rate over the last ``window_s`` seconds. Both legs
of an exchange are dispatched within microseconds of each other, so the ratio of their rates — the
exchange's load parity, per replica — is a ratio of counts over one window and needs no clock
agreement with any backend.

``dispatch`` runs on the event loop for every leg: a deque append, an amortised pop of expired
timestamps and a few integer operations.
"""

from __future__ import annotations

import time
from collections import deque

from core.exchange import LegLoad


class BackendLoad:
    """One backend's in-flight count and recent dispatch times."""

    __slots__ = ("_first_ns", "_times", "in_flight", "window_ns")

    def __init__(self, window_s: float) -> None:
        self.window_ns = int(window_s * 1e9)
        self.in_flight = 0
        self._times: deque[int] = deque()
        self._first_ns: int | None = None

    def dispatch(self, replicas: int, now_ns: int | None = None) -> LegLoad:
        """A leg leaves for this backend now: count it and return the load it meets."""
        now = time.perf_counter_ns() if now_ns is None else now_ns
        if self._first_ns is None:
            self._first_ns = now
        times = self._times
        horizon = now - self.window_ns
        while times and times[0] < horizon:
            times.popleft()
        times.append(now)
        self.in_flight += 1
        # Until a whole window has passed, the rate is over the time since the first dispatch.
        span_s = max(1.0, min(self.window_ns, now - self._first_ns) / 1e9)
        return LegLoad(
            in_flight=self.in_flight,
            rate_rps=len(times) / span_s,
            window_s=self.window_ns / 1e9,
            replicas=replicas,
        )

    def done(self) -> None:
        self.in_flight -= 1


class LoadBook:
    """Every backend's :class:`BackendLoad`, by backend name (created on first dispatch)."""

    __slots__ = ("_loads", "window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._loads: dict[str, BackendLoad] = {}

    def __getitem__(self, name: str) -> BackendLoad:
        load = self._loads.get(name)
        if load is None:
            load = self._loads[name] = BackendLoad(self.window_s)
        return load

    def in_flight(self) -> dict[str, int]:
        return {name: load.in_flight for name, load in self._loads.items()}
