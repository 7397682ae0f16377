"""The report and the record stores at fleet scale: what a report costs per record on each
engine, how fast each store takes records, and what an aggregate costs in the column engine.

```
.venv/bin/python -m bench.report_scale [--seed STORE] [--sizes 10000,30000,100000]
    [--aggregate-rows 10000000] [--no-clickhouse] [--json FILE]
.venv/bin/python -m bench.report_scale --fleet 1000000 [--fleet-chdb 10000000] [--seed STORE]
    [--sample 5000] [--work DIR] [--keep]
```

- **Seed**: the records of a real gateway run (``--seed``; default: the demo's records, made by
  ``specshadow demo`` into a temporary folder). Each size replicates them, cycling, with a fresh
  exchange id and start time per copy (5 ms apart), so the report sees N distinct exchanges
  with real records' shapes and sizes.
- **Insert**: the replicated records into SQLite (``RecordStore.append``, batches of 10,000),
  into chDB and into a ClickHouse server (``records copy``'s path: ``JSONEachRow`` batches of
  5,000) — records per second, against the gateway's record rate.
- **Report**: ``specshadow report`` over the SQLite store and over the same records in chDB, each
  in a child process: wall time and the child's peak RSS (``wait4``). A size whose predicted
  RSS (from the previous size's bytes per record) exceeds 80 % of this machine's available
  memory is not run, and the table says so.
- **Aggregate**: the shape of an in-engine report — per category × leg role: count, mean and
  exact p50/p90/p99 of TTFT and TPOT, the paired primary/candidate TPOT log-ratio's mean and
  variance — over ``--aggregate-rows`` wide rows in chDB (the seed's typed columns replicated in
  the engine; the JSON ``record`` column left empty, since aggregates never read it): seconds
  and this process's RSS.

- **Fleet** (``--fleet N``): the issue's targets. N replicated records into SQLite, reported
  from there (target: ≤ 1 GB peak RSS); the same store copied into chDB by ``records copy``'s
  path and reported from there; the two ``report.json`` compared (every verdict identical, every
  number under ``candidates`` within 1 %); then the chDB store grown in the engine to
  ``--fleet-chdb`` rows (each row copied with a fresh exchange id, also inside its JSON, and a
  later time) and reported again (targets: ≤ 60 s, ≤ 1 GB client RSS).

Nothing here is a pass/fail test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.tables import load_line, machine, render_table, write_json
from core import jsonx
from records.readback import read_records
from records.sqlite_store import RecordStore
from records.stores import copy_records

GATEWAY_RECORD_RATE = 200.0  # records/s: one replica of a 200 req/s fleet mirroring everything


def seed_records(seed: str | None, work: Path) -> list[dict[str, Any]]:
    if seed is not None:
        return read_records([seed])
    out = work / "demo"
    subprocess.run(
        [sys.executable, "-m", "specshadow", "demo", "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return read_records([out / "records.sqlite"])


def replicate(seed: Sequence[Mapping[str, Any]], n: int, start_ns: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        r = dict(seed[i % len(seed)])
        r["exchange_id"] = f"{i:032x}"
        r["started_unix_ns"] = start_ns + i * 5_000_000
        yield r


def insert_sqlite(path: Path, records: Iterator[dict[str, Any]]) -> tuple[int, float]:
    store = RecordStore(path, max_rows=None, max_age_s=None)
    n, t0, batch = 0, time.perf_counter(), []
    for r in records:
        batch.append(r)
        if len(batch) == 10_000:
            store.append(batch)
            n += len(batch)
            batch = []
    store.append(batch)
    n += len(batch)
    store.close()
    return n, time.perf_counter() - t0


def _hwm_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child(argv: Sequence[str]) -> tuple[int, float, int]:
    """Run ``argv``; (exit status, wall seconds, peak RSS bytes of the child).

    The peak is the child's own ``VmHWM``, polled until it exits: ``wait4``'s ``ru_maxrss``
    would also count the pages the child shared with this process before its ``exec`` (Linux
    keeps the larger high-water mark across ``exec``), and this process holds chDB.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        hwm = _hwm_bytes(proc.pid)
        peak = max(peak, hwm or 0)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    if proc.returncode != 0 and err:
        print(err.splitlines()[-1], file=sys.stderr)
    return proc.returncode, wall, peak


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


