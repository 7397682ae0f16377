"""Workflows: calls grouped into application runs, runs into workflow types, and each
candidate's per-call speed-ups projected onto the run's end-to-end time (pure).

A **run** is the calls that share the record's ``workflow.session`` (the policy's session
header), else its ``workflow.trace_id`` (the client's W3C ``traceparent``). Its **type** is the
``workflow.type`` header's value, else its first call's ``route/category``. Only calls production
answered are read (in a canary the served leg is the candidate's, and production's time is not
observed); a run with a call production did not complete is left out, counted.

One call, as the gateway saw it: it starts when the request arrived (the record's
``started_unix_ns``) and ends at the primary leg's last byte (``legs[0].started_unix_ns +
e2e_s``); within it, the primary's time to first token (``ttft_s``) and its decode time
(``e2e_s − ttft_s``; a non-streamed call is all decode). The run's **critical path** is its wall
time from its first call's start to its last call's end; the union of its call intervals is the
LLM's part of it (overlapping calls count once), the rest is the time between calls (tools,
retrieval, the application's own work); the **generation share** is the union of the decode
intervals over the wall time.

**The projection** (per run, per candidate). The time between calls is kept as it is; every call
keeps its start relative to the block of overlapping calls it belongs to, and its time to first
token and decode time are replaced by the candidate's: TTFT × the call's TTFT ratio (candidate
over production) and decode ÷ the call's TPOT speed-up (production's TPOT over the candidate's).
A call the candidate was mirrored on uses its own paired ratios; any other, the type's pooled
ones (ratios of sums over the mirrored calls). A block ends when its last projected call ends,
so a fan-out is as slow as its slowest call. The run's projected time is the time between calls
plus the projected blocks; the type's **projected end-to-end speed-up** is the ratio of the mean
run time to the mean projected run time (what a user waits, on average). Assumed: the tools take
the same time whichever engine answered, the application makes the same calls with the same
outputs (lossless speculation), and a call's speed-up measured in shadow holds when the
candidate answers (the report's load-true sections say when load changes that).

**The interval**: a percentile bootstrap over runs (2,000 resamples, fixed seed). Runs are the
independent units — the calls of one run share a context, a tool chain and a moment's load — and
the estimate is a ratio of sums over runs whose lengths differ widely, where a delta method's
normal approximation is poor for the few dozen runs a window usually holds. Resampling runs
carries both the spread of run shapes and the noise of each call's measured ratios.

Time before a run's first call or after its last (a retrieval that opens the run, a tool that
closes it) is invisible to the gateway. Where the application's own spans reach the store (the
Collector's ClickHouse exporter's traces table, read by :mod:`report.spans`), their first start
and last end in the run's traces extend the run to its true start and end, and that time is
kept like the time between calls; without them the projection over-states such runs'
speed-up.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from records.reader import Record

__all__ = [
    "GATE_SHARE",
    "CallTime",
    "Projection",
    "Run",
    "WorkflowType",
    "Workflows",
    "workflows_of",
]

GATE_SHARE = 0.5  # the playbook's gate: generation under half of the run's critical path
RESAMPLES = 2000
SEED = 20_251_203
CONFIDENCE = 0.95
_NS = 1e9


@dataclass(frozen=True, slots=True)
class CallTime:
    """One call on the gateway's clock: ``start``/``end`` in seconds from the run's first call;
    production's ``ttft_s`` and ``decode_s``; per candidate backend, its paired projection of
    the two (None: not mirrored on this call, the type's pooled ratios apply)."""

    start: float
    end: float
    ttft_s: float
    decode_s: float
    paired: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)

    @property
    def overhead_s(self) -> float:
        """The call's time outside its primary leg's TTFT and decode (the gateway, the queue)."""
        return max(0.0, self.end - self.start - self.ttft_s - self.decode_s)


