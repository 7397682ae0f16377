"""A real Prometheus server (Debian's ``prometheus`` package) for tests, and ``promtool`` helpers.

:class:`PrometheusServer` writes a config that scrapes the given targets every second, keeps its
TSDB under a temporary directory, listens on a free loopback port, and answers PromQL instant
queries over its HTTP API. Tests that use it carry ``@pytest.mark.prometheus`` and skip when the
binary is absent (CI installs it: ``apt-get install -y --no-install-recommends prometheus``).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core.procs import ChildProcess, ProcessError, free_port, wait_http_ready_async

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

# A developer without Debian's prometheus may skip these locally; under CI (CI=true, where
# scripts/bootstrap installs it) a missing binary is a failure, never a silent skip.
_IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
requires_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not _IN_CI, reason="Debian's prometheus is not installed"
)
requires_promtool = pytest.mark.skipif(
    PROMTOOL is None and not _IN_CI, reason="promtool (Debian's prometheus) is not installed"
)


def promtool_check_metrics(exposition: bytes) -> tuple[bool, str]:
    """Run ``promtool check metrics`` on an exposition; (passed, promtool's output)."""
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=30,
        check=False,
    )
    return proc.returncode == 0, (proc.stdout + proc.stderr).decode()


def scrape_config(
    targets: Sequence[str], *, interval_s: float = 1.0, metrics_path: str = "/metrics"
) -> str:
    """A minimal ``prometheus.yml`` scraping ``targets`` (host:port) every ``interval_s``."""
    target_list = ", ".join(f'"{t}"' for t in targets)
    interval = f"{round(interval_s * 1000)}ms"  # Prometheus durations take no decimals
    return (
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: specshadow\n"
        f"    metrics_path: {metrics_path}\n"
        f"    static_configs:\n      - targets: [{target_list}]\n"
    )


class PrometheusServer:
    """A ``prometheus`` subprocess scraping ``targets``; stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, targets: Sequence[str], workdir: Path, *, interval_s: float = 1.0) -> None:
        assert PROMETHEUS is not None, "prometheus binary not installed"
        self.port = free_port()
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(scrape_config(targets, interval_s=interval_s))
        self._proc = ChildProcess(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            name="prometheus",
            log_path=workdir / "prometheus.log",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self._proc.log_bytes().decode(errors="replace")

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        try:
            await wait_http_ready_async(
                f"{self.url}/-/ready", self._proc, timeout_s, interval_s=0.1
            )
        except ProcessError as exc:
            pytest.fail(str(exc))

    async def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; returns ``data.result`` (a vector: ``[{"metric": {...}, "value": [t, "v"]}]``)."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.url}/api/v1/query", params={"query": promql}) as resp,
        ):
            payload = await resp.json()
        assert payload.get("status") == "success", payload
        result: list[dict[str, Any]] = payload["data"]["result"]
        return result

    async def wait_for_number(
        self, promql: str, timeout_s: float = 30.0
    ) -> list[tuple[dict[str, str], float]]:
        """Poll ``promql`` until it returns at least one finite number; return (labels, value) pairs."""
        deadline = time.monotonic() + timeout_s
        last: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            last = await self.query(promql)
            numbers = [(r["metric"], float(r["value"][1])) for r in last]
            finite = [(m, v) for m, v in numbers if math.isfinite(v)]
            if finite:
                return finite
            await asyncio.sleep(0.25)
        pytest.fail(
            f"{promql!r} gave no finite number within {timeout_s} s; last result {last!r}\n{self.log_text()}"
        )

    def stop(self) -> None:
        self._proc.stop(10.0)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``server = prometheus_server(["127.0.0.1:PORT"])``; stopped after the test."""
    servers: list[PrometheusServer] = []

    def start(targets: Sequence[str], interval_s: float = 1.0) -> PrometheusServer:
        workdir = tmp_path / f"prometheus-{len(servers)}"
        workdir.mkdir()
        server = PrometheusServer(targets, workdir, interval_s=interval_s)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