AGGREGATE = """
SELECT category, role,
       count() AS n,
       avg(ttft) AS ttft_mean, quantilesExact(0.5, 0.9, 0.99)(ttft) AS ttft_q,
       avg(tpot) AS tpot_mean, quantilesExact(0.5, 0.9, 0.99)(tpot) AS tpot_q
FROM (
  SELECT ifNull(category, 'uncategorized') AS category, role, ttft, tpot
  FROM records
  ARRAY JOIN legs_role AS role, legs_ttft_s AS ttft, legs_tpot_s AS tpot
)
GROUP BY category, role ORDER BY category, role
FORMAT JSONEachRow
"""
PAIRED = """
SELECT ifNull(category, 'uncategorized') AS category,
       count() AS n, avg(d) AS mean_log_ratio, varSamp(d) AS var_log_ratio
FROM (
  SELECT category,
         log(legs_tpot_s[indexOf(legs_role, 'primary')] / legs_tpot_s[indexOf(legs_role, 'candidate')]) AS d
  FROM records
  WHERE has(legs_role, 'candidate') AND has(legs_role, 'primary')
)
WHERE isFinite(d)
GROUP BY category ORDER BY category
FORMAT JSONEachRow
"""


_QUERY_CHILD = """
import sys, time
from bench.report_scale import AGGREGATE, PAIRED
from records.clickhouse import ChdbEngine
engine = ChdbEngine(sys.argv[1])
exact = sys.argv[2] == "exact"
sql = AGGREGATE if exact else AGGREGATE.replace("quantilesExact", "quantilesTDigest")
t0 = time.perf_counter()
first = engine.execute(sql.replace("FROM records", "FROM big"))
second = engine.execute(PAIRED.replace("FROM records", "FROM big"))
print(time.perf_counter() - t0, len(first.splitlines()) + len(second.splitlines()))
engine.close()
"""


def aggregate_chdb(folder: str, rows: int) -> dict[str, Any]:
    """Replicate the typed columns to ``rows`` rows in the engine, then time the two aggregates
    in a fresh process (chDB runs in the client's process: its peak RSS is the client's)."""
    from records.clickhouse import ChdbEngine

    engine = ChdbEngine(folder)
    try:
        seed = int(engine.execute("SELECT count() FROM records").strip())
        times = max(1, rows // max(seed, 1))
        engine.execute(
            "CREATE TABLE IF NOT EXISTS big AS records ENGINE = MergeTree"
            " PARTITION BY day ORDER BY (time_unix_ns, exchange_id)"
        )
        engine.execute("TRUNCATE TABLE big")
        t0 = time.perf_counter()
        engine.execute(
            "INSERT INTO big SELECT * REPLACE (concat(exchange_id, toString(k)) AS exchange_id,"
            " time_unix_ns + k * 1000 AS time_unix_ns, '' AS record)"
            f" FROM records ARRAY JOIN range({times}) AS k"
        )
        build_s = time.perf_counter() - t0
        n = int(engine.execute("SELECT count() FROM big").strip())
    finally:
        engine.close()
    out: dict[str, Any] = {"rows": n, "build_s": build_s}
    for kind in ("exact", "tdigest"):
        argv = [sys.executable, "-c", _QUERY_CHILD, folder, kind]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _hwm_bytes(proc.pid) or 0)
            time.sleep(0.05)
        text, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(err.strip().splitlines()[-1] if err.strip() else "query failed")
        query_s, groups = text.split()
        out[kind] = {"query_s": float(query_s), "groups": int(groups), "rss": peak,
                     "process_s": time.perf_counter() - t0}  # fmt: skip
    out["groups"] = out["exact"]["groups"]
    return out


def numbers(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a JSON value, by path."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{path}[{i}]")
    else:
        yield path, value


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Verdicts, recommendation and every number of the candidates' sections: how far apart."""
    left = dict(numbers({"candidates": a["candidates"], "recommendation": a["recommendation"]}))
    right = dict(numbers({"candidates": b["candidates"], "recommendation": b["recommendation"]}))
    verdicts = sorted(p for p in left if p.endswith(".verdict"))
    worst, where, different = 0.0, "", []
    for path in sorted(set(left) | set(right)):
        x, y = left.get(path), right.get(path)
        if isinstance(x, float | int) and isinstance(y, float | int) and not isinstance(x, bool):
            rel = abs(x - y) / max(abs(x), abs(y), 1e-12)
            if rel > worst:
                worst, where = rel, path
        elif x != y:
            different.append(path)
    return {
        "verdicts": {p: left[p] for p in verdicts},
        "verdicts_equal": all(left.get(p) == right.get(p) for p in verdicts)
        and len(verdicts) == len([p for p in right if p.endswith(".verdict")]),
        "max_relative_difference": worst,
        "max_at": where,
        "other_differences": different,
    }


