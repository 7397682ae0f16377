"""One /metrics for several workers (otel.multiproc): real Telemetry objects, each with the
reader a worker of ``serve --workers N`` gets, sharing one folder.

The oracle is independent of the merge: every worker's own exposition (its plain pull
collection rendered as text) is parsed with ``prometheus_client``'s parser and summed per
series here; the merged exposition must equal those sums (counters, histogram buckets, sums and
counts), carry each worker's gauges under its own ``specshadow_worker`` label, and never go
backwards when a worker is retired.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel.multiproc import FleetPullReader, retire
from otel.prometheus import PullMetricReader, render
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from otel.telemetry import Telemetry
from tests.otel.exchanges import make_exchange

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: bytes) -> tuple[Series, dict[str, str]]:
    """(sample name + labels → value, family name → type)."""
    series: Series = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text.decode()):
        types[family.name] = family.type
        for s in family.samples:
            series[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return series, types


def own_text(reader: FleetPullReader) -> bytes:
    """This worker alone, as a single-process gateway would expose it."""
    return render(PullMetricReader.collect_now(reader))


class Worker:
    def __init__(self, folder: Path, index: int, pid: int) -> None:
        self.reader = FleetPullReader(folder, worker=index, pid=pid)
        self.telemetry: Telemetry = build_telemetry(TelemetrySettings(), pull_reader=self.reader)
        self.reader.start()


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    # Unix socket paths are limited to ~108 bytes; tmp_path can be long.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mp-") as d:
        yield Path(d)


def traffic(w: Worker, sampled: int, exchanges: int, breaker: int) -> None:
    for _ in range(sampled):
        w.telemetry.count_shadow("sampled", role="candidate", backend="cand")
    for _ in range(exchanges):
        w.telemetry.record_exchange_metrics(make_exchange())
    w.telemetry.set_breaker_state("cand", breaker)


def expected_sum(texts: list[bytes], types: dict[str, str]) -> Series:
    """Counters and histograms summed across workers, from each worker's own text."""
    out: Series = defaultdict(float)
    for text in texts:
        series, _ = parse(text)
        for (name, labels), value in series.items():
            family = next(f for f in types if name == f or name.startswith(f + "_"))
            if types[family] in ("counter", "histogram"):
                out[(name, labels)] += value
    return dict(out)


def counters_and_histograms(series: Series, types: dict[str, str]) -> Series:
    keep = {f for f, t in types.items() if t in ("counter", "histogram")}
    return {
        k: v
        for k, v in series.items()
        if any(k[0] == f or k[0].startswith(f + "_") for f in keep)
        and not k[0].endswith("_created")
    }


def test_a_scrape_of_any_worker_sums_every_worker_and_keeps_gauges_apart(folder: Path) -> None:
    workers = [Worker(folder, 0, 1000), Worker(folder, 1, 1001), Worker(folder, 2, 1002)]
    try:
        traffic(workers[0], sampled=3, exchanges=2, breaker=0)
        traffic(workers[1], sampled=5, exchanges=1, breaker=2)
        traffic(workers[2], sampled=0, exchanges=4, breaker=1)
        texts = [own_text(w.reader) for w in workers]
        _, types = parse(texts[0] + texts[1] + texts[2])
        want = expected_sum(texts, types)
        assert want[(
            "specshadow_shadow_requests_total",
            (("specshadow_backend", "cand"), ("specshadow_leg_role", "candidate"),
             ("specshadow_outcome", "sampled")),
        )] == 8  # fmt: skip
        for w in workers:  # whichever worker answers the scrape
            got, got_types = parse(w.telemetry.render_prometheus()[0])
            assert counters_and_histograms(got, got_types) == counters_and_histograms(want, types)
            breaker = {
                dict(labels)["specshadow_worker"]: v
                for (name, labels), v in got.items()
                if name == "specshadow_shadow_breaker_state"
            }
            assert breaker == {"0": 0, "1": 2, "2": 1}
    finally:
        for w in workers:
            w.telemetry.shutdown(5.0)


def test_a_retired_worker_keeps_its_counts_and_loses_its_gauges(folder: Path) -> None:
    a, b = Worker(folder, 0, 2000), Worker(folder, 1, 2001)
    replacement: Worker | None = None
    try:
        traffic(a, sampled=2, exchanges=1, breaker=0)
        traffic(b, sampled=7, exchanges=3, breaker=2)
        before, types = parse(a.telemetry.render_prometheus()[0])
        # b counts more after the scrape, then dies: its telemetry's shutdown writes the last
        # snapshot (as a worker's does after its final drain), and the parent folds it.
        traffic(b, sampled=1, exchanges=0, breaker=2)
        b.telemetry.shutdown(5.0)
        assert retire(folder, 2001)
        assert not list(folder.glob("w1-2001.*"))
        after, _ = parse(a.telemetry.render_prometheus()[0])
        key = (
            "specshadow_shadow_requests_total",
            (("specshadow_backend", "cand"), ("specshadow_leg_role", "candidate"),
             ("specshadow_outcome", "sampled")),
        )  # fmt: skip
        assert before[key] == 9 and after[key] == 10
        for k, v in counters_and_histograms(before, types).items():
            assert after[k] >= v, k  # nothing Prometheus would read as a reset
        assert {
            dict(labels)["specshadow_worker"]
            for (name, labels) in after
            if name == "specshadow_shadow_breaker_state"
        } == {"0"}
        # The slot's new worker starts from zero; the gateway's totals go on from the retired.
        replacement = Worker(folder, 1, 2002)
        traffic(replacement, sampled=4, exchanges=0, breaker=1)
        again, _ = parse(replacement.telemetry.render_prometheus()[0])
        assert again[key] == 14
    finally:
        a.telemetry.shutdown(5.0)
        if replacement is not None:
            replacement.telemetry.shutdown(5.0)


def test_a_sibling_that_does_not_answer_is_read_as_of_its_last_snapshot(folder: Path) -> None:
    a, b = Worker(folder, 0, 3000), Worker(folder, 1, 3001)
    try:
        traffic(b, sampled=6, exchanges=0, breaker=0)
        b.reader.flush()
        # b's flush socket goes away (a hung or dying worker): its file is still read.
        assert b.reader._server is not None
        b.reader._server.shutdown()
        b.reader._server.server_close()
        b.reader.socket_path.unlink()
        traffic(b, sampled=1, exchanges=0, breaker=0)  # not flushed: not shown
        got, _ = parse(a.telemetry.render_prometheus()[0])
        sampled = [v for (n, labels), v in got.items()
                   if n == "specshadow_shadow_requests_total"
                   and ("specshadow_outcome", "sampled") in labels]  # fmt: skip
        assert sampled == [6]
    finally:
        a.telemetry.shutdown(5.0)
        b.reader._server = None
        b.telemetry.shutdown(5.0)
