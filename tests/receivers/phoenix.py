"""A real trace store for tests: Arize Phoenix (PyPI ``arize-phoenix``) in its own environment.

:class:`PhoenixServer` runs ``phoenix serve`` from the environment :mod:`tests.toolenv` builds
(never the project's ``.venv``: Phoenix pins its own stack, ~860 MB), on free loopback ports, its
SQLite database under a temporary folder, product telemetry and external resources off. It takes
OTLP over HTTP at ``/v1/traces`` and answers spans over REST at ``/v1/projects/{name}/spans``;
its web UI shows a trace at ``/projects/{project id}/traces/{trace id}``.

Phoenix also opens an OTLP/gRPC port and binds it on every interface whatever ``PHOENIX_HOST``
says (``[::]:port`` in ``phoenix/server/grpc_server.py``, 20.26.1); nothing here sends to it.
Spans land in the project named by the resource attribute ``openinference.project.name``
(``default`` without one) and carry no OTel span kind there: Phoenix sets its own
(``span_kind`` ``LLM`` for spans with ``gen_ai.*`` attributes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from core.procs import ChildProcess, free_port, wait_http_ready_async
from tests.toolenv import ToolEnv

READY_TIMEOUT_S = 180.0  # ~13-25 s measured on an idle 2-core machine; first start builds the DB


class PhoenixServer:
    """``phoenix serve`` as a subprocess; stop with :meth:`stop`."""

    def __init__(self, env: ToolEnv, workdir: Path) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self._proc = ChildProcess(
            [str(env.bin("phoenix")), "serve"],
            name="phoenix",
            log_path=workdir / "phoenix.log",
            env={
                "PATH": f"{env.venv / 'bin'}:/usr/bin:/bin",
                "HOME": str(workdir),
                "PHOENIX_HOST": "127.0.0.1",
                "PHOENIX_PORT": str(self.port),
                "PHOENIX_GRPC_PORT": str(self.grpc_port),
                "PHOENIX_WORKING_DIR": str(workdir / "data"),
                "PHOENIX_TELEMETRY_ENABLED": "false",
                "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
            },
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def otlp_env(self, project: str, **extra: str) -> dict[str, str]:
        """The gateway's environment for exporting traces here: OTLP over HTTP, a project."""
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{self.url}/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
            **extra,
        }

    def log_tail(self) -> str:
        return self._proc.log_tail(40)

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``/healthz`` answered."""
        started = time.monotonic()
        await wait_http_ready_async(f"{self.url}/healthz", self._proc, timeout_s, interval_s=0.2)
        return time.monotonic() - started

    def stop(self) -> None:
        self._proc.stop()

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.url}{path}", params=params) as resp,
        ):
            if resp.status == 404:
                return None
            resp.raise_for_status()
            return await resp.json()

    async def project_id(self, name: str) -> str | None:
        """The project's id (the UI's URLs use it), ``None`` before its first span."""
        payload = await self._get("/v1/projects")
        return next((p["id"] for p in payload["data"] if p["name"] == name), None)

    async def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span of ``project`` (``[]`` before its first), following the REST API's cursor."""
        out: list[dict[str, Any]] = []
        params = {"limit": "1000"}
        while True:
            payload = await self._get(f"/v1/projects/{project}/spans", params)
            if payload is None:
                return out
            out.extend(payload["data"])
            cursor = payload.get("next_cursor")
            if not cursor:
                return out
            params = {"limit": "1000", "cursor": cursor}

    async def wait_for_spans(
        self,
        project: str,
        done: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float = 60.0,
    ) -> list[dict[str, Any]]:
        """Poll until ``done(spans)``; on timeout fail with what was there."""
        deadline = time.monotonic() + timeout_s
        spans: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            spans = await self.spans(project)
            if done(spans):
                return spans
            await asyncio.sleep(0.2)
        names = sorted(s["name"] for s in spans)
        raise AssertionError(f"Phoenix project {project!r} incomplete after {timeout_s} s: {names}")
