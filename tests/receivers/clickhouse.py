"""A real ClickHouse server (Debian's ``clickhouse-server`` package, 18.16 on bookworm) for tests.

:class:`ClickHouseServer` writes a minimal config (loopback only, free ports, data under a
temporary folder, one passwordless ``default`` user) and waits for its HTTP interface. The
Debian package is old — it predates ``TTL`` and ``LowCardinality`` — which is why the store
probes the server's version and falls back to partition drops for retention. Tests that use it
skip when the binary is absent, except under CI (CI=true, where scripts/bootstrap installs it),
where a missing binary is a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from core.procs import ChildProcess, ProcessError, free_port, wait_http_ready

CLICKHOUSE_SERVER = shutil.which("clickhouse-server")
_IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
requires_clickhouse = pytest.mark.skipif(
    CLICKHOUSE_SERVER is None and not _IN_CI, reason="Debian's clickhouse-server is not installed"
)

_CONFIG = """<yandex>
  <logger><level>warning</level><console>1</console></logger>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{root}/data/</path>
  <tmp_path>{root}/tmp/</tmp_path>
  <user_files_path>{root}/user_files/</user_files_path>
  <format_schema_path>{root}/format_schemas/</format_schema_path>
  <users_config>{root}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>5368709120</mark_cache_size>
</yandex>
"""
_USERS = """<yandex>
  <profiles><default/></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip></networks>
    <profile>default</profile><quota>default</quota></default></users>
  <quotas><default/></quotas>
</yandex>
"""


class ClickHouseServer:
    """A ``clickhouse-server`` subprocess; :meth:`stop` ends it (or use as a context manager)."""

    def __init__(self, workdir: Path) -> None:
        assert CLICKHOUSE_SERVER is not None, "clickhouse-server not installed"
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "users.xml").write_text(_USERS)
        config = workdir / "config.xml"
        config.write_text(_CONFIG.format(http=self.port, tcp=free_port(), root=workdir))
        self._proc = ChildProcess(
            [CLICKHOUSE_SERVER, f"--config-file={config}"],
            name="clickhouse-server",
            log_path=workdir / "clickhouse.log",
        )
        try:
            wait_http_ready(f"http://127.0.0.1:{self.port}/ping", self._proc, 60.0)
        except ProcessError as exc:
            self._proc.stop(5.0)
            pytest.fail(str(exc))

    def url(self, database: str) -> str:
        """A store URL for ``database`` (created on first use by the caller)."""
        return f"clickhouse://127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        self._proc.stop(10.0)

    def __enter__(self) -> ClickHouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