@dataclass(frozen=True, slots=True)
class Run:
    """One application run: its calls, and the application's own time before its first call
    and after its last (``lead_s``/``tail_s``: from its spans; 0 without them)."""

    key: str
    type: str
    calls: tuple[CallTime, ...]  # by start
    lead_s: float = 0.0
    tail_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.lead_s + max(c.end for c in self.calls) - self.calls[0].start + self.tail_s

    def blocks(self) -> list[list[CallTime]]:
        """The calls in blocks of overlapping intervals (a block is one stretch of LLM time)."""
        out: list[list[CallTime]] = []
        end = float("-inf")
        for c in self.calls:
            if out and c.start < end:
                out[-1].append(c)
                end = max(end, c.end)
            else:
                out.append([c])
                end = c.end
        return out

    @property
    def llm_s(self) -> float:
        """The union of the call intervals: the LLM's part of the critical path."""
        return sum(max(c.end for c in b) - b[0].start for b in self.blocks())

    @property
    def generation_s(self) -> float:
        """The union of the decode intervals (each call's last ``decode_s``)."""
        spans = sorted((c.end - c.decode_s, c.end) for c in self.calls)
        total, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + cur_e - cur_s

    def projected_s(self, backend: str, ttft_ratio: float, speedup: float) -> float:
        """The run's wall time had ``backend`` answered every call (the module doc's model);
        ``ttft_ratio``/``speedup``: the type's pooled ratios, for calls not mirrored."""
        blocks = self.blocks()
        between = self.wall_s - self.llm_s
        total = between
        for b in blocks:
            b0 = b[0].start
            ends = []
            for c in b:
                ttft, decode = c.paired.get(backend, (None, None))
                ttft = c.ttft_s * ttft_ratio if ttft is None else ttft
                decode = c.decode_s / speedup if decode is None else decode
                ends.append(c.start - b0 + c.overhead_s + ttft + decode)
            total += max(ends)
        return total


@dataclass(frozen=True, slots=True)
class Projection:
    """One candidate's projected end-to-end speed-up of a workflow type's runs, with its
    bootstrap interval (``low``/``high``: None with fewer than two runs)."""

    backend: str
    estimate: float
    low: float | None
    high: float | None
    per_call_speedup: float  # pooled TPOT speed-up over the type's mirrored calls
    ttft_ratio: float  # pooled candidate TTFT over production's
    mirrored: int  # calls with the candidate's own paired measurement
    calls: int


@dataclass(frozen=True, slots=True)
class WorkflowType:
    """One workflow type: its runs' shape and each candidate's projection."""

    name: str
    named: bool  # by the type header (else route/category)
    runs: int
    calls_per_run: float
    ttft_s: float  # mean per call (production)
    decode_s: float  # mean per call (production)
    between_s: float  # mean time between calls per run (tools, retrieval)
    wall_s: float  # mean run wall time
    llm_share: float  # Σ union of calls / Σ wall
    generation_share: float  # Σ union of decode / Σ wall
    projections: Mapping[str, Projection]
    pick: str | None  # the backend the headline speaks for

    @property
    def headline(self) -> Projection | None:
        return self.projections.get(self.pick) if self.pick is not None else None

    def amdahl(self, per_call: float) -> float:
        """``1 / ((1 − f) + f / S)``: the closed form with this type's generation share ``f`` and
        a per-call decode speed-up ``S`` (sequential calls, TTFT unchanged) — beside the
        projection, which also counts TTFT and overlapping calls."""
        f = self.generation_share
        return 1.0 / ((1.0 - f) + f / per_call)

    @property
    def below_gate(self) -> bool:
        return self.generation_share < GATE_SHARE

    def gate_sentence(self) -> str:
        share = f"generation is {self.generation_share:.0%} of this workflow's critical path"
        if self.below_gate:
            return (
                f"{share}: less than half, so speculative decoding is rarely the first "
                "optimization here — the time between calls (tools, retrieval) dominates"
            )
        return f"{share}: at least half, so a faster decoder shows in the run's time"


