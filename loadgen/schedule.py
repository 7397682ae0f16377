"""Schedules: which trace row is sent when (pure; no clock, no I/O — the runner does the waiting).

Three modes:

- ``concurrency`` (closed loop): ``concurrency`` workers each send the next request as soon as
  their previous one finished. Slots carry no send time.
- ``rate`` (open loop): arrivals at ``rate_rps`` with gamma-distributed inter-arrival times of
  shape ``burstiness`` (1 = Poisson; < 1 burstier; > 1 more regular), mean ``1 / rate_rps``
  whatever the shape — the same model as ``vllm bench serve --burstiness``.
- ``trace`` (open loop): the trace's own ``timestamp`` differences, multiplied by ``time_scale``
  (0.5 = twice as fast).

Warm-up requests use the first ``warmup`` rows and are sent before the measured phase, closed-loop
at the run's concurrency; the measured phase starts at the row after them (so warm-ups do not
pre-fill the prefix cache for the measured requests). Limits: ``max_requests`` measured requests
and/or ``duration_s`` of scheduled time; with neither, one pass over the trace. Rows are reused
round-robin when more requests than rows are asked for (not in ``trace`` mode, whose timing is the
trace's own).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Mode",
    "ScheduleError",
    "ScheduleSpec",
    "Slot",
    "gamma_offsets",
    "measured_slots",
    "trace_offsets",
    "warmup_slots",
]

Mode = Literal["concurrency", "rate", "trace"]


class ScheduleError(ValueError):
    """A schedule that cannot run (names the option)."""


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """How a run paces its requests. ``concurrency`` caps requests in flight in every mode."""

    mode: Mode = "concurrency"
    concurrency: int = 1
    rate_rps: float | None = None
    burstiness: float = 1.0
    time_scale: float = 1.0
    warmup: int = 0
    max_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("concurrency", "rate", "trace"):
            raise ScheduleError(f"mode: expected concurrency, rate or trace, got {self.mode!r}")
        if self.concurrency < 1:
            raise ScheduleError(f"concurrency: expected >= 1, got {self.concurrency}")
        if self.mode == "rate" and (self.rate_rps is None or not self.rate_rps > 0):
            raise ScheduleError(f"rate: expected > 0 requests/s, got {self.rate_rps}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ScheduleError(f"burstiness: expected > 0, got {self.burstiness}")
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ScheduleError(f"time_scale: expected >= 0, got {self.time_scale}")
        if self.warmup < 0:
            raise ScheduleError(f"warmup: expected >= 0, got {self.warmup}")
        if self.max_requests is not None and self.max_requests < 0:
            raise ScheduleError(f"max_requests: expected >= 0, got {self.max_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ScheduleError(f"duration: expected > 0 s, got {self.duration_s}")

    @property
    def open_loop(self) -> bool:
        """Requests leave at scheduled times, whether or not earlier ones have finished."""
        return self.mode != "concurrency"


@dataclass(frozen=True, slots=True)
class Slot:
    """One request to send: which row, and (open loop) when, relative to the phase start."""

    index: int  # 0-based within its phase (warm-up or measured)
    record_index: int
    offset_s: float | None  # scheduled send offset; None in closed loop (send when a worker frees)
    warmup: bool = False


def gamma_offsets(rate_rps: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless arrival offsets: 0, then cumulative gamma(shape=b, scale=1/(rate·b)) gaps.

    ``rate_rps = inf`` sends everything at offset 0 (vLLM bench's convention).
    """
    rng = random.Random(seed)
    t = 0.0
    scale = 1.0 / (rate_rps * burstiness) if math.isfinite(rate_rps) else 0.0
    while True:
        yield t
        if scale:
            t += rng.gammavariate(burstiness, scale)


def trace_offsets(timestamps_s: Sequence[float | None], time_scale: float) -> list[float]:
    """Offsets from the first row's timestamp, scaled; raises if a row has none or goes back."""
    if not timestamps_s:
        return []
    if any(t is None for t in timestamps_s):
        missing = next(i for i, t in enumerate(timestamps_s) if t is None)
        raise ScheduleError(f"trace timing: row {missing} has no 'timestamp'")
    stamps = [float(t) for t in timestamps_s if t is not None]
    for i in range(1, len(stamps)):
        if stamps[i] < stamps[i - 1]:
            raise ScheduleError(f"trace timing: row {i} has an earlier timestamp than row {i - 1}")
    first = stamps[0]
    return [(t - first) * time_scale for t in stamps]


def warmup_slots(spec: ScheduleSpec, n_records: int) -> list[Slot]:
    """The warm-up requests (rows 0 … warmup−1, wrapping), sent closed-loop before measuring."""
    if n_records <= 0:
        return []
    return [Slot(i, i % n_records, None, warmup=True) for i in range(spec.warmup)]


def measured_slots(
    spec: ScheduleSpec, n_records: int, timestamps_s: Sequence[float | None] = ()
) -> Iterator[Slot]:
    """The measured requests, lazily (a duration-only closed-loop run is unbounded here: the
    runner stops taking slots when its clock passes ``duration_s``)."""
    if n_records <= 0 or spec.max_requests == 0:
        return
    start = spec.warmup % n_records
    limit = spec.max_requests
    if limit is None and spec.duration_s is None:
        limit = n_records  # one pass over the trace
    if spec.mode == "trace":
        rows = list(range(start, n_records)) if spec.warmup < n_records else []
        offsets = trace_offsets([timestamps_s[r] for r in rows], spec.time_scale)
        for i, (row, offset) in enumerate(zip(rows, offsets, strict=True)):
            if (limit is not None and i >= limit) or _past(offset, spec.duration_s):
                return
            yield Slot(i, row, offset)
        return
    arrivals: Iterator[float] | None = None
    if spec.mode == "rate":
        assert spec.rate_rps is not None  # checked in ScheduleSpec
        arrivals = gamma_offsets(spec.rate_rps, spec.burstiness, spec.seed)
    i = 0
    while limit is None or i < limit:
        at: float | None = None
        if arrivals is not None:
            at = next(arrivals)
            if _past(at, spec.duration_s):
                return
        yield Slot(i, (start + i) % n_records, at)
        i += 1


def _past(offset_s: float, duration_s: float | None) -> bool:
    return duration_s is not None and offset_s >= duration_s
