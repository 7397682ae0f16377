"""Population aggregates: what the report needs over *every* exchange of the window, summed
where the data is, so the report's memory does not grow with the store.

A fleet's store holds millions of records; a report that reads them all into Python holds about
47 KiB per record. The verdict's numbers do not need the records, only sums over them:

- the window's exchange counts, categories and candidate backends;
- production's per-replica load per category — its equal-count strata (edges, counts, ranges)
  and operating range (p5/p50/p95), exact;
- per candidate × category × load stratum, the matched pairs' count and the **sufficient
  statistics** (count, sum, sum of squares) of their log speed-ups, end to end and per token —
  from which :func:`report.load.at_production` computes the load-true estimate and its interval;
- per candidate × category, why each exchange does or does not count (the exclusions).

:class:`Population` holds them. Two engines compute it, one definition each:

- :class:`PopulationFold`: a one-pass streaming fold in Python over any records (SQLite, JSON
  Lines, a collector's files, a list). It keeps per record only a few floats of each pair (about
  60 bytes per mirrored exchange), never the record.
- :func:`report.sql.population` (for ``chdb:///`` and ``clickhouse://`` stores): the same sums as
  SQL over the wide table's typed columns; Python receives aggregates only.

Neither engine imports the other: both build the types of :mod:`report.aggregates`, and
:func:`report.gather.gather` chooses between them.

Everything else the report shows (latency tables, raw speed-ups, acceptance, the quality tests,
capacity, examples, the rollout timeline) reads a **bounded sample**: the :data:`SAMPLE` exchanges
with the lowest MD5 of their exchange id — independent of every measured value, so an unbiased
sample, and the same exchanges on every engine. A window that holds fewer is read whole.

Size: the Python fold and the sample; the data types live in :mod:`report.aggregates`, the SQL
twin in :mod:`report.sql`, held to this fold by tests on every engine.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from records.reader import Record, read
from report import load as lt
from report.aggregates import SAMPLE, Exclusion, Population, exclusion_text, sample_key
from report.records import ALL

__all__ = [
    "SAMPLE",
    "Population",
    "PopulationFold",
    "exclusion",
    "exclusion_text",
    "gather",
    "population_of",
    "sample_key",
]  # SAMPLE, Population, exclusion_text and sample_key live in report.aggregates


def exclusion(record: Record, backend: str) -> Exclusion:
    """Why one exchange does (``("matched", "")``) or does not count for ``backend``'s verdict."""
    cand = record.candidate_leg(backend)
    if cand is None:
        for drop in record.sampling.dropped:
            if drop.backend == backend:
                return "dropped", drop.reason
        return "not_mirrored", ""
    prim = record.primary
    if prim is None:
        return "primary", "missing"
    if not prim.ok:
        return "primary", str(prim.outcome)
    if not cand.ok:
        return "candidate", str(cand.outcome)
    skip = record.speculation_skip
    if skip:
        return "skip", skip
    parity = cand.load_parity
    if parity is None:
        return "no_load", ""
    if not lt.matched(parity):
        return "parity", ""
    return "matched", ""


@dataclass(slots=True)
class _Pairs:
    """One candidate's pairs as columns: a few floats per pair, not a record."""

    cats: array[int] = field(default_factory=lambda: array("i"))
    production: array[float] = field(default_factory=lambda: array("d"))
    parity: array[float] = field(default_factory=lambda: array("d"))
    candidate_load: array[float] = field(default_factory=lambda: array("d"))
    e2e: array[float] = field(default_factory=lambda: array("d"))
    tpot: array[float] = field(default_factory=lambda: array("d"))


_NAN = float("nan")


def _f(x: float | None) -> float:
    return _NAN if x is None else x


def _v(x: float) -> float | None:
    return None if x != x else x  # NaN is "none"