_GROW_CHILD = """
import sys
from records.clickhouse import ChdbEngine
engine = ChdbEngine(sys.argv[1])
seed, copies = int(engine.execute("SELECT count() FROM records").strip()), int(sys.argv[2])
span = int(engine.execute("SELECT max(time_unix_ns) - min(time_unix_ns) + 1 FROM records").strip())
for k in range(1, copies):
    # One copy at a time keeps the engine's memory one copy's worth; the id inside the JSON
    # changes with the column, so the sampled records are distinct exchanges too.
    # Each level's REPLACE reads only the column it replaces: an alias shadows its column for
    # the rest of its query (a WHERE on the id would read the new one).
    shift = k * span
    engine.execute(
        "INSERT INTO records SELECT * REPLACE (concat(exchange_id, '-%d') AS exchange_id,"
        " time_unix_ns + %d AS time_unix_ns) FROM ("
        "SELECT * REPLACE (toDate(intDiv(time_unix_ns + %d, 1000000000)) AS day) FROM ("
        "SELECT * REPLACE (replaceOne(record, concat(char(34), exchange_id, char(34)),"
        " concat(char(34), exchange_id, '-%d', char(34))) AS record)"
        " FROM records WHERE position(exchange_id, '-') = 0))" % (k, shift, shift, k)
    )
print(int(engine.execute("SELECT count() FROM records").strip()))
engine.close()
"""


