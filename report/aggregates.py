"""The window's aggregates, the types both engines build: :class:`Population` (summed in Python
by :mod:`report.population`, in ClickHouse/chDB by :mod:`report.sql`), the sample's size and
order, and the wording of an exclusion. Neither engine imports the other; both import this."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from report import load as lt

__all__ = ["SAMPLE", "Exclusion", "Population", "exclusion_text", "sample_key"]

SAMPLE = 5000  # exchanges the detail sections read at most

Exclusion = tuple[str, str]  # (code, detail)


def exclusion_text(code: str, detail: str) -> str:
    """The report's wording of an exclusion (:func:`report.population.exclusion`)."""
    return {
        "dropped": f"dropped ({detail})",
        "not_mirrored": "not mirrored to this candidate",
        "primary": f"primary {detail}",
        "candidate": f"candidate {detail}",
        "skip": f"speculation skipped by the engine ({detail}): quality only",
        "no_load": "no load data",
        "parity": f"load parity outside ±{lt.PARITY_BAND - 1:.0%}",
        "matched": "matched",
    }[code]


def sample_key(exchange_id: str) -> bytes:
    """The sample's order: the MD5 of the exchange id (SQL: ``MD5(exchange_id)``, the same bytes
    compared the same way)."""
    return hashlib.md5(exchange_id.encode(), usedforsecurity=False).digest()


@dataclass(frozen=True, slots=True)
class Population:
    """The window's aggregates (see the module doc)."""

    records: int  # every exchange in the window
    shadow: int  # of which the primary answered (the rest: a candidate during a canary)
    categories: tuple[str, ...]  # of the shadow exchanges, sorted
    backends: tuple[str, ...]  # candidate backends, in order of first appearance
    production: Mapping[str, lt.ProductionLoad]  # category (and ALL) → production's load
    cells: Mapping[tuple[str, str], lt.Cell]  # (backend, category or ALL) → pairs' statistics
    exclusions: Mapping[str, Mapping[str, Counter[str]]]  # backend → category → reason → n
    engine: str = "python"

    def load_true(self, backend: str, cat: str) -> lt.LoadTrue:
        production = self.production.get(cat, lt.ProductionLoad.of(()))
        return lt.at_production(production, self.cells.get((backend, cat), lt.Cell()))
