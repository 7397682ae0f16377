"""From acceptance to speed: a step-time model fitted to what the gateway measured live.

One target forward pass over a batch of ``b`` sequences costs ``base_s + slot_s × slots``, where
``slots`` counts the positions the pass verifies: one per plain sequence, ``drafted + 1`` per
speculative one. That is the usual roofline shape — a memory-bound floor (``base_s``, the
weights read once per step) plus a compute-bound slope (``slot_s``) — and the simulator's
continuous-batching engine follows it, so the demo has a known answer.

Fitted by least squares on the records' completed legs (:attr:`records.reader.Leg.ok`, the rule
every reader of the records shares): the primary's ``tpot`` (one token per pass) at its
batch, and any live candidate's ``tpot × tokens_per_pass`` (its step time) at its batch and
verification slots. The batch is the one the leg decoded in: the gateway's in-flight count to the
backend averaged over the leg's decode interval, per replica (the interval its TPOT is measured
over; :mod:`gateway.load`). Records without it fall back to the batch at dispatch (the scraped
``num_requests_running``, else the in-flight count per replica), which is biased low when
traffic arrives in bursts: legs dispatched after a leg join its batch. With no spread in ``slots`` the slope cannot
be told from the floor; the model then says so and assumes verification is free (``slot_s = 0``,
a memory-bound upper bound on speed-up).

A configuration's predicted TPOT speed-up at batch ``b`` is
``tokens_per_pass × step(b, 1) / step(b, 1 + drafted_per_pass)`` — labelled *predicted*, never
measured: it ignores the proposer's own cost (n-gram lookup is negligible; a draft model's is
not, see docs/counterfactual.md) and assumes the batch stays what production ran at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.stats import percentile
from records.reader import Leg

__all__ = ["StepModel", "dispatch_batch", "fit_step_model", "leg_batch"]


@dataclass(frozen=True, slots=True)
class StepModel:
    """``step_s(b, slots_per_seq) = base_s + slot_s × b × slots_per_seq``."""

    base_s: float
    slot_s: float
    batch: float  # production's batch: the median of the primary legs'
    points: int  # legs the fit used
    identified: bool  # False: the slope could not be fitted, slot_s = 0 assumed
    note: str

    def step_s(self, batch: float, slots_per_seq: float) -> float:
        return self.base_s + self.slot_s * batch * slots_per_seq

    def speedup(self, tokens_per_pass: float, drafted_per_pass: float) -> float | None:
        """Predicted TPOT speed-up over plain decoding at production's batch."""
        plain = self.step_s(self.batch, 1.0)
        spec = self.step_s(self.batch, 1.0 + drafted_per_pass)
        if plain <= 0 or spec <= 0:
            return None
        return tokens_per_pass * plain / spec

    def as_json(self) -> dict[str, Any]:
        return {
            "form": "step_s = base_s + slot_s * batch * (1 + drafted_per_pass)",
            "base_s": self.base_s,
            "slot_s": self.slot_s,
            "batch": self.batch,
            "points": self.points,
            "identified": self.identified,
            "note": self.note,
        }


def leg_batch(leg: Leg | Mapping[str, Any]) -> float | None:
    """The batch a leg decoded in (a leg as stored or as read: :class:`records.reader.Leg`):
    the gateway's in-flight count averaged over the leg's decode interval, per replica
    (``load.decode_in_flight``); for records without it, the batch at dispatch
    (:func:`dispatch_batch`)."""
    load = (leg if isinstance(leg, Leg) else Leg(leg)).load
    decode = load.per_replica_decode_in_flight
    if decode is not None and decode > 0:
        return decode
    return dispatch_batch(leg)


def dispatch_batch(leg: Leg | Mapping[str, Any]) -> float | None:
    """The batch at the leg's dispatch: the scraped running requests, else in-flight per
    replica. Biased low for the batch a leg decodes in when traffic arrives in bursts (the
    legs dispatched after it join its batch), so only the fallback."""
    load = (leg if isinstance(leg, Leg) else Leg(leg)).load
    scraped = load.scraped
    running = scraped.num_requests_running if scraped is not None else None
    if running is not None and running > 0:
        return running
    per_replica = load.per_replica_in_flight
    if per_replica is not None and per_replica > 0:
        return per_replica
    return None


def _solve2(sxx: float, sxy: float, sx: float, sy: float, n: int) -> tuple[float, float] | None:
    det = n * sxx - sx * sx
    if n < 3 or abs(det) <= 1e-12 * max(1.0, n * sxx):
        return None
    slope = (n * sxy - sx * sy) / det
    return (sy - slope * sx) / n, slope


def fit_step_model(
    points: Iterable[tuple[float, float, float]], batches: Iterable[float]
) -> StepModel | None:
    """Fit on ``(batch, slots_per_seq, step_s)`` points; ``batches``: production's batches.

    None when there is no point at all.
    """
    pts = [(b, s, t) for b, s, t in points if b > 0 and s >= 1 and t > 0]
    if not pts:
        return None
    prod = percentile(list(batches), 50) or percentile([b for b, _, _ in pts], 50) or 1.0
    xs = [b * s for b, s, _ in pts]
    ys = [t for _, _, t in pts]
    fit = _solve2(
        sum(x * x for x in xs),
        sum(x * y for x, y in zip(xs, ys, strict=True)),
        sum(xs),
        sum(ys),
        len(pts),
    )
    if fit is None or fit[1] < 0 or fit[0] < 0:
        base = sum(ys) / len(ys)
        return StepModel(
            base_s=base,
            slot_s=0.0,
            batch=prod,
            points=len(pts),
            identified=False,
            note="too little spread in batch × slots to fit a slope: verification assumed free "
            "(memory-bound), an upper bound on speed-up",
        )
    return StepModel(
        base_s=fit[0],
        slot_s=fit[1],
        batch=prod,
        points=len(pts),
        identified=True,
        note="least squares on the primary's and live candidates' step times",
    )
