"""Records from a fleet: two gateway replicas, each with its own store and both exporting their
records as OTLP logs to a collector's file; reports over the parts equal the report over the
whole, duplicates and all."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core import jsonx
from gateway.settings import Settings
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from records.readback import otlp_records, read_records, records_in
from records.sqlite_store import RecordStore
from report.analysis import analyze
from specshadow.app import build_app
from specshadow.main import main as cli_main
from tests.conftest import FAST_UPSTREAM, start_server
from tests.evidence.test_worker import chat
from tests.gateway.test_shadow import policy_yaml
from tests.receivers.collector_file import CollectorFile

REQUESTS = 60
CATEGORIES = ("chat", "code", "math")


async def alternate(urls: list[str], n: int) -> None:
    """``n`` chat requests through a load balancer alternating between the replicas at ``urls``,
    categories cycling through :data:`CATEGORIES`."""
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            headers = {"x-specshadow-category": CATEGORIES[i % 3]}
            async with session.post(
                f"{urls[i % len(urls)]}/v1/chat/completions",
                json=chat(i, max_tokens=16),
                headers=headers,
            ) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture
def replicas(
    servers: list[Any], collector_file: CollectorFile, tmp_path: Path
) -> Callable[[str], Any]:
    async def start(policy_path: str) -> list[str]:
        urls = []
        for name in ("a", "b"):
            telemetry = build_telemetry(
                TelemetrySettings.from_env(
                    collector_file.env(
                        OTEL_SERVICE_NAME=f"gateway-{name}", OTEL_BLRP_SCHEDULE_DELAY="50"
                    )
                )
            )
            settings = Settings(
                policy_path=policy_path,
                store_path=str(tmp_path / f"{name}.sqlite"),
                shutdown_timeout_s=2.0,
                upstream=FAST_UPSTREAM,
            )
            server = await start_server(build_app(settings, telemetry=telemetry))
            servers.append(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        return urls

    return start


async def test_reports_over_two_replicas_stores_equal_the_report_over_one_store(
    sims: Any,
    write_policy: Callable[[str], str],
    replicas: Callable[[str], Any],
    servers: list[Any],
    collector_file: CollectorFile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    primary = await sims(step_s=0.0, prefill_base_s=0.0)
    candidate = await sims(mode="speculative", step_s=0.0, prefill_base_s=0.0)
    urls = await replicas(write_policy(policy_yaml(primary.base_url, candidate.base_url)))
    await alternate(urls, REQUESTS)
    for server in reversed(servers[-2:]):  # stop both replicas: stores flushed, logs exported
        await server.close()
    servers[-2:] = []

    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    part_a, part_b = list(records_in(a)), list(records_in(b))
    assert len(part_a) == len(part_b) == REQUESTS // 2
    assert not {r["exchange_id"] for r in part_a} & {r["exchange_id"] for r in part_b}
    whole = tmp_path / "whole.sqlite"
    store = RecordStore(whole)
    store.append(part_b + part_a)  # another order on disk: the reader sorts
    store.close()

    union = read_records([a, b])
    assert union == read_records([whole]) == read_records([b, a, whole, a])  # deduplicated
    assert len(union) == REQUESTS
    assert analyze(union) == analyze(read_records([whole]))

    # The collector's file: one OTLP/JSON object per export request, records in log bodies.
    exported = read_records([collector_file.path])
    assert exported == union
    assert read_records([collector_file.path, a, b]) == union
    line = collector_file.path.read_text().splitlines()[0]
    assert '"resourceLogs"' in line and '"timeUnixNano":"' in line  # int64 as a decimal string
    first = next(iter(otlp_records(jsonx.loads(line))))
    assert first["schema"].startswith("specshadow.record/")

    def report(*stores: Path) -> str:
        out = tmp_path / f"report-{len(stores)}-{stores[0].stem}"
        assert (
            cli_main(
                ["report", *[x for s in stores for x in ("--store", str(s))], "--out", str(out)]
            )
            == 0
        )
        capsys.readouterr()
        text = (out / "report.md").read_text()
        return re.sub(r"(?m)^.*(Generated|from store).*$", "", text)  # when and from where

    assert report(a, b) == report(whole) == report(collector_file.path)


def test_records_cli_reads_several_stores(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from evidence.worker import build_evidence
    from tests.evidence.legs import exchange

    paths = []
    for part, ids in (("a", range(6)), ("b", range(3, 10))):  # 3..5 in both
        store = RecordStore(tmp_path / f"{part}.sqlite")
        store.append([build_evidence(exchange(i, started_unix_ns=1_000 + i)).record for i in ids])
        store.close()
        paths.append(tmp_path / f"{part}.sqlite")
    args = ["records", "--store", str(paths[0]), "--store", str(paths[1]), "--limit", "4"]
    assert cli_main(args) == 0
    lines = capsysbinary.readouterr().out.splitlines()
    assert [jsonx.loads(line)["exchange_id"] for line in lines] == [
        f"ex-{i:06d}" for i in range(6, 10)
    ]
