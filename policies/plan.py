"""Sizing a shadow before it starts: how many candidate replicas keep load parity (pure).

What must match production is the per-replica arrival rate. With ``p`` primary replicas serving
``R`` requests/s, a share ``f`` mirrored to ``s`` candidate replicas gives each candidate replica
``f·R/s`` requests/s against production's ``R/p``: load parity ``f·p/s``. Parity 1 needs
``s = f·p`` candidate replicas — or, for a given ``s``, the share ``s/p`` (what
``ratio: load_matched`` mirrors). ``specshadow plan`` answers both directions, for one candidate
or several (each mirrored its own share; their costs add up).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Plan:
    primary_replicas: int
    rate_rps: float  # production's request rate, all replicas together
    share: float  # the share the SRE wants to mirror (what it costs)
    candidate_replicas: int | None  # the current sizing, if any

    @property
    def production_per_replica_rps(self) -> float:
        return self.rate_rps / self.primary_replicas

    @property
    def mirrored_rps(self) -> float:
        return self.share * self.rate_rps

    @property
    def replicas_for_parity(self) -> float:
        """Candidate replicas that give parity 1 at this share (``f·p``; may be fractional)."""
        return self.share * self.primary_replicas

    @property
    def parity(self) -> float | None:
        """Load parity of the current sizing (None without one)."""
        if not self.candidate_replicas:
            return None
        return self.share * self.primary_replicas / self.candidate_replicas

    @property
    def matched_share(self) -> float | None:
        """The share that gives the current sizing parity 1 (``s/p``, capped at 1)."""
        if not self.candidate_replicas:
            return None
        return min(1.0, self.candidate_replicas / self.primary_replicas)

    def lines(self) -> list[str]:
        p, f = self.primary_replicas, self.share
        out = [
            f"production: {self.rate_rps:g} requests/s over {p} replica{'s' if p != 1 else ''} "
            f"= {self.production_per_replica_rps:.3g} requests/s per replica",
            f"mirroring {f:.3g} of the requests: {self.mirrored_rps:.3g} requests/s to the candidate",
        ]
        need = self.replicas_for_parity
        whole = max(1, round(need))
        if abs(need - whole) < 1e-9:
            out.append(
                f"load parity at this share: {whole} candidate replica{'s' if whole != 1 else ''}"
            )
        else:
            lo, hi = max(1, math.floor(need)), max(1, math.ceil(need))
            out.append(
                f"load parity at this share needs {need:.3g} candidate replicas: {lo} gives parity "
                f"{f * p / lo:.2f}, {hi} gives {f * p / hi:.2f} "
                f"(or mirror {lo / p:.3g} or {hi / p:.3g} of the requests to match exactly)"
            )
        if need < 1:
            out.append(
                f"with 1 candidate replica the matched share is {1 / p:.3g} (ratio: load_matched)"
            )
        if self.candidate_replicas:
            s = self.candidate_replicas
            out.append(
                f"current sizing: {s} candidate replica{'s' if s != 1 else ''} → "
                f"{self.mirrored_rps / s:.3g} requests/s each, load parity {self.parity:.2f}"
                + (
                    ""
                    if self.parity is not None and abs(self.parity - 1) <= 0.25
                    else f" — mismatched: set ratio: load_matched (share {self.matched_share:.3g})"
                )
            )
        return out


def plan_many(
    primary_replicas: int, rate_rps: float, candidates: Sequence[int]
) -> list[tuple[int, float, float]]:
    """Several candidates, each load-matched: (replicas, share, mirrored requests/s) each."""
    return [
        (s, min(1.0, s / primary_replicas), min(1.0, s / primary_replicas) * rate_rps)
        for s in candidates
    ]
