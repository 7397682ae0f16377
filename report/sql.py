"""The report's population computed inside ClickHouse or chDB, over the wide table's typed columns.

The SQL twin of the Python fold (``report.population.PopulationFold``, which this module does not
import: both build :mod:`report.aggregates`' types): the same definitions (a pair, a
matched pair, a stratum, an exclusion, a percentile) written as ``GROUP BY`` queries, so Python
receives a few hundred numbers whatever the table holds. Tests hold the two to the same
population on every engine, over the same records.

Percentiles are exact and the same as :func:`core.stats.percentile`: the engine returns the two
order statistics at :func:`core.stats.percentile_ranks` and Python interpolates, so a stratum
edge is bit-for-bit the one the fold computes. It finds them without sorting every value (which
would hold a 10 M-row window's values twice in chDB's, i.e. the client's, memory): a sampled
bracket around each rank, then only the values inside it sorted (:meth:`_Query.order_stats`). Sums of log ratios may differ from the fold's
``math.fsum`` in the last bits (summation order); the estimate's tolerance is 1e-9 relative.

The queries use only functions ClickHouse 18.16 already had (``arrayFirstIndex``, ``indexOf``,
``arrayJoin``, ``groupArray``, ``arraySort``, ``multiIf``, ``MD5``), so the Debian server, a modern
one and chDB run the same text.

Scans per report: the window's counts, the candidate list, production's load (two: the bracket
and the order statistics, then its strata), the pairs' sums and the exclusions (one), the pairs'
medians (two), the sample. Measured on 10 M rows in chDB (docs/benchmarks.md): 39 s of the
report's 47 s, 0.7 GB peak.

Size: the queries and the assembly of their rows into a :class:`Population`; the record
sample is one more query.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from core import jsonx
from core.stats import interpolate, percentile_ranks
from records.clickhouse import TABLE, ClickHouseError, ClickHouseStore, _quote
from records.readback import SourceError
from records.rules import canonical_key, leg_ok_sql
from records.stores import StoreURLError, open_column_store
from report import load as lt
from report.aggregates import SAMPLE, Population, exclusion_text
from report.records import ALL

__all__ = ["gather", "population"]

_QS = (5, 25, 50, 75, 95)  # the percentiles the report reads (25/50/75: the strata edges)
# The brackets around a target rank, as a share of the values either side (reservoir sampling's
# rank error at 8,192 samples is about 0.006): tried in turn, then the whole range.
_BRACKETS = (0.02, 0.1)
_HUGE = 1e308  # beyond every finite value the report sorts
_NAN = float("nan")


def _lit(text: str) -> str:
    return f"'{_quote(text)}'"


def _float(x: float) -> str:
    return repr(float(x))


_ok = leg_ok_sql  # records.rules: Leg.ok, in SQL


# A pair (report.analysis._pairs' primary pairs): the engine decoded it speculatively, both legs
# completed with an end-to-end time, and production's load is known.
_PAIR = (
    f"(ifNull(speculation_skip, '') = '' AND {_ok('ci')} AND {_ok('pi')}"
    " AND isNotNull(legs_e2e_s[pi]) AND isNotNull(legs_e2e_s[ci]) AND isNotNull(prod))"
)


def _where(since: int | None, until: int | None) -> str:
    parts = []
    if since is not None:
        parts.append(f"time_unix_ns >= {int(since)}")
    if until is not None:
        parts.append(f"time_unix_ns < {int(until)}")
    return f" WHERE {' AND '.join(parts)}" if parts else ""


class _Query:
    """The queries over one window of one store."""

    def __init__(self, store: ClickHouseStore, since: int | None, until: int | None) -> None:
        self.store = store
        self.window = _where(since, until)
        self.table = f"{TABLE} FINAL"

    def collapse_once(self) -> None:
        """Read without ``FINAL`` when the window holds each exchange once. ``FINAL`` collapses
        an exchange written twice at read time, by merging every part's rows in key order — in
        each of a dozen aggregates. One count with ``FINAL`` against one without says whether
        there is anything to collapse; most windows have nothing (a retried insert, a copy run
        twice are the exceptions), and then the aggregates read the parts as they are."""
        (row,) = self.rows(
            f"SELECT (SELECT count() FROM {TABLE}{self.window}) AS stored,"
            f" (SELECT count() FROM {TABLE} FINAL{self.window}) AS exchanges"
        )
        if int(row["stored"]) == int(row["exchanges"]):
            self.table = TABLE

    def rows(self, sql: str) -> Iterator[dict[str, Any]]:
        for line in self.store.engine.lines(f"{sql} FORMAT JSONEachRow"):
            yield jsonx.loads(line)
        self.store.engine.release()

    def base(self, extra: str = "") -> str:
        """Shadow exchanges (the primary answered), with their category ``cat`` and primary leg
        ``pi``, production's load ``prod`` and ``g``: the category and ALL (one row each)."""
        return (
            "SELECT *, arrayJoin([cat, " + _lit(ALL) + "]) AS g FROM ("
            "SELECT exchange_id, time_unix_ns, legs_role, legs_backend, legs_outcome, legs_status,"
            " legs_error_type, legs_e2e_s, legs_tpot_s, legs_load_parity,"
            " legs_per_replica_rate_rps, speculation_skip, dropped_backends, dropped_reasons,"
            " if(ifNull(category, '') = '', 'uncategorized', category) AS cat,"
            " indexOf(legs_role, 'primary') AS pi,"
            " legs_per_replica_rate_rps[pi] AS prod"
            f"{extra}"
            f" FROM {self.table}{self.window}"
            f"{' AND' if self.window else ' WHERE'} ifNull(served_by, 'primary') = 'primary')"
        )

    def counts(self) -> tuple[int, int, list[str]]:
        (row,) = self.rows(
            "SELECT count() AS n, countIf(ifNull(served_by, 'primary') = 'primary') AS shadow,"
            " arraySort(groupUniqArrayIf(if(ifNull(category, '') = '', 'uncategorized',"
            " category), ifNull(served_by, 'primary') = 'primary')) AS cats"
            f" FROM {self.table}{self.window}"
        )
        return int(row["n"]), int(row["shadow"]), [str(c) for c in row["cats"]]

    def backends(self) -> list[str]:
        sql = (
            "SELECT b, min(tuple(time_unix_ns, exchange_id, pos)) AS first FROM ("
            "SELECT time_unix_ns, exchange_id, arrayConcat("
            "arrayFilter((b, r) -> r = 'candidate', legs_backend, legs_role),"
            " arrayFilter((b, r) -> r = 'candidate', dropped_backends, dropped_roles),"
            " candidates) AS named"
            f" FROM {self.table}{self.window}"
            f"{' AND' if self.window else ' WHERE'} ifNull(served_by, 'primary') = 'primary')"
            " ARRAY JOIN named AS b, arrayEnumerate(named) AS pos GROUP BY b ORDER BY first"
        )
        return [str(r["b"]) for r in self.rows(sql)]

    def order_stats(
        self, source: str, keys: Sequence[str], values: Sequence[str], qs: Sequence[int]
    ) -> dict[tuple[str, ...], list[tuple[int, list[float | None]]]]:
        """Per group of ``source``'s ``keys`` columns and per ``values`` expression: the count of
        its non-null values and their exact percentiles ``qs`` — the numbers
        ``arraySort(groupArray(v))`` gives, in a fraction of its memory.

        Sorting every value of a 10 M-row window holds them all, twice, in the client's process
        (chDB). Instead a first scan finds approximate quantiles (reservoir sampling) a little
        below and above each target rank; a second counts the values below each bracket, keeps
        and sorts only those inside it, and picks the two order statistics the percentile
        interpolates between. The bracket is checked in Python (the ranks must fall inside it);
        one that missed is redone with a wider one, the last being the whole range. Exact
        whatever the sampling did: it only decides how much is held."""
        levels = sorted({min(1.0, max(0.0, q / 100 + d)) for q in qs for w in _BRACKETS
                         for d in (-w, w)})  # fmt: skip
        cols = ", ".join(keys)
        typed = ", ".join(f"{v} AS v{j}" for j, v in enumerate(values))
        inner = f"SELECT {cols}, {typed} FROM ({source})"
        aggs = ", ".join(
            f"countIf(isNotNull(v{j})) AS n{j},"
            f" quantilesIf({', '.join(map(repr, levels))})(assumeNotNull(v{j}), isNotNull(v{j}))"
            f" AS a{j}"
            for j in range(len(values))
        )
        approx: dict[tuple[str, ...], list[tuple[int, list[float]]]] = {}
        for r in self.rows(f"SELECT {cols}, {aggs} FROM ({inner}) GROUP BY {cols}"):
            key = tuple(str(r[k]) for k in keys)
            approx[key] = [
                (int(r[f"n{j}"]), [_NAN if x is None else float(x) for x in r[f"a{j}"]])
                for j in range(len(values))
            ]
        out = {key: [(n, [None] * len(qs)) for n, _ in per] for key, per in approx.items()}  # type: dict[tuple[str, ...], list[tuple[int, list[float | None]]]]
        pending = {
            (key, j, i) for key, per in approx.items() for j, (n, _) in enumerate(per) if n
            for i in range(len(qs))
        }  # fmt: skip
        for width in (*_BRACKETS, None):
            if not pending:
                break
            brackets: dict[tuple[tuple[str, ...], int, int], tuple[float, float]] = {}
            for key, j, i in pending:
                if width is None:
                    brackets[(key, j, i)] = (-_HUGE, _HUGE)
                    continue
                qa = approx[key][j][1]
                below, above = qs[i] / 100 - width, qs[i] / 100 + width
                lo = -_HUGE if below <= 0 else qa[levels.index(min(1.0, below))]
                hi = _HUGE if above >= 1 else qa[levels.index(above)]
                # (an engine writes a NaN quantile as null: no bracket, the whole range)
                brackets[(key, j, i)] = (lo, hi) if lo == lo and hi == hi else (-_HUGE, _HUGE)
            got = self._inside(inner, keys, len(values), qs, brackets)
            for (key, j, i), (b, c, lo_v, hi_v) in got.items():
                n = approx[key][j][0]
                r1, r2 = percentile_ranks(n, qs[i])
                if b <= r1 and r2 < b + c:
                    out[key][j][1][i] = interpolate(n, qs[i], lo_v, hi_v)
                    pending.discard((key, j, i))
        return out

    def _inside(
        self,
        inner: str,
        keys: Sequence[str],
        nvalues: int,
        qs: Sequence[int],
        brackets: Mapping[tuple[tuple[str, ...], int, int], tuple[float, float]],
    ) -> dict[tuple[tuple[str, ...], int, int], tuple[int, int, float, float]]:
        """:meth:`order_stats`' second scan: per bracketed (group, value, target), the count
        below the bracket, the count inside it, and the two order statistics at the target's
        ranks (meaningful only when they fall inside; the caller checks)."""
        cols = ", ".join(keys)
        groups = sorted({key for key, _, _ in brackets})
        sep = _lit("\t")
        keyexpr = keys[0] if len(keys) == 1 else f"concat({f', {sep}, '.join(keys)})"
        names = ", ".join(_lit("\t".join(k)) for k in groups)
        wanted = sorted({(j, i) for _, j, i in brackets})
        aggs, picks = [f"countIf(isNotNull(v{j})) AS n{j}" for j in range(nvalues)], []
        for j, i in wanted:
            lo = ", ".join(_float(brackets.get((k, j, i), (_HUGE, -_HUGE))[0]) for k in groups)
            hi = ", ".join(_float(brackets.get((k, j, i), (_HUGE, -_HUGE))[1]) for k in groups)
            lo_e, hi_e = f"arrayElement([{lo}], kx)", f"arrayElement([{hi}], kx)"
            v = f"assumeNotNull(v{j})"
            aggs.append(f"countIf(isNotNull(v{j}) AND {v} < {lo_e}) AS b{j}_{i}")
            aggs.append(
                f"arraySort(groupArrayIf({v}, isNotNull(v{j}) AND {v} >= {lo_e}"
                f" AND {v} <= {hi_e})) AS m{j}_{i}"
            )
            rank = f"intDiv((toInt64(n{j}) - 1) * {int(qs[i])}, 100)"
            at = f"{rank} - toInt64(b{j}_{i}) + 1"
            picks.append(
                f"b{j}_{i}, length(m{j}_{i}) AS c{j}_{i},"
                f" if({at} >= 1, m{j}_{i}[greatest({at}, 1)], 0) AS lo{j}_{i},"
                f" if({at} >= 0, m{j}_{i}[least(greatest({at} + 1, 1), length(m{j}_{i}))], 0)"
                f" AS hi{j}_{i}"
            )
        sql = (
            f"SELECT {cols}, {', '.join(picks)} FROM (SELECT {cols}, {', '.join(aggs)} FROM ("
            f"SELECT *, indexOf([{names}], {keyexpr}) AS kx FROM ({inner})) WHERE kx > 0"
            f" GROUP BY {cols})"
        )
        out: dict[tuple[tuple[str, ...], int, int], tuple[int, int, float, float]] = {}
        for r in self.rows(sql):
            key = tuple(str(r[k]) for k in keys)
            for j, i in wanted:
                if (key, j, i) in brackets:
                    out[(key, j, i)] = (
                        int(r[f"b{j}_{i}"]),
                        int(r[f"c{j}_{i}"]),
                        float(r[f"lo{j}_{i}"]),
                        float(r[f"hi{j}_{i}"]),
                    )
        return out

    def percentiles(self, value: str, where: str) -> dict[str, tuple[int, list[float | None]]]:
        """Per ``g``: the count of non-null ``value`` and its percentiles :data:`_QS`."""
        source = f"SELECT g, {value} AS v FROM ({self.base()}) WHERE {where}"
        stats = self.order_stats(source, ("g",), ("v",), _QS)
        return {key[0]: per[0] for key, per in stats.items() if per[0][0]}

    def production(self, cats: Sequence[str]) -> dict[str, lt.ProductionLoad]:
        qs = self.percentiles("prod", "1")
        edges: dict[str, tuple[float, ...]] = {}
        for g in [*cats, ALL]:
            n, ps = qs.get(g, (0, [None] * len(_QS)))
            edges[g] = tuple(sorted({p or 0.0 for p in ps[1:4]})) if n else ()
        sql = (
            f"SELECT g, {self._stratum(edges)} AS stratum,"
            " count() AS n, min(prod) AS low, max(prod) AS high"
            f" FROM ({self.base()}) WHERE isNotNull(prod) GROUP BY g, stratum"
        )
        strata: dict[str, dict[int, tuple[int, float, float]]] = {}
        for r in self.rows(sql):
            strata.setdefault(str(r["g"]), {})[int(r["stratum"])] = (
                int(r["n"]),
                float(r["low"]),
                float(r["high"]),
            )
        out: dict[str, lt.ProductionLoad] = {}
        for g in [*cats, ALL]:
            n, ps = qs.get(g, (0, [None] * len(_QS)))
            if not n:
                out[g] = lt.ProductionLoad.of(())
                continue
            k = len(edges[g]) + 1
            got = strata.get(g, {})
            cells = [got.get(i, (0, float("nan"), float("nan"))) for i in range(k)]
            out[g] = lt.ProductionLoad(
                n=n,
                edges=edges[g],
                counts=tuple(c[0] for c in cells),
                lows=tuple(c[1] for c in cells),
                highs=tuple(c[2] for c in cells),
                p5=ps[0],
                p50=ps[2],
                p95=ps[4],
            )
        return out

    @staticmethod
    def _edges(edges: Mapping[str, Sequence[float]]) -> str:
        """``g``'s strata edges as one SQL array expression (an array of arrays indexed by the
        position of ``g``; no edges: the empty array)."""
        if not edges:
            return "emptyArrayFloat64()"
        names = ", ".join(_lit(g) for g in edges)
        arrays = ", ".join(
            f"[{', '.join(_float(e) for e in es)}]" if es else "emptyArrayFloat64()"
            for es in edges.values()
        )
        return f"arrayElement([{arrays}], indexOf([{names}], g))"

    @classmethod
    def _stratum(cls, edges: Mapping[str, Sequence[float]]) -> str:
        """:func:`report.load.stratum_of` of ``prod`` (how many of ``g``'s edges it lies above),
        spelled out: ClickHouse 18.16's lambdas cannot read a subquery's columns."""
        e = cls._edges(edges)
        width = max((len(es) for es in edges.values()), default=0)
        terms = [
            f"(length({e}) >= {i} AND prod > arrayElement({e}, {i}))" for i in range(1, width + 1)
        ]
        return "(" + " + ".join(terms) + ")" if terms else "0"

    def _per_backend(self, backends: Sequence[str]) -> str:
        """:meth:`base` once per candidate backend ``b``, with ``ci``: the position of that
        backend's candidate leg (its first; 0: none). One scan serves every candidate."""
        names = ", ".join(_lit(b) for b in backends)
        sep = _lit("\t")
        return (
            f"SELECT *, b, indexOf(arrayMap((r, k) -> concat(r, {sep}, k), legs_role, legs_backend),"
            f" concat('candidate', {sep}, b)) AS ci FROM ({self.base()}) ARRAY JOIN [{names}] AS b"
        )

    def _pairs(self, backends: Sequence[str]) -> str:
        """Every backend's pairs (:func:`report.analysis._pairs`' primary pairs), one row each,
        with ``b``, ``parity``, ``cload``, ``e2e`` and ``tpot`` (log speed-ups; NULL: unknown)."""
        return (
            "SELECT b, g, cat, prod, legs_load_parity[ci] AS parity,"
            " legs_per_replica_rate_rps[ci] AS cload,"
            " if(legs_e2e_s[pi] > 0 AND legs_e2e_s[ci] > 0,"
            " log(legs_e2e_s[pi] / legs_e2e_s[ci]), NULL) AS e2e,"
            " if(legs_tpot_s[pi] > 0 AND legs_tpot_s[ci] > 0,"
            " log(legs_tpot_s[pi] / legs_tpot_s[ci]), NULL) AS tpot"
            f" FROM ({self._per_backend(backends)}) WHERE {_PAIR}"
        )

    def cells(
        self,
        backends: Sequence[str],
        cats: Sequence[str],
        production: Mapping[str, lt.ProductionLoad],
    ) -> tuple[dict[tuple[str, str], lt.Cell], dict[str, dict[str, Counter[str]]]]:
        """Per backend and ``g``: the pairs' per-stratum statistics (:class:`report.load.Cell`),
        and why each shadow exchange is or is not a matched pair (the exclusions). One scan of
        every exchange per backend serves both: grouped by the exclusion's code and the pair's
        load stratum, then summed each way here."""
        if not backends:
            return {}, {}
        lo, hi = _float(1 / lt.PARITY_BAND), _float(lt.PARITY_BAND)
        parity = "legs_load_parity[ci]"
        matched = f"(isNotNull(parity) AND parity >= {lo} AND parity <= {hi})"
        stratum = self._stratum({g: p.edges for g, p in production.items()})
        ratio = "if(legs_{m}_s[pi] > 0 AND legs_{m}_s[ci] > 0, log(legs_{m}_s[pi] / legs_{m}_s[ci]), NULL)"
        rows = (
            "SELECT b, g, multiIf("
            "ci = 0 AND has(dropped_backends, b), 'dropped',"
            " ci = 0, 'not_mirrored',"
            f" NOT {_ok('pi')}, 'primary',"
            f" NOT {_ok('ci')}, 'candidate',"
            " ifNull(speculation_skip, '') != '', 'skip',"
            f" isNull({parity}), 'no_load',"
            f" {parity} < {lo} OR {parity} > {hi}, 'parity',"
            " 'matched') AS code, multiIf("
            "code = 'dropped', dropped_reasons[indexOf(dropped_backends, b)],"
            " code = 'primary', if(pi = 0, 'missing', ifNull(legs_outcome[pi], 'None')),"
            " code = 'candidate', ifNull(legs_outcome[ci], 'None'),"
            " code = 'skip', speculation_skip, '') AS detail,"
            f" toUInt8(ifNull({_PAIR}, 0)) AS pair, if(pair = 1, {stratum}, 0) AS stratum,"
            f" {parity} AS parity, {ratio.format(m='e2e')} AS e2e,"
            f" {ratio.format(m='tpot')} AS tpot"
            f" FROM ({self._per_backend(backends)})"
        )
        when = f"pair = 1 AND {matched}"
        sql = (
            "SELECT b, g, code, detail, stratum, count() AS n, countIf(pair = 1) AS pairs,"
            f" countIf({when}) AS matched,"
            f" countIf({when} AND isNotNull(e2e)) AS e2e_n,"
            f" sumIf(assumeNotNull(e2e), {when} AND isNotNull(e2e)) AS e2e_sum,"
            f" sumIf(assumeNotNull(e2e) * assumeNotNull(e2e), {when} AND isNotNull(e2e))"
            " AS e2e_sq,"
            f" countIf({when} AND isNotNull(tpot)) AS tpot_n,"
            f" sumIf(assumeNotNull(tpot), {when} AND isNotNull(tpot)) AS tpot_sum,"
            f" sumIf(assumeNotNull(tpot) * assumeNotNull(tpot), {when} AND isNotNull(tpot))"
            " AS tpot_sq"
            f" FROM ({rows}) GROUP BY b, g, code, detail, stratum"
        )
        sums = ("pairs", "matched", "e2e_n", "e2e_sum", "e2e_sq", "tpot_n", "tpot_sum", "tpot_sq")
        got: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
        exclusions: dict[str, dict[str, Counter[str]]] = {b: {} for b in backends}
        for r in self.rows(sql):
            b, g = str(r["b"]), str(r["g"])
            reason = exclusion_text(str(r["code"]), str(r["detail"] or ""))
            exclusions[b].setdefault(g, Counter())[reason] += int(r["n"])
            if int(r["pairs"]):
                slot = got.setdefault((b, g), {}).setdefault(
                    int(r["stratum"]), dict.fromkeys(sums, 0.0)
                )
                for name in sums:  # (18.16 sums no Nullable rows to null, not 0)
                    slot[name] += float(r[name] or 0)
        parity_p50, cload_p50 = self._medians(self._pairs(backends), ("parity", "cload"))
        out: dict[tuple[str, str], lt.Cell] = {}
        for b in backends:
            for g in [*cats, ALL]:
                k = len(production[g].edges) + 1
                strata = got.get((b, g), {})
                out[(b, g)] = lt.Cell(
                    mirrored=sum(int(x["pairs"]) for x in strata.values()),
                    matched=tuple(
                        int(strata[i]["matched"]) if i in strata else 0 for i in range(k)
                    ),
                    e2e=_moments(strata, "e2e", k),
                    tpot=_moments(strata, "tpot", k),
                    parity_p50=parity_p50.get((b, g)),
                    candidate_load_p50=cload_p50.get((b, g)),
                )
        return out, exclusions

    def _medians(self, pairs: str, columns: Sequence[str]) -> list[dict[tuple[str, str], float]]:
        """Per backend ``b`` and ``g``, each column's exact median (:meth:`order_stats`)."""
        stats = self.order_stats(pairs, ("b", "g"), columns, (50,))
        out: list[dict[tuple[str, str], float]] = [{} for _ in columns]
        for (b, g), per in stats.items():
            for i, (n, (median,)) in enumerate(per):
                if n and median is not None:
                    out[i][(b, g)] = median
        return out

    def sample(self, size: int) -> list[dict[str, Any]]:
        """The ``size`` exchanges with the lowest ``MD5(exchange_id)``. The JSON is read only for
        their ids (the subquery scans the key column): ordering every row's JSON by the hash
        would read the widest column of the whole window."""
        sql = (
            f"SELECT record FROM {self.table} WHERE exchange_id IN ("
            f"SELECT exchange_id FROM {self.table}{self.window}"
            f" ORDER BY MD5(exchange_id) LIMIT {int(size)})"
        )
        return sorted((jsonx.loads(r["record"]) for r in self.rows(sql)), key=canonical_key)