def fleet(
    seed: Sequence[Mapping[str, Any]], n: int, grow_to: int, work: Path, sample: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"records": n}
    sqlite = work / "fleet.sqlite"
    count, insert_s = insert_sqlite(sqlite, replicate(seed, n, time.time_ns() - n * 5_000_000))
    out["sqlite_insert_per_s"] = count / insert_s
    print(f"fleet: {count} records into SQLite in {insert_s:.0f} s; {load_line('now')}")
    reports: dict[str, Any] = {}

    def report(label: str, store: str) -> None:
        folder = work / f"fleet-{label}"
        status, wall, rss = child(
            [sys.executable, "-m", "specshadow", "report", "--store", store,
             "--sample", str(sample), "--out", str(folder)]
        )  # fmt: skip
        out[label] = {"status": status, "wall_s": wall, "rss": rss}
        print(f"fleet: report {label}: exit {status}, {wall:.1f} s, {rss / 2**20:.0f} MiB")
        if status == 0:
            reports[label] = jsonx.loads((folder / "report.json").read_bytes())

    report("sqlite", str(sqlite))
    chdb_dir = work / "fleet-chdb-store"
    t0 = time.perf_counter()
    copy_records(str(sqlite), f"chdb://{chdb_dir}")
    out["chdb_copy_per_s"] = n / (time.perf_counter() - t0)
    report("chdb", f"chdb://{chdb_dir}")
    if "sqlite" in reports and "chdb" in reports:
        out["sqlite_vs_chdb"] = compare_reports(reports["sqlite"], reports["chdb"])
        print(f"fleet: SQLite vs chDB: {out['sqlite_vs_chdb']}")
    sqlite.unlink()
    if grow_to > n:
        t0 = time.perf_counter()
        grown = subprocess.run(
            [sys.executable, "-c", _GROW_CHILD, str(chdb_dir), str(-(-grow_to // n))],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        out["grown_rows"] = int(grown.stdout.split()[-1])
        out["grow_s"] = time.perf_counter() - t0
        print(f"fleet: chDB grown to {out['grown_rows']} rows in {out['grow_s']:.0f} s")
        report("chdb_grown", f"chdb://{chdb_dir}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.report_scale", description=__doc__.splitlines()[0])
    p.add_argument("--seed", default=None, help="a record store to replicate (default: the demo's)")
    p.add_argument("--sizes", default="10000,30000,100000", help="record counts, comma-separated")
    p.add_argument("--aggregate-rows", type=int, default=10_000_000)
    p.add_argument("--no-clickhouse", action="store_true", help="skip the ClickHouse server arm")
    p.add_argument("--json", default=None, help="also write the figures as JSON")
    p.add_argument("--fleet", type=int, default=0, help="run only the fleet arm, at N records")
    p.add_argument("--fleet-chdb", type=int, default=0, help="grow the fleet's chDB store to N")
    p.add_argument("--sample", type=int, default=5000, help="the fleet reports' --sample")
    p.add_argument(
        "--work", default=None, help="a folder for the stores (default: a temporary one)"
    )
    p.add_argument("--keep", action="store_true", help="keep the stores (to profile them after)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    info = machine()
    print(f"machine: {info['cpus']} CPUs, {info['platform']}; {load_line('start')}")
    work = Path(tempfile.mkdtemp(prefix="report-scale-", dir=args.work))
    result: dict[str, Any] = {"machine": info, "sizes": [], "insert": [], "aggregate": None}
    try:
        seed = seed_records(args.seed, work)
        raw = sum(len(jsonx.dumps(r)) for r in seed) / len(seed)
        print(f"seed: {len(seed)} records, {raw / 1024:.1f} KiB of JSON each")
        if args.fleet:
            result["fleet"] = fleet(seed, args.fleet, args.fleet_chdb, work, args.sample)
            sizes = []
        bytes_per_record: dict[str, float] = {}
        rows = []
        for n in sizes:
            sqlite = work / f"r{n}.sqlite"
            count, insert_s = insert_sqlite(
                sqlite, replicate(seed, n, time.time_ns() - n * 5_000_000)
            )
            result["insert"].append(
                {"engine": "sqlite", "records": count, "per_s": count / insert_s}
            )
            chdb = f"chdb://{work}/c{n}"
            t0 = time.perf_counter()
            copy_records(str(sqlite), chdb)
            chdb_s = time.perf_counter() - t0
            result["insert"].append({"engine": "chdb", "records": count, "per_s": count / chdb_s})
            for engine, store in (("sqlite", str(sqlite)), ("chdb", chdb)):
                predicted = bytes_per_record.get(engine, 0.0) * n
                if predicted > 0.8 * available_bytes():
                    rows.append(
                        [engine, n, "not run", f"predicted {predicted / 2**30:.1f} GiB", "", ""]
                    )
                    continue
                status, wall, rss = child(
                    [sys.executable, "-m", "specshadow", "report", "--store", store,
                     "--out", str(work / f"out-{engine}-{n}")]
                )  # fmt: skip
                bytes_per_record[engine] = rss / n
                entry = {
                    "engine": engine,
                    "records": n,
                    "status": status,
                    "wall_s": wall,
                    "rss": rss,
                }
                result["sizes"].append(entry)
                rows.append([engine, n, f"{wall:.1f} s", f"{rss / 2**20:.0f} MiB",
                             f"{rss / n / 1024:.1f} KiB", f"{wall / n * 1e6:.0f} µs"])  # fmt: skip
            shutil.rmtree(work / f"c{n}", ignore_errors=True)
        print(
            render_table(
                "report",
                ["engine", "records", "wall", "peak RSS", "RSS/record", "wall/record"],
                rows,
            )
        )
        if sizes and not args.no_clickhouse and shutil.which("clickhouse-server"):
            from tests.receivers.clickhouse import ClickHouseServer

            with ClickHouseServer(work / "clickhouse") as server:
                n = sizes[0]
                t0 = time.perf_counter()
                copy_records(str(work / f"r{n}.sqlite"), server.url("bench"))
                s = time.perf_counter() - t0
                result["insert"].append(
                    {"engine": "clickhouse 18.16", "records": n, "per_s": n / s}
                )
        print(render_table(
            f"insert (the gateway writes about {GATEWAY_RECORD_RATE:.0f} records/s per replica at 200 req/s)",
            ["engine", "records", "records/s", "× gateway rate"],
            [[i["engine"], i["records"], f"{i['per_s']:.0f}", f"{i['per_s'] / GATEWAY_RECORD_RATE:.0f}×"]
             for i in result["insert"]],
        ))  # fmt: skip
        if sizes and args.aggregate_rows:
            folder = f"{work}/agg"
            copy_records(str(work / f"r{sizes[0]}.sqlite"), f"chdb://{folder}")
            agg = aggregate_chdb(folder, args.aggregate_rows)
            result["aggregate"] = agg
            print(render_table(
                f"in-engine aggregates over {agg['rows']} wide rows in chDB (built in {agg['build_s']:.1f} s):"
                " per category × role count, mean, p50/p90/p99 of TTFT and TPOT; paired TPOT log-ratio",
                ["quantiles", "query", "whole process", "process peak RSS"],
                [[kind, f"{agg[kind]['query_s']:.1f} s", f"{agg[kind]['process_s']:.1f} s",
                  f"{agg[kind]['rss'] / 2**20:.0f} MiB"] for kind in ("exact", "tdigest")],
            ))  # fmt: skip
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
