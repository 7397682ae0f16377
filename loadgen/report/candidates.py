"""Who each candidate is, and whether the report may call it lossless (pure).

:func:`speculation` reads the candidate legs' ``speculative`` blocks (docs/records.md): what the
policy declared and what the backend reported — method, depth, label, verification — over all
of that backend's records. Verification is judged conservatively: one record saying ``lossy``
makes the candidate lossy; ``lossless`` needs every record that says anything to say it.

:func:`lossless_claim` is the only place the report decides the word *lossless*:

- ``not_lossless`` when the backend (or the policy) reports a lossy verification mode — whatever
  the outputs look like: matching outputs on the traffic seen prove nothing about the rest;
- ``not_lossless`` when the candidate diverges from the primary beyond the noise floor;
- ``lossless`` when the verification mode is reported lossless and the outputs are within the
  noise floor;
- ``unverified`` otherwise: outputs within the noise floor but no verification mode reported,
  or no comparable outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadgen.report.records import Record, candidate_leg
from loadgen.report.sections import Quality

Claim = Literal["lossless", "not_lossless", "unverified"]


@dataclass(frozen=True, slots=True)
class Speculation:
    """One candidate's speculative decoding, as its records describe it."""

    backend: str
    label: str  # the policy's label, else "<method> k=<k>", else the backend name
    method: str | None
    num_speculative_tokens: int | None
    verification: Literal["lossless", "lossy"] | None
    verification_source: str | None
    verification_detail: str | None
    mismatches: tuple[str, ...] = ()
    schedule: tuple[tuple[int, int, int], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "verification": self.verification,
            "verification_source": self.verification_source,
            "verification_detail": self.verification_detail,
            "mismatches": list(self.mismatches),
            "schedule": [list(s) for s in self.schedule] if self.schedule else None,
        }


@dataclass(frozen=True, slots=True)
class Lossless:
    claim: Claim
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"claim": self.claim, "reason": self.reason}


@dataclass(slots=True)
class _Seen:
    label: str | None = None
    method: str | None = None
    depth: int | None = None
    lossy: tuple[str | None, str | None] | None = None
    lossless: tuple[str | None, str | None] | None = None
    mismatches: dict[str, None] = field(default_factory=dict)
    schedule: tuple[tuple[int, int, int], ...] | None = None


def _schedule(reported: Any) -> tuple[tuple[int, int, int], ...] | None:
    raw = reported.get("schedule") if isinstance(reported, dict) else None
    if not isinstance(raw, list):
        return None
    return tuple((int(a), int(b), int(k)) for a, b, k in raw)


def speculation(records: Sequence[Record], backend: str) -> Speculation:
    """The candidate ``backend``'s speculation over ``records`` (latest non-null fields win)."""
    seen = _Seen()
    for r in records:
        leg = candidate_leg(r, backend)
        spec = (leg or {}).get("speculative")
        if not isinstance(spec, dict):
            continue
        seen.label = spec.get("label") or seen.label
        seen.method = spec.get("method") or seen.method
        if isinstance(spec.get("num_speculative_tokens"), int):
            seen.depth = spec["num_speculative_tokens"]
        said = (spec.get("verification_source"), spec.get("verification_detail"))
        if spec.get("verification") == "lossy":
            seen.lossy = said
        elif spec.get("verification") == "lossless":
            seen.lossless = said
        for problem in spec.get("mismatches") or ():
            seen.mismatches[str(problem)] = None
        seen.schedule = _schedule(spec.get("reported")) or seen.schedule
    verification: Literal["lossless", "lossy"] | None = None
    source = detail = None
    if seen.lossy is not None:
        verification, (source, detail) = "lossy", seen.lossy
    elif seen.lossless is not None:
        verification, (source, detail) = "lossless", seen.lossless
    label = seen.label
    if label is None and seen.method is not None:
        label = seen.method + (f" k={seen.depth}" if seen.depth is not None else "")
    return Speculation(
        backend=backend,
        label=label or backend,
        method=seen.method,
        num_speculative_tokens=seen.depth,
        verification=verification,
        verification_source=source,
        verification_detail=detail,
        mismatches=tuple(seen.mismatches),
        schedule=seen.schedule,
    )


def lossless_claim(spec: Speculation, quality: Quality | None) -> Lossless:
    """May the report call this candidate lossless? (rules in the module doc)"""
    if spec.verification == "lossy":
        who = (
            "the policy declares" if spec.verification_source == "policy" else "the backend reports"
        )
        return Lossless(
            "not_lossless",
            f"{who} a lossy verification mode ({spec.verification_detail}): it may accept drafts "
            "the target model would not have produced, so matching outputs here prove nothing "
            "about the rest of the traffic",
        )
    worse = quality.worse_than_noise if quality is not None else None
    if worse:
        return Lossless(
            "not_lossless", "its outputs diverge from the primary beyond the noise floor"
        )
    if worse is None:
        return Lossless("unverified", "no comparable outputs to judge")
    if spec.verification == "lossless":
        return Lossless(
            "lossless",
            f"verification reported lossless ({spec.verification_detail}) and outputs within "
            "the noise floor",
        )
    return Lossless(
        "unverified",
        "outputs within the noise floor, but the backend does not report how it verifies "
        "drafts (vLLM: VLLM_SERVER_DEV_MODE=1 serves /server_info; or declare "
        "speculative.verification in the policy)",
    )