def _moments(rows: Mapping[int, Mapping[str, Any]], m: str, k: int) -> tuple[lt.Moments, ...]:
    """Per stratum ``0..k-1``: metric ``m``'s moments from a ``GROUP BY stratum`` row."""
    return tuple(
        lt.Moments(int(rows[i][f"{m}_n"]), float(rows[i][f"{m}_sum"]), float(rows[i][f"{m}_sq"]))
        if i in rows
        else lt.Moments()
        for i in range(k)
    )


def population(
    store: ClickHouseStore, *, since_unix_ns: int | None = None, until_unix_ns: int | None = None
) -> Population:
    """The window's :class:`Population`, summed in the engine."""
    q = _Query(store, since_unix_ns, until_unix_ns)
    q.collapse_once()
    return _population(q)


def _population(q: _Query) -> Population:
    records, shadow, cats = q.counts()
    backends = q.backends()
    production = q.production(cats)
    cells, excluded = q.cells(backends, cats, production)
    exclusions: dict[str, Mapping[str, Counter[str]]] = dict(excluded)
    return Population(
        records=records,
        shadow=shadow,
        categories=tuple(cats),
        backends=tuple(backends),
        production=production,
        cells=cells,
        exclusions=exclusions,
        engine=q.store.engine.name,
    )


def gather(
    source: str,
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    sample: int = SAMPLE,
) -> tuple[Population, list[dict[str, Any]]]:
    """The population and sample (as :func:`report.gather.gather` returns them) of one ``chdb:///`` or ``clickhouse://`` store."""
    try:
        store = open_column_store(source)
    except FileNotFoundError as exc:
        raise SourceError(f"{source}: no such store") from exc
    try:
        store.engine.reading()
        q = _Query(store, since_unix_ns, until_unix_ns)
        q.collapse_once()
        return _population(q), q.sample(sample)
    except ClickHouseError as exc:
        raise StoreURLError(f"{source}: {exc}") from exc
    finally:
        store.close()
