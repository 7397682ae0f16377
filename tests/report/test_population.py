"""The report's population on every engine, the bounded sample, and the load-true interval's
coverage on a truth the test knows.

The population (counts, production's load strata, per-stratum sums of log speed-ups, exclusions)
is computed twice — a streaming fold in Python (SQLite, JSON Lines, lists) and SQL in the engine
(chDB, a ClickHouse server) — and both must give the same numbers on the same messy records:
several candidates, drops, failed legs, canary-served exchanges, requests that skip speculation,
legs without load, parity outside the band, an uncategorized exchange.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from records.stores import copy_records, open_column_store
from report import build_report, load as lt
from report.aggregates import Population
from report.analysis import analyze
from report.gather import gather
from report.population import population_of
from tests.receivers.clickhouse import ClickHouseServer, requires_clickhouse
from tests.report.synthetic import leg

CANDIDATES = {"spec-a": 1.4, "spec-b": 0.9}  # true e2e speed-ups


def messy(n: int = 400, seed: int = 11) -> list[dict[str, Any]]:
    """Records from a fleet with every kind of exchange the report must sort out."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cat = rng.choice(["chat", "code", "summarize", None])
        rate = rng.uniform(2.0, 20.0)
        tokens = rng.randint(5, 200)
        e2e = 0.05 + tokens * 0.01 * math.exp(rng.gauss(0, 0.2))
        prim = leg("primary", ttft=0.05, e2e=e2e, tokens=tokens, tpe=1.0, rate=rate)
        if i % 53 == 0:
            prim = leg("primary", ttft=0.05, e2e=e2e, tokens=tokens, tpe=1.0, status=502)
        if i % 61 == 0:
            prim.pop("load", None)  # no load data for production
        legs = [prim]
        dropped = []
        for backend, speedup in CANDIDATES.items():
            roll = rng.random()
            if roll < 0.15:
                continue  # not mirrored
            if roll < 0.22:
                dropped.append({"backend": backend, "role": "candidate", "reason": "budget"})
                continue
            parity = rng.choice([1.0, 1.0, 1.0, 1.1, 0.85, 1.6, 0.5, None])
            cand_e2e = e2e / speedup * math.exp(rng.gauss(0, 0.1))
            status = 500 if rng.random() < 0.05 else 200
            c = leg(
                "candidate", ttft=0.04, e2e=cand_e2e, tokens=tokens, tpe=2.0,
                rate=rate * (parity or 1.0), parity=parity, status=status,
            )  # fmt: skip
            c["backend"] = backend
            if parity is None:
                c["load_parity"] = None
            legs.append(c)
        rec: dict[str, Any] = {
            "schema": "specshadow.record/1",
            "exchange_id": f"x-{i:05d}",
            "started_unix_ns": 1_800_000_000_000_000_000 + 1_000_000 * i,
            "legs": legs,
            "sampling": {"dropped": dropped, "candidates": list(CANDIDATES)},
            "comparisons": [],
        }
        if cat is not None:
            rec["category"] = cat
        if i % 37 == 0:
            rec["speculation_skip"] = "penalty"
        if i % 41 == 0:
            rec["served_by"] = "spec-a"  # a canary answered this one
        out.append(rec)
    return out