@dataclass(frozen=True, slots=True)
class Workflows:
    types: Mapping[str, WorkflowType]  # by runs, most first
    runs: int
    calls: int
    left_out: Mapping[str, int]  # reason → runs left out
    spanned: int = 0  # runs whose start and end the application's own spans gave

    @property
    def lead(self) -> WorkflowType | None:
        """The type the report leads with: the one with the most runs."""
        return next(iter(self.types.values()), None)


# -- reading records into runs ----------------------------------------------------------------


def _run_key(r: Record) -> str | None:
    w = r.workflow
    if w is None:
        return None
    if w.session is not None:
        return f"session:{w.session}"
    return None if w.trace_id is None else f"trace:{w.trace_id}"


def _call(r: Record, t0_ns: int) -> tuple[CallTime | None, str | None]:
    """The call of record ``r`` (None with the reason it cannot be read)."""
    p = r.primary
    if r.served_by != "primary" or p is None:
        return None, "served by a candidate"
    if not p.ok or p.e2e_s is None or p.started_unix_ns is None:
        return None, "a call production did not complete"
    streamed = p.ttft_s is not None and p.tpot_s is not None
    ttft = p.ttft_s if streamed and p.ttft_s is not None else 0.0
    decode = max(0.0, p.e2e_s - ttft)
    paired: dict[str, tuple[float | None, float | None]] = {}
    for leg in r.legs:
        if leg.role != "candidate" or not leg.ok or not leg.backend:
            continue
        if streamed and leg.ttft_s is not None and leg.tpot_s and p.tpot_s:
            paired[leg.backend] = (leg.ttft_s, decode * leg.tpot_s / p.tpot_s)
        elif not streamed and leg.e2e_s is not None:
            paired[leg.backend] = (0.0, leg.e2e_s)
    end = (p.started_unix_ns - t0_ns) / _NS + p.e2e_s
    return CallTime((r.started_unix_ns - t0_ns) / _NS, end, ttft, decode, paired), None


Bounds = Mapping[str, tuple[int, int]]
"""Trace id → (first start, last end) of the application's own spans in it, unix ns."""


def _edges(recs: Sequence[Record], run: Run, spans: Bounds) -> Run:
    """``run`` with the time its application's spans show before its first call and after its
    last (a retrieval that opens the run, a tool that closes it)."""
    traces = {r.workflow.trace_id for r in recs if r.workflow is not None}
    got = [spans[t] for t in traces if t is not None and t in spans]
    if not got:
        return run
    t0 = recs[0].started_unix_ns
    last = max(c.end for c in run.calls)
    lead = max(0.0, (t0 - min(s for s, _ in got)) / _NS)
    tail = max(0.0, (max(e for _, e in got) - t0) / _NS - last)
    return replace(run, lead_s=lead, tail_s=tail)


def _runs(records: Sequence[Record], spans: Bounds) -> tuple[list[Run], dict[str, int], int, int]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        key = _run_key(r)
        if key is not None:
            grouped[key].append(r)
    runs: list[Run] = []
    left: dict[str, int] = defaultdict(int)
    calls = spanned = 0
    for key, recs in grouped.items():
        recs.sort(key=lambda r: r.order_key)
        first = recs[0]
        named = next((w.type for r in recs if (w := r.workflow) and w.type), None)
        if named is None and len(recs) < 2:
            left["a single call"] += 1
            continue
        t0 = first.started_unix_ns
        got = [_call(r, t0) for r in recs]
        why = next((reason for c, reason in got if c is None), None)
        if why is not None:
            left[why] += 1
            continue
        kind = named or f"{first.route or 'chat'}/{first.category}"
        run = Run(key, kind, tuple(c for c, _ in got if c is not None))
        edged = _edges(recs, run, spans)
        spanned += edged is not run
        runs.append(edged)
        calls += len(recs)
    return runs, dict(left), calls, spanned


