"""The analysis's result tables as types: what :mod:`report.sections` writes and every renderer
(HTML, Markdown, plots, ``report.json``, the checklist, the rollout files) reads, by attribute —
no string-keyed containers between the analysis and its readers.

- :class:`RawSpeedups`: one category's paired candidate-vs-primary speed-ups (e2e, TPOT, TTFT)
  and the baseline's e2e speed-up against the primary, at whatever load the candidate ran
  (written by :func:`report.sections.raw_speedups`);
- :class:`AcceptanceValues` / :class:`Acceptance`: the candidate's per-request acceptance values
  by category, output length and concurrency (written by :func:`report.sections.acceptance`);
- :class:`KvUsage`: one backend's KV-cache usage (written by :func:`report.sections.resources`).

The benchmark matrix's and the load generator's result rows are typed where they are written:
:class:`loadgen.matrix.MatrixRow`, :class:`loadgen.results.LoadgenRow`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from loadgen.speedup import Speedup

__all__ = ["Acceptance", "AcceptanceDim", "AcceptanceValues", "KvUsage", "RawSpeedups"]

AcceptanceDim = Literal["category", "output_length", "concurrency"]
ACCEPTANCE_DIMS: tuple[AcceptanceDim, ...] = ("category", "output_length", "concurrency")


@dataclass(frozen=True, slots=True)
class RawSpeedups:
    """One category's raw paired speed-ups (primary / candidate; > 1: the candidate is faster)."""

    e2e: Speedup | None = None
    tpot: Speedup | None = None
    ttft: Speedup | None = None
    baseline_e2e: Speedup | None = None  # primary / baseline: the noise of the comparison


@dataclass(frozen=True, slots=True)
class KvUsage:
    """One backend's KV-cache usage (a share of the cache): its peak and mean over the samples."""

    peak: float
    mean: float
    samples: int


@dataclass(frozen=True, slots=True)
class AcceptanceValues:
    """The candidate's per-request acceptance values of one key (a category, an output-length or
    a concurrency bucket), one value per request that carried it."""

    tokens_per_event: tuple[float, ...] = ()
    mean_acceptance_length: tuple[float, ...] = ()
    draft_acceptance_rate: tuple[float, ...] = ()
    coverage: tuple[float, ...] = ()


_NONE = AcceptanceValues()


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Acceptance by dimension: key → :class:`AcceptanceValues`."""

    category: Mapping[str, AcceptanceValues] = field(default_factory=dict)
    output_length: Mapping[str, AcceptanceValues] = field(default_factory=dict)
    concurrency: Mapping[str, AcceptanceValues] = field(default_factory=dict)

    def by(self, dim: AcceptanceDim) -> Mapping[str, AcceptanceValues]:
        if dim == "category":
            return self.category
        if dim == "output_length":
            return self.output_length
        return self.concurrency

    def of_category(self, cat: str) -> AcceptanceValues:
        """One category's values (none when it has none)."""
        return self.category.get(cat, _NONE)

    def pooled_tokens_per_event(self) -> Iterator[float]:
        """Every request's tokens per event, over all categories."""
        for values in self.category.values():
            yield from values.tokens_per_event
