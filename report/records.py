"""Reading comparison records for the report: the few accessors every section shares (pure).

Reads record FIELDS only (``schema specshadow.record/1``, docs/records.md); unknown values are
``None`` and are skipped, never invented. Categories are the record's ``category`` (``None`` →
``"uncategorized"``). A record may hold several candidate legs (one per candidate backend); a
section about one candidate reads that backend's leg and the comparison that names it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

ALL = "all"
Record = Mapping[str, Any]


def category(record: Record) -> str:
    c = record.get("category")
    return str(c) if c else "uncategorized"


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def legs(record: Record) -> list[Mapping[str, Any]]:
    return [leg for leg in record.get("legs") or () if isinstance(leg, Mapping)]


def by_role(record: Record) -> dict[str, Mapping[str, Any]]:
    """The first leg of each role."""
    out: dict[str, Mapping[str, Any]] = {}
    for leg in legs(record):
        role = leg.get("role")
        if isinstance(role, str) and role not in out:
            out[role] = leg
    return out


def candidate_backends(records: Iterable[Record]) -> list[str]:
    """Every backend that served a candidate leg, or that a rule named as a candidate (mirrored or
    not: a candidate that drew no pair is judged "not enough data", not left out), in order of
    first appearance."""
    seen: dict[str, None] = {}
    for r in records:
        for leg in legs(r):
            if leg.get("role") == "candidate":
                seen.setdefault(str(leg.get("backend")), None)
        sampling = r.get("sampling") or {}
        for drop in sampling.get("dropped") or ():
            if drop.get("role") == "candidate":
                seen.setdefault(str(drop.get("backend")), None)
        for name in sampling.get("candidates") or ():
            seen.setdefault(str(name), None)
    return list(seen)


def candidate_leg(record: Record, backend: str | None) -> Mapping[str, Any] | None:
    """The candidate leg served by ``backend`` (``None``: the first candidate leg)."""
    for leg in legs(record):
        if leg.get("role") == "candidate" and (backend is None or leg.get("backend") == backend):
            return leg
    return None


def leg_ok(leg: Mapping[str, Any] | None) -> bool:
    if leg is None:
        return False
    status = leg.get("status")
    return (
        leg.get("outcome") in (None, "completed")
        and (status is None or status < 400)
        and leg.get("error_type") is None
    )


def comparison(
    record: Record, a: str, b: str, *, b_backend: str | None = None
) -> Mapping[str, Any] | None:
    """The comparison of role ``b`` (served by ``b_backend``, when given) against role ``a``."""
    for c in record.get("comparisons") or ():
        if b_backend is not None and c.get("b_backend") not in (None, b_backend):
            continue
        if (c.get("a"), c.get("b")) in ((a, b), (b, a)):
            return c  # type: ignore[no-any-return]
    return None


def text(leg: Mapping[str, Any] | None) -> str | None:
    out = (leg or {}).get("output")
    return out.get("text") if isinstance(out, Mapping) else None