# -- projecting ---------------------------------------------------------------------------------


def _pooled(runs: Sequence[Run], backend: str) -> tuple[float, float, int, int]:
    """(TTFT ratio, TPOT speed-up, mirrored calls, calls): ratios of sums over the calls the
    candidate was mirrored on."""
    ttft_p = ttft_c = dec_p = dec_c = 0.0
    mirrored = total = 0
    for run in runs:
        for c in run.calls:
            total += 1
            ttft, decode = c.paired.get(backend, (None, None))
            if ttft is None or decode is None:
                continue
            mirrored += 1
            ttft_p, ttft_c = ttft_p + c.ttft_s, ttft_c + ttft
            dec_p, dec_c = dec_p + c.decode_s, dec_c + decode
    ratio = ttft_c / ttft_p if ttft_p > 0 else 1.0
    speedup = dec_p / dec_c if dec_c > 0 else 1.0
    return ratio, speedup, mirrored, total


def _project(runs: Sequence[Run], backend: str) -> Projection | None:
    import numpy as np

    ratio, speedup, mirrored, total = _pooled(runs, backend)
    if mirrored == 0:
        return None
    wall = np.array([r.wall_s for r in runs])
    proj = np.array([r.projected_s(backend, ratio, speedup) for r in runs])
    estimate = float(wall.sum() / proj.sum())
    low = high = None
    if len(runs) >= 2:
        rng = np.random.default_rng(SEED)
        idx = rng.integers(0, len(runs), size=(RESAMPLES, len(runs)))
        boot = wall[idx].sum(axis=1) / proj[idx].sum(axis=1)
        tail = (1 - CONFIDENCE) / 2
        low, high = (float(x) for x in np.quantile(boot, [tail, 1 - tail]))
    return Projection(backend, estimate, low, high, speedup, ratio, mirrored, total)


def _type(name: str, runs: list[Run], named: bool, pick: str | None) -> WorkflowType:
    calls = [c for r in runs for c in r.calls]
    wall = sum(r.wall_s for r in runs)
    backends = sorted({b for c in calls for b in c.paired})
    projections = {b: p for b in backends if (p := _project(runs, b)) is not None}
    if pick not in projections:
        pick = max(projections, key=lambda b: projections[b].estimate, default=None)
    return WorkflowType(
        name=name,
        named=named,
        runs=len(runs),
        calls_per_run=len(calls) / len(runs),
        ttft_s=sum(c.ttft_s for c in calls) / len(calls),
        decode_s=sum(c.decode_s for c in calls) / len(calls),
        between_s=sum(r.wall_s - r.llm_s for r in runs) / len(runs),
        wall_s=wall / len(runs),
        llm_share=sum(r.llm_s for r in runs) / wall if wall > 0 else 0.0,
        generation_share=sum(r.generation_s for r in runs) / wall if wall > 0 else 0.0,
        projections=projections,
        pick=pick,
    )


def workflows_of(
    records: Sequence[Record], *, pick: str | None = None, spans: Bounds | None = None
) -> Workflows | None:
    """The window's workflow types (None when no record names a run of two calls or a type).
    ``pick``: the candidate each type's headline projection speaks for (the recommended one);
    absent from a type, its fastest projection. ``spans``: the application's own spans' bounds
    per trace id (:func:`report.spans.trace_bounds`), which extend a run to its true start and
    end."""
    runs, left, calls, spanned = _runs(records, spans or {})
    if not runs:
        return None
    by_type: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_type[run.type].append(run)
    named = {
        r.workflow.type for r in records if r.workflow is not None and r.workflow.type is not None
    }
    types = [_type(t, rs, t in named, pick) for t, rs in by_type.items()]
    types.sort(key=lambda t: (-t.runs, t.name))
    return Workflows({t.name: t for t in types}, len(runs), calls, left, spanned)
