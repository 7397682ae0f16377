"""From acceptance to speed: a step-time model fitted to what the gateway measured live.

One target forward pass over a batch of ``b`` sequences costs ``base_s + slot_s × slots``, where
``slots`` counts the positions the pass verifies: one per plain sequence, ``drafted + 1`` per
speculative one. That is the usual roofline shape — a memory-bound floor (``base_s``, the
weights read once per step) plus a compute-bound slope (``slot_s``) — and the simulator's
continuous-batching engine follows it, so the demo has a known answer.

A speculative sequence also costs its proposer's work in every step (the n-gram lookup, a draft
model's passes): ``proposer_s`` per sequence, per proposer. Fitted by least squares on the
records' legs: the primary's ``tpot`` (one token per pass) at its batch, and any live candidate's
``tpot × tokens_per_pass`` (its step time) at its batch and verification slots. The primary's
legs give the slope alone; the candidate's, whose drafted tokens per pass vary, tell the slope
from the proposer's share. The batch is the backend's scraped ``num_requests_running`` when the leg has
it, else the gateway's in-flight count per replica. With no spread in ``slots`` the slope cannot
be told from the floor; the model then says so and assumes verification is free (``slot_s = 0``,
a memory-bound upper bound on speed-up).

A configuration's predicted TPOT speed-up at batch ``b`` is
``tokens_per_pass × step(b, 1) / (step(b, 1 + drafted_per_pass) + proposer_s × b)`` — labelled
*predicted*, never measured. A proposer no live candidate ran has no measured cost and counts
as free (an upper bound; a draft model's is not small, see docs/counterfactual.md); the
prediction assumes the batch stays what production ran at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.stats import percentile

__all__ = ["StepModel", "fit_step_model", "leg_batch"]


@dataclass(frozen=True, slots=True)
class StepModel:
    """``step_s(b, slots_per_seq) = base_s + slot_s × b × slots_per_seq (+ proposer_s × b)``."""

    base_s: float
    slot_s: float
    batch: float  # production's batch: the median of the primary legs'
    points: int  # legs the fit used
    identified: bool  # False: the slope could not be fitted, slot_s = 0 assumed
    note: str
    proposer_s: Mapping[str, float] = field(default_factory=dict)  # per sequence per step

    def step_s(self, batch: float, slots_per_seq: float, proposer: str | None = None) -> float:
        own = (
            self.proposer_s.get(proposer, 0.0)
            if proposer is not None and slots_per_seq > 1
            else 0.0
        )
        return self.base_s + self.slot_s * batch * slots_per_seq + own * batch

    def speedup(
        self, tokens_per_pass: float, drafted_per_pass: float, proposer: str | None = None
    ) -> float | None:
        """Predicted TPOT speed-up over plain decoding at production's batch."""
        plain = self.step_s(self.batch, 1.0)
        spec = self.step_s(self.batch, 1.0 + drafted_per_pass, proposer)
        if plain <= 0 or spec <= 0:
            return None
        return tokens_per_pass * plain / spec

    def as_json(self) -> dict[str, Any]:
        return {
            "form": "step_s = base_s + slot_s * batch * (1 + drafted_per_pass)"
            " + proposer_s[proposer] * batch",
            "base_s": self.base_s,
            "slot_s": self.slot_s,
            "proposer_s": dict(self.proposer_s),
            "batch": self.batch,
            "points": self.points,
            "identified": self.identified,
            "note": self.note,
        }


def leg_batch(leg: Mapping[str, Any]) -> float | None:
    """The batch a leg ran in: the scraped running requests, else in-flight per replica."""
    load = leg.get("load") or {}
    scraped = load.get("scraped") or {}
    running = scraped.get("num_requests_running")
    if isinstance(running, int | float) and running > 0:
        return float(running)
    per_replica = load.get("per_replica_in_flight")
    if isinstance(per_replica, int | float) and per_replica > 0:
        return float(per_replica)
    return None


def _solve(normal: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is (near) singular."""
    m = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(normal)]
    scale = max(1.0, *(abs(a[i][i]) for i in range(m)))
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-10 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(m):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][m] / a[i][i] for i in range(m)]


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    m = len(rows[0])
    if len(rows) < m + 1:
        return None
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(m)] for i in range(m)]
    rhs = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(m)]
    return _solve(normal, rhs)


def fit_step_model(
    points: Iterable[tuple[float, float, float] | tuple[float, float, float, str | None]],
    batches: Iterable[float],
) -> StepModel | None:
    """Fit on ``(batch, slots_per_seq, step_s[, proposer])`` points; ``batches``: production's.

    A point with a proposer is a speculative leg's step; each proposer gets its own per-sequence
    cost when the points can tell it from the slope (else it is left out, and said so). None when
    there is no point at all.
    """
    pts = [
        (p[0], p[1], p[2], p[3] if len(p) > 3 else None)
        for p in points
        if p[0] > 0 and p[1] >= 1 and p[2] > 0
    ]
    if not pts:
        return None
    prod = percentile(list(batches), 50) or percentile([b for b, *_ in pts], 50) or 1.0
    ys = [t for _, _, t, _ in pts]
    names = sorted({p for *_, p in pts if p is not None})
    fit: list[float] | None = None
    if names:
        rows = [[1.0, b * s, *(b if p == n else 0.0 for n in names)] for b, s, _, p in pts]
        fit = _least_squares(rows, ys)
        if fit is not None and (fit[0] < 0 or fit[1] < 0):
            fit = None
    costs: dict[str, float] = {}
    note = "least squares on the primary's and live candidates' step times"
    if fit is not None:
        costs = {n: max(0.0, c) for n, c in zip(names, fit[2:], strict=True)}
    else:
        fit = _least_squares([[1.0, b * s] for b, s, _, _ in pts], ys)
        if names:
            note += "; the proposers' own cost could not be told from the slope and is left out"
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
        note=note,
        proposer_s=costs,
    )
