"""Per-request metrics from the client's raw reads, per-arm summaries, and millisecond distributions.

Pure functions, run after the load. The timings are the product's own: every read of a request is
fed, with its ``recv_ns``, to a :class:`core.recorder.StreamRecorder` whose ``t0`` is the client's
``t_send``, so ttft, e2e, chunk gaps, output events, ``[DONE]`` and the text have exactly the
definitions of :mod:`core.timings` (the gateway and ``loadgen`` use the same recorder).

What the recorder does not know is the upstream's side: the simulator writes one
``: sent_ns=<perf_counter_ns>`` comment immediately before the ``data:`` line of every event,
``[DONE]`` included. The same reads go through an :class:`core.sse.SSEDecoder` that keeps comment
lines, and the i-th stamp belongs to the i-th event. That gives each event its delivery latency
(``recv_ns - sent_ns``) and, with the index of the read that completed it, coalescing: two output
events sent ≥ :data:`COALESCE_NS` apart that arrive in one read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.client import Arm, Read, StreamResult
from core.recorder import StreamRecorder
from core.sse import SSEDecoder
from core.stats import percentiles
from core.timings import Recording

__all__ = [
    "COALESCE_NS",
    "STALL_NS",
    "ArmSummary",
    "Dist",
    "Event",
    "RequestMetrics",
    "analyze",
    "by_arm",
    "dist_ms",
    "minus",
    "ratio",
    "record",
    "split_events",
    "summarize",
]

COALESCE_NS = 5_000_000  # two output events sent ≥ 5 ms apart must not arrive in one read
STALL_NS = 10_000_000  # an event delivered > 10 ms after its upstream write is stalled
_STAMP = "sent_ns="


def _ns(seconds: float | None) -> int | None:
    """The recorder's seconds back to integer nanoseconds (exact: they were ns integers)."""
    return None if seconds is None else round(seconds * 1e9)


def _stamp(comment: str) -> int | None:
    try:
        return int(comment[len(_STAMP) :])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event, stamped with the read that completed it."""

    read_index: int
    recv_ns: int
    sent_ns: int | None  # from the ``: sent_ns=`` comment, if the upstream stamped it
    output: bool  # the recorder's kind "output": content, reasoning, text, tool call or refusal
    done: bool  # ``data: [DONE]``
    data: bytes  # the event's data, as dispatched

    @property
    def text(self) -> str:
        """The generated text this event carried, as the recorder assembles it."""
        if self.done or not self.output:
            return ""
        one = StreamRecorder(t0_ns=0)
        one.feed(b"data: " + self.data + b"\n\n", 0)
        return "".join(c.text for c in one.finish().choices)


def record(reads: Sequence[Read], t0_ns: int) -> tuple[Recording, list[Event]]:
    """The recorder's view of one response and its events, each with its send stamp.

    ``max_stamps`` is set above the number of events the bytes can hold, so no event's stamp (and
    no chunk gap) is cut off, however long the stream.
    """
    size = sum(len(r.data) for r in reads)
    recorder = StreamRecorder(t0_ns=t0_ns, max_stamps=max(4096, size // 2 + 1))
    decoder = SSEDecoder(keep_comments=True)
    raw: list[tuple[int, int, bytes]] = []  # (read index, recv_ns, data) per dispatched event
    for n, read in enumerate(reads):
        recorder.feed(read.data, read.recv_ns)
        raw.extend((n, read.recv_ns, event[0]) for event in decoder.feed_raw(read.data))
    recording = recorder.finish()
    comments = decoder.comment_lines or []
    sent = [_stamp(c) for c in comments if c.startswith(_STAMP)]
    # The recorder stamps every event but [DONE], in the same order.
    kinds = iter(s.kind for s in recording.stamps)
    events: list[Event] = []
    for i, (n, recv_ns, data) in enumerate(raw):
        done = data == b"[DONE]"
        output = not done and next(kinds, None) == "output"
        events.append(Event(n, recv_ns, sent[i] if i < len(sent) else None, output, done, data))
    return recording, events


def split_events(reads: Sequence[Read]) -> list[Event]:
    """Every event of the reads, in order, each timed by the read that completed it."""
    return record(reads, 0)[1]


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Client-side timings of one request (all ``_ns`` are durations)."""

    arm: str
    index: int
    error: str | None  # None when status 200, [DONE] seen and ≥ 1 output event
    ttft_ns: int | None  # t_send → read holding the first output event
    e2e_ns: int | None  # t_send → read holding the last output event
    chunk_gaps_ns: tuple[int, ...]  # between consecutive output events' reads
    sent_gaps_ns: tuple[int, ...]  # the same gaps at the upstream (sent_ns): its own pacing
    delivery_ns: tuple[int, ...]  # per stamped event: recv_ns - sent_ns
    output_events: int
    reads: int
    coalesced: int  # output events sharing a read with one sent ≥ COALESCE_NS earlier
    stalled: int  # stamped events with delivery > STALL_NS
    text: str


