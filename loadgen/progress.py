"""A small progress line on stderr (hand-written: no dependency, ~40 lines).

Redraws at most every ``min_interval_s`` with ``\\r`` on a terminal; when stderr is not a terminal
(CI logs) it prints a plain line every 10 % instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from loadgen.client import RequestResult

__all__ = ["Progress"]


class Progress:
    """Counts finished requests; call it with each :class:`RequestResult`, then :meth:`close`."""

    def __init__(
        self, total: int | None, *, stream: TextIO | None = None, min_interval_s: float = 0.1
    ) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._interval_ns = int(min_interval_s * 1e9)
        self._start_ns = time.perf_counter_ns()
        self._last_ns = 0
        self._last_decile = 0

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += result.error is not None
        now = time.perf_counter_ns()
        if self._tty:
            if now - self._last_ns >= self._interval_ns or self.done == self.total:
                self._last_ns = now
                self._stream.write("\r" + self.line(now))
                self._stream.flush()
        elif self.total:
            decile = self.done * 10 // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self._stream.write(self.line(now) + "\n")

    def line(self, now_ns: int | None = None) -> str:
        elapsed_s = ((now_ns or time.perf_counter_ns()) - self._start_ns) / 1e9
        rate = self.done / elapsed_s if elapsed_s > 0 else 0.0
        if self.total:
            width = 30
            filled = min(width, self.done * width // self.total)
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        return f"{bar}  failed {self.failed}  {rate:.1f} req/s  {elapsed_s:.1f} s"

    def close(self) -> None:
        if self._tty and self.done:
            self._stream.write("\n")
        self._stream.flush()