class PopulationFold:
    """The population of a stream of records, in one pass (see the module doc)."""

    def __init__(self) -> None:
        self.records = 0
        self.shadow = 0
        self._cats: dict[str, int] = {}
        self._prod_cat: array[int] = array("i")
        self._prod: array[float] = array("d")
        self._first: dict[str, tuple[int, str, int]] = {}  # backend → first appearance
        self._pairs: dict[str, _Pairs] = {}
        self._shadow_by_cat: Counter[str] = Counter()
        self._excluded: dict[str, Counter[tuple[str, str, str]]] = {}  # b → (cat, code, detail)

    def add(self, record: Record | Mapping[str, Any]) -> None:
        r = read(record)
        self.records += 1
        if r.served_by != "primary":
            return
        self.shadow += 1
        cat = r.category
        ci = self._cats.setdefault(cat, len(self._cats))
        self._shadow_by_cat[cat] += 1
        prim = r.primary
        prod = lt.per_replica_rate(prim)
        if prod is not None:
            self._prod_cat.append(ci)
            self._prod.append(prod)
        key = r.order_key
        named = r.named_candidates()
        for pos, b in enumerate(named):
            first = self._first.get(b)
            if first is None or (key[0], key[1], pos) < first:
                self._first[b] = (key[0], key[1], pos)
        for b in {*named, *(d.backend for d in r.sampling.dropped)}:
            code, detail = exclusion(r, b)
            if code != "not_mirrored":
                self._excluded.setdefault(b, Counter())[(cat, code, detail)] += 1
        if r.speculation_skip or prim is None or not prim.ok or prod is None:
            return
        ref_e2e = prim.e2e_s
        for leg in r.legs:
            if leg.role != "candidate":
                continue
            b = leg.backend
            if r.candidate_leg(b) is not leg or not leg.ok:
                continue
            c_e2e = leg.e2e_s
            if ref_e2e is None or c_e2e is None:
                continue
            cols = self._pairs.setdefault(b, _Pairs())
            cols.cats.append(ci)
            cols.production.append(prod)
            cols.parity.append(_f(leg.load_parity))
            cols.candidate_load.append(_f(lt.per_replica_rate(leg)))
            cols.e2e.append(_f(lt.log_ratio(ref_e2e, c_e2e)))
            cols.tpot.append(_f(lt.log_ratio(prim.tpot_s, leg.tpot_s)))

    def result(self) -> Population:
        cats = sorted(self._cats)
        production: dict[str, lt.ProductionLoad] = {}
        for cat in [*cats, ALL]:
            ci = self._cats.get(cat)
            values = [
                x for c, x in zip(self._prod_cat, self._prod, strict=True) if cat == ALL or c == ci
            ]
            production[cat] = lt.ProductionLoad.of(values)
        backends = tuple(sorted(self._first, key=lambda b: self._first[b]))
        cells: dict[tuple[str, str], lt.Cell] = {}
        exclusions: dict[str, dict[str, Counter[str]]] = {}
        for b in backends:
            cols = self._pairs.get(b, _Pairs())
            for cat in [*cats, ALL]:
                ci = self._cats.get(cat)
                rows = [i for i, c in enumerate(cols.cats) if cat == ALL or c == ci]
                cells[(b, cat)] = lt.Cell.of_columns(
                    production=[cols.production[i] for i in rows],
                    parity=[_v(cols.parity[i]) for i in rows],
                    candidate_load=[_v(cols.candidate_load[i]) for i in rows],
                    e2e=[_v(cols.e2e[i]) for i in rows],
                    tpot=[_v(cols.tpot[i]) for i in rows],
                    edges=production[cat].edges,
                )
            per = exclusions.setdefault(b, {})
            for (cat, code, detail), n in self._excluded.get(b, Counter()).items():
                for c in (cat, ALL):
                    per.setdefault(c, Counter())[exclusion_text(code, detail)] += n
            for cat, n in self._shadow_by_cat.items():
                counted = sum(
                    k for (c, _, _), k in self._excluded.get(b, Counter()).items() if c == cat
                )
                if n > counted:
                    for c in (cat, ALL):
                        per.setdefault(c, Counter())[exclusion_text("not_mirrored", "")] += (
                            n - counted
                        )
        return Population(
            records=self.records,
            shadow=self.shadow,
            categories=tuple(cats),
            backends=backends,
            production=production,
            cells=cells,
            exclusions=exclusions,
        )


def population_of(records: Iterable[Record | Mapping[str, Any]]) -> Population:
    fold = PopulationFold()
    for r in records:
        fold.add(r)
    return fold.result()


class _Sample:
    """The exchange ids of the ``size`` records with the lowest :func:`sample_key`: 16 bytes of
    key and the id per kept record while the stream runs; the records are read afterwards."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: list[tuple[bytes, str]] = []
        self._cut: bytes | None = None  # keys at or above this cannot enter

    def add(self, r: Record) -> None:
        exchange_id = r.exchange_id
        key = sample_key(exchange_id)
        if self._cut is not None and key >= self._cut:
            return
        self._kept.append((key, exchange_id))
        if len(self._kept) >= 2 * self.size:
            self._trim()

    def _trim(self) -> None:
        self._kept.sort(key=lambda kv: kv[0])
        del self._kept[self.size :]
        if len(self._kept) == self.size:
            self._cut = self._kept[-1][0]

    def ids(self) -> set[str]:
        self._trim()
        return {exchange_id for _, exchange_id in self._kept}


def gather(
    sources: Sequence[str],
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    sample: int = SAMPLE,
) -> tuple[Population, list[dict[str, Any]]]:
    """The window's population and its bounded sample, streamed once through
    :class:`PopulationFold` from any record sources (the engine is chosen above this module:
    :func:`report.gather.gather`)."""
    from records.readback import iter_records
    from records.rules import canonical_key

    fold, kept = PopulationFold(), _Sample(sample)
    for raw in iter_records(
        list(sources), since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns
    ):
        r = read(raw)
        fold.add(r)
        kept.add(r)
    # A second pass for the sample's records: by the id index in SQLite, a filtered re-read of
    # files. Keeping them as the first pass went would hold up to twice the sample's JSON.
    wanted = kept.ids()
    again = iter_records(
        list(sources), since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, exchange_ids=wanted
    )
    return fold.result(), sorted(again, key=canonical_key)