def analyze(result: StreamResult) -> RequestMetrics:
    recording, events = record(result.reads, result.t_send_ns)
    timings = recording.timings
    outputs = [e for e in events if e.output]
    delivery = tuple(e.recv_ns - e.sent_ns for e in events if e.sent_ns is not None)
    first_sent: dict[int, int] = {}
    coalesced = 0
    for e in outputs:
        if e.sent_ns is None:
            continue
        earliest = first_sent.setdefault(e.read_index, e.sent_ns)
        coalesced += e.sent_ns - earliest >= COALESCE_NS
    error = result.error
    if error is None and result.status != 200:
        error = f"status {result.status}"
    elif error is None and not recording.done:
        error = "no [DONE]"
    elif error is None and not recording.output_events:
        error = "no output"
    return RequestMetrics(
        arm=result.arm,
        index=result.index,
        error=error,
        ttft_ns=_ns(timings.ttft_s),
        e2e_ns=_ns(timings.e2e_s),
        chunk_gaps_ns=tuple(round(g * 1e9) for g in timings.chunk_gaps_s),
        sent_gaps_ns=tuple(
            b.sent_ns - a.sent_ns
            for a, b in itertools.pairwise(outputs)
            if a.sent_ns is not None and b.sent_ns is not None
        ),
        delivery_ns=delivery,
        output_events=recording.output_events,
        reads=len(result.reads),
        coalesced=coalesced,
        stalled=sum(d > STALL_NS for d in delivery),
        text="".join(c.text for c in recording.choices),
    )


@dataclass(frozen=True, slots=True)
class Dist:
    """A distribution in milliseconds (``None`` when there were no samples)."""

    n: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def dist_ms(values_ns: Iterable[int]) -> Dist:
    ms = [v / 1e6 for v in values_ns]
    p50, p90, p99, p100 = percentiles(ms, (50, 90, 99, 100))
    return Dist(len(ms), p50, p90, p99, p100)


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    requests: int
    errors: int
    ttft: Dist
    chunk_gap: Dist
    e2e: Dist
    delivery: Dist
    upstream_gap: Dist
    output_events: int
    reads: int
    coalesced: int
    stalled: int


def summarize(arm: str, metrics: Sequence[RequestMetrics]) -> ArmSummary:
    ok = [m for m in metrics if m.error is None]
    return ArmSummary(
        arm=arm,
        requests=len(metrics),
        errors=len(metrics) - len(ok),
        ttft=dist_ms(m.ttft_ns for m in ok if m.ttft_ns is not None),
        chunk_gap=dist_ms(g for m in ok for g in m.chunk_gaps_ns),
        e2e=dist_ms(m.e2e_ns for m in ok if m.e2e_ns is not None),
        delivery=dist_ms(d for m in metrics for d in m.delivery_ns),
        upstream_gap=dist_ms(g for m in ok for g in m.sent_gaps_ns),
        output_events=sum(m.output_events for m in metrics),
        reads=sum(m.reads for m in metrics),
        coalesced=sum(m.coalesced for m in metrics),
        stalled=sum(m.stalled for m in metrics),
    )


def by_arm(results: Iterable[StreamResult], arms: Sequence[Arm]) -> dict[str, list[RequestMetrics]]:
    """Measured (non-warm-up) requests per arm, arms in the given order, requests by index."""
    out: dict[str, list[RequestMetrics]] = {arm.name: [] for arm in arms}
    for r in sorted(results, key=lambda r: r.index):
        if not r.warmup:
            out[r.arm].append(analyze(r))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None
