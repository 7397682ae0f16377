"""The gateway's own view of each backend's load: legs in flight and dispatches per second.

A shadow sees only the mirrored share of traffic, so every leg carries the load its backend ran
at when the leg was dispatched (:class:`~core.exchange.LegLoad`). This is the part the gateway
measures itself, for any backend (with or without ``/metrics``): the legs it has in flight to the
backend, this one included, and its dispatch rate over the last ``window_s`` seconds. A shadow
leg's dispatch is stamped with the instant its exchange mirrored it (microseconds before the
primary's), not when its task ran — on a starved event loop that can be hundreds of ms later — so
the ratio of an exchange's rates (its load parity, per replica) is a ratio of counts over one
window at one instant and needs no clock agreement with any backend.

``dispatch`` and ``done`` run on the event loop for every leg: a deque append, an amortised pop
of expired timestamps, three array appends (the mark below; half the marks are dropped at once
when they reach the bound, amortised) and a few arithmetic operations.

**The batch a leg decoded in.** The in-flight count at dispatch is not the batch a leg decodes in:
legs dispatched after it join, legs before it leave. So the book also integrates its in-flight
count over time, ``A(t) = ∫ in_flight dt``, and keeps a mark ``(t, A(t), in_flight)`` at every
change (two per leg). A leg's time-averaged in-flight count over its decode interval — first
output event to last, the interval its TPOT is measured over — is ``(A(last) − A(first)) /
(last − first)`` (:meth:`BackendLoad.mean_in_flight`: two bisections), read once when the leg
finishes, after its last byte was relayed. The marks are bounded (:data:`MAX_MARKS` per backend, the last ~65,000 legs): a leg whose
decode began before the oldest mark gets ``None``. It counts this gateway's legs only, like
``in_flight``.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_right
from collections import deque

from core.exchange import LegLoad

MAX_MARKS = 1 << 17  # per backend: ~3 MB of marks, the last ~65,000 legs' dispatches and ends


class BackendLoad:
    """One backend's in-flight count, recent dispatch times and in-flight integral."""

    __slots__ = (
        "_area",
        "_first_ns",
        "_last_ns",
        "_mark_area",
        "_mark_count",
        "_mark_ns",
        "_times",
        "in_flight",
        "max_marks",
        "window_ns",
    )

    def __init__(self, window_s: float, max_marks: int = MAX_MARKS) -> None:
        self.window_ns = int(window_s * 1e9)
        self.in_flight = 0
        self.max_marks = max(2, max_marks)
        self._times: deque[int] = deque()
        self._first_ns: int | None = None
        # The integral A(t) of in_flight over time (count × ns), and its marks: at each change,
        # the time, A there and the count from then on (parallel arrays, searched by bisection).
        self._area = 0.0
        self._last_ns = 0
        self._mark_ns = array("q")
        self._mark_area = array("d")
        self._mark_count = array("q")

    def _change(self, now: int, delta: int) -> None:
        last = self._last_ns
        if now < last:  # marks stay in time order whatever a caller passes
            now = last
        area = self._area + self.in_flight * (now - last)  # 0 before the first change
        count = self.in_flight + delta
        self._area, self._last_ns, self.in_flight = area, now, count
        marks = self._mark_ns
        if len(marks) >= self.max_marks:
            drop = self.max_marks // 2
            del marks[:drop], self._mark_area[:drop], self._mark_count[:drop]
        marks.append(now)
        self._mark_area.append(area)
        self._mark_count.append(count)

    def dispatch(self, replicas: int, now_ns: int | None = None) -> LegLoad:
        """A leg leaves for this backend now (``now_ns``: at that ``perf_counter_ns`` instant, its
        exchange's, a moment ago): count it and return the load it meets."""
        now = time.perf_counter_ns() if now_ns is None else now_ns
        times = self._times
        if times and now < times[-1]:  # the window's times stay in order (they expire in order)
            now = times[-1]
        if self._first_ns is None:
            self._first_ns = now
        horizon = now - self.window_ns
        while times and times[0] < horizon:
            times.popleft()
        times.append(now)
        self._change(now, +1)
        # Until a whole window has passed, the rate is over the time since the first dispatch.
        span_s = max(1.0, min(self.window_ns, now - self._first_ns) / 1e9)
        return LegLoad(
            in_flight=self.in_flight,
            rate_rps=len(times) / span_s,
            window_s=self.window_ns / 1e9,
            replicas=replicas,
        )

    def done(self, now_ns: int | None = None) -> None:
        self._change(time.perf_counter_ns() if now_ns is None else now_ns, -1)

    def _integral(self, t_ns: int) -> float | None:
        """A(t); None before the oldest mark."""
        marks = self._mark_ns
        i = bisect_right(marks, t_ns) - 1
        if i < 0:
            return None
        return self._mark_area[i] + self._mark_count[i] * (t_ns - marks[i])

    def mean_in_flight(self, start_ns: int, end_ns: int) -> float | None:
        """The in-flight count averaged over ``[start_ns, end_ns]`` (``perf_counter_ns``); None
        for an empty interval or one that begins before the oldest mark."""
        if end_ns <= start_ns:
            return None
        a, b = self._integral(start_ns), self._integral(end_ns)
        if a is None or b is None:
            return None
        return (b - a) / (end_ns - start_ns)


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
