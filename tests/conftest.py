"""Shared fixtures: real servers on 127.0.0.1 (fake upstreams, the gateway), no patched code."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from core.sinks import MemorySink
from gateway.settings import Settings, UpstreamSettings
from specshadow.app import build_app
from tests.fakes.upstream import FakeUpstream, Script
from tests.receivers.collector_file import collector_file
from tests.receivers.otlp import otlp_grpc_receiver, otlp_http_receiver
from tests.receivers.prometheus import prometheus_server

# Fixtures defined in tests/receivers, made available to every test directory.
__all__ = ["collector_file", "otlp_grpc_receiver", "otlp_http_receiver", "prometheus_server"]

# The node id of the last test before the run's first timing test ("" when that one is first).
_BEFORE_TIMING = pytest.StashKey[str]()


def _wait_for_timing_gate() -> None:
    """``CHECK_TIMING_GATE=PATH`` (set by scripts/check on the vllm tier, which runs beside
    the other tiers): timing tests start only once PATH exists, when nothing else loads the
    machine. Waited for between tests, outside any test's timeout."""
    gate = os.environ.get("CHECK_TIMING_GATE")
    if not gate:
        return
    path = Path(gate)
    if not path.exists():
        sys.stderr.write(f"\ntiming tests wait for {gate} (the other tiers to finish)\n")
    while not path.exists():
        time.sleep(1.0)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The tests that will run, after -m and -k deselected the others (pytest_collection_modifyitems
    # sees them before that: the test before the first timing test there may never run).
    items = session.items
    first_timing = next(
        (i for i, item in enumerate(items) if item.get_closest_marker("timing") is not None), None
    )
    if first_timing is None:
        return
    session.config.stash[_BEFORE_TIMING] = items[first_timing - 1].nodeid if first_timing else ""
    if first_timing == 0:
        _wait_for_timing_gate()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # Called after a test's whole protocol (setup, call, teardown), outside its timeout.
    config = _CONFIG[0] if _CONFIG else None
    if config is not None and nodeid == config.stash.get(_BEFORE_TIMING, None):
        _wait_for_timing_gate()


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG.append(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Timing tests run last in any one run (a tier that holds both kinds, such as vllm's, runs
    its timing claims after its functional tests, on a machine its own tests no longer load);
    the sort is stable, so a module stays in one block.

    Under pytest-xdist's ``--dist loadgroup`` (scripts/check), tests that share a wider-scoped
    fixture of this suite (a ClickHouse server, a built wheel, vLLM servers) run on one worker, so
    the fixture is built once per run, not once per worker. A test marked ``xdist_group`` keeps
    its mark. Runs before xdist reads the marks (tryfirst)."""
    items.sort(key=lambda item: item.get_closest_marker("timing") is not None)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        # A session- or package-scoped fixture groups by its name, across modules; a module- or
        # class-scoped one by the module, so every test of a module that builds one (or two,
        # one on the other) runs where it was built.
        wide, narrow = [], []
        for name, defs in info.name2fixturedefs.items():
            if not defs or not (defs[-1].baseid or "").startswith("tests"):
                continue
            if defs[-1].scope in ("session", "package"):
                wide.append(f"{defs[-1].baseid}::{name}")
            elif defs[-1].scope in ("module", "class"):
                narrow.append(item.nodeid.split("::", 1)[0])
        group = sorted(wide)[0] if wide else narrow[0] if narrow else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


async def start_server(app: web.Application) -> TestServer:
    """A real listening server on 127.0.0.1 that cancels handlers on client disconnect."""
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()  # aiohttp's TestServer already sets handler_cancellation=True
    return server


@dataclass
class RunningGateway:
    server: TestServer
    sink: MemorySink
    settings: Settings

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


FAST_UPSTREAM = UpstreamSettings(
    connect_timeout_s=2.0, idle_timeout_s=5.0, retry_initial_s=0.01, retry_max_s=0.05
)


@pytest.fixture
async def servers() -> AsyncIterator[list[TestServer]]:
    started: list[TestServer] = []
    yield started
    for server in reversed(started):
        await server.close()


@pytest.fixture
def fake_upstream(
    servers: list[TestServer],
) -> Callable[[Script], Awaitable[tuple[FakeUpstream, str]]]:
    async def start(script: Script) -> tuple[FakeUpstream, str]:
        fake = FakeUpstream(script)
        server = await start_server(fake.app())
        servers.append(server)
        return fake, str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
def gateway(servers: list[TestServer]) -> Callable[..., Awaitable[RunningGateway]]:
    async def start(
        primary_url: str | None, *, telemetry: Any = None, **overrides: Any
    ) -> RunningGateway:
        overrides.setdefault("upstream", FAST_UPSTREAM)
        settings = Settings(primary_url=primary_url, **{"shutdown_timeout_s": 2.0, **overrides})
        sink = MemorySink()
        server = await start_server(build_app(settings, sinks=[sink], telemetry=telemetry))
        servers.append(server)
        return RunningGateway(server=server, sink=sink, settings=settings)

    return start


@pytest.fixture
async def sims() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start simulators (real sockets) for the test; all stop at its end."""
    from contextlib import AsyncExitStack

    from simulator.app import run_simulator
    from simulator.config import SimConfig

    async with AsyncExitStack() as stack:

        async def start(**config: Any) -> Any:
            config.setdefault("prefill_base_s", 0.002)
            config.setdefault("step_s", 0.001)
            return await stack.enter_async_context(run_simulator(SimConfig(**config)))

        yield start


@pytest.fixture
def write_policy(tmp_path: Any) -> Callable[[str], str]:
    """Write a policy atomically (temp file + rename, as editors and ConfigMaps do)."""
    import os

    path = tmp_path / "policy.yaml"

    def write(text: str) -> str:
        tmp = tmp_path / "policy.yaml.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
        return str(path)

    return write