def same(a: Any, b: Any, path: str = "population") -> None:
    """Equal, floats within 1e-9 relative (sums in another order), NaN equal to NaN."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            if f.name != "engine":
                same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_bytes(b"".join(jsonx.dumps(r) + b"\n" for r in records))
    return str(path)


def stores(tmp_path: Path, records: list[dict[str, Any]]) -> dict[str, str]:
    jsonl = write_jsonl(tmp_path / "records.jsonl", records)
    sqlite, chdb = str(tmp_path / "records.sqlite"), f"chdb://{tmp_path}/chdb"
    copy_records(jsonl, sqlite)
    copy_records(jsonl, chdb)
    return {"jsonl": jsonl, "sqlite": sqlite, "chdb": chdb}


def test_every_engine_sums_the_same_population_and_draws_the_same_sample(tmp_path: Path) -> None:
    records = messy()
    truth = population_of(records)
    # The messy cases are really there.
    assert truth.records == len(records) > truth.shadow
    assert truth.backends == tuple(CANDIDATES)
    excluded = truth.exclusions["spec-a"]["all"]
    for reason in ("dropped (budget)", "not mirrored to this candidate", "matched",
                   "load parity outside ±25%", "no load data", "primary completed"):  # fmt: skip
        assert excluded[reason] > 0, reason
    assert "uncategorized" in truth.categories
    assert sum(excluded.values()) == truth.shadow

    expected: list[str] | None = None
    for name, source in stores(tmp_path, records).items():
        pop, sample = gather([source], sample=60)
        same(pop, truth, name)
        assert pop.engine == ("chdb" if name == "chdb" else "python")
        ids = sorted(r["exchange_id"] for r in sample)
        expected = ids if expected is None else expected
        assert len(ids) == 60 and ids == expected, name


def test_a_column_store_holding_exchanges_twice_counts_each_once(tmp_path: Path) -> None:
    """A copy run twice (or a retried insert) leaves each exchange in two rows until the engine
    merges them: the aggregates then read with ``FINAL`` and still count every exchange once."""
    records = messy()
    jsonl = write_jsonl(tmp_path / "records.jsonl", records)
    chdb = f"chdb://{tmp_path}/chdb"
    copy_records(jsonl, chdb)
    copy_records(jsonl, chdb)
    store = open_column_store(chdb)
    try:
        stored = int(store.engine.execute("SELECT count() FROM records").strip())
    finally:
        store.close()
    assert stored == 2 * len(records)  # not merged yet: the reader must collapse them
    pop, sample = gather([chdb], sample=60)
    same(pop, population_of(records), "chdb, every row twice")
    assert len({r["exchange_id"] for r in sample}) == len(sample) == 60


@requires_clickhouse
def test_a_clickhouse_server_sums_the_same_population(
    tmp_path: Path,
) -> None:
    from records.stores import open_writer

    records = messy(seed=12)
    with ClickHouseServer(tmp_path / "ch") as server:
        url = server.url("pop")
        open_writer(url).close()  # creates the table
        copy_records(write_jsonl(tmp_path / "r.jsonl", records), url)
        pop, sample = gather([url], sample=80)
        same(pop, population_of(records), "server")
        _, local = gather([str(tmp_path / "r.jsonl")], sample=80)
        assert [r["exchange_id"] for r in sample] == [r["exchange_id"] for r in local]


def test_a_sampled_report_keeps_the_whole_windows_verdict_numbers(tmp_path: Path) -> None:
    """Detail sections read 60 exchanges; the load-true speed-ups and exclusions still count all
    400, and equal the report over every record."""
    records = messy()
    source = stores(tmp_path, records)["sqlite"]
    pop, sample = gather([source], sample=60)
    whole, part = analyze(records), analyze(sample, population=pop)
    assert part.records == whole.records == len(records) and part.sample == 60
    assert whole.sample is None
    for b in CANDIDATES:
        for cat in [*whole.categories, "all"]:
            same(part.candidates[b].load[cat], whole.candidates[b].load[cat], f"{b}/{cat}")
        assert part.candidates[b].exclusions == whole.candidates[b].exclusions
        assert [v.decision for v in part.candidates[b].verdicts] == [
            v.decision for v in whole.candidates[b].verdicts
        ]
    paths = build_report(sample, None, tmp_path / "out", population=pop)
    report = jsonx.loads(paths.json.read_bytes())
    assert report["records"] == len(records) and report["sample"] == 60
    assert any("sample of 60" in note for note in report["notes"])


def test_the_load_true_interval_covers_the_truth_at_its_nominal_rate() -> None:
    """Pairs whose log speed-up has a known mean per production-load stratum (speculation pays
    less at higher load), production's load known: the estimate is the production-weighted
    geometric mean; its 95 % interval must hold the truth in about 95 % of 400 runs (binomial
    sd 1.1 points: 91–98.5 % is a ±3 sd band) and its centre must be unbiased."""
    rng = random.Random(5)
    effects = [0.5, 0.3, 0.1, -0.1]  # log speed-up per load quartile
    production = [rng.uniform(0, 40) for _ in range(4000)]
    hits, errors = 0, []
    for _ in range(400):
        pairs = []
        for _ in range(120):
            load = rng.uniform(0, 40)  # the mirror sees production's load distribution
            effect = effects[min(3, int(load // 10))]
            ref = 1.0
            cand = ref / math.exp(effect + rng.gauss(0, 0.3))
            pairs.append(lt.Pair(ref, cand, None, None, load, load, None, 1.0, None, 0))
        est = lt.load_true(production, pairs).e2e
        assert est is not None
        # Truth: production's share per quartile (the edges are production's own quartiles).
        edges = lt.ProductionLoad.of(production).edges
        shares = [0.0] * 4
        for x in production:
            shares[lt.stratum_of(x, edges)] += 1 / len(production)
        # Each stratum's mean effect over the uniform load inside it.
        cuts = [0.0, *edges, 40.0]
        truth = 0.0
        for s in range(4):
            lo, hi = cuts[s], cuts[s + 1]
            inside = sum(
                e * max(0.0, min(hi, 10 * (k + 1)) - max(lo, 10 * k)) for k, e in enumerate(effects)
            ) / (hi - lo)
            truth += shares[s] * inside
        hits += est.low <= math.exp(truth) <= est.high
        errors.append(math.log(est.estimate) - truth)
    assert 0.91 <= hits / 400 <= 0.985
    assert abs(sum(errors) / len(errors)) < 0.01  # unbiased: mean error ≪ the 0.03 sd per run


def test_population_of_nothing_is_empty_and_reports_nothing() -> None:
    pop = population_of([])
    assert pop == Population(0, 0, (), (), pop.production, {}, {})
    assert analyze([], population=pop).candidates == {}


@pytest.mark.parametrize(
    "brackets",
    [(0.02, 0.1), (1e-9,), (0.5,)],
    ids=["default", "always-missed", "wide"],
)
def test_the_engines_order_statistics_are_exact_whatever_the_brackets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, brackets: tuple[float, ...]
) -> None:
    """The engine's percentiles (a sampled bracket, then only the values inside it sorted) equal
    :func:`core.stats.percentile` over the same values: with ties, nulls, one value, negative
    values, and brackets that always miss (every target then falls back to the whole range)."""
    from core.stats import percentile
    from report import sql

    monkeypatch.setattr(sql, "_BRACKETS", brackets)

    def value(i: int) -> float | None:
        g = i % 4
        if i % 7 == 0:
            return None
        if g == 0:
            return ((i * 7919) % 1000) / 10 - 30  # spread, negative too
        if g == 1:
            return float(i % 3)  # three values, heavy ties
        if g == 2:
            return 5.5  # one value
        return math.exp(((i * 104729) % 997) / 100)  # long right tail

    n = 30_000
    source = (
        "SELECT toString(number % 4) AS g, multiIf(number % 7 = 0, NULL,"
        " number % 4 = 0, ((number * 7919) % 1000) / 10 - 30,"
        " number % 4 = 1, toFloat64(number % 3), number % 4 = 2, 5.5,"
        f" exp(((number * 104729) % 997) / 100)) AS v FROM numbers({n})"
    )
    from records.stores import open_writer

    open_writer(f"chdb://{tmp_path}/chdb").close()  # an empty store: the source is generated
    store = open_column_store(f"chdb://{tmp_path}/chdb")
    try:
        stats = sql._Query(store, None, None).order_stats(
            source, ("g",), ("v",), (0, 5, 50, 95, 100)
        )
    finally:
        store.close()
    for g in range(4):
        values = [v for i in range(n) if i % 4 == g and (v := value(i)) is not None]
        count, got = stats[(str(g),)][0]
        assert count == len(values)
        for q, x in zip((0, 5, 50, 95, 100), got, strict=True):
            want = percentile(values, q)
            assert x is not None and want is not None
            assert math.isclose(x, want, rel_tol=1e-12, abs_tol=1e-12), (g, q, x, want)
