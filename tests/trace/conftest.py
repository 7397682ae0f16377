"""One Phoenix server per test session (``@pytest.mark.phoenix``).

``phoenix_env`` builds Phoenix's own virtual environment on first use (:mod:`tests.toolenv`:
~100 s and ~860 MB cold, instant warm); ``phoenix`` starts ``phoenix serve`` once for every test
of the tier and stops it at the end. Each test module exports into a project of its own, so tests
never see each other's spans. ``SPECSHADOW_SKIP_PHOENIX=1`` skips the tier on a machine that
cannot install it; nothing else does (under CI a failed install is a failure).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from tests.receivers.phoenix import PhoenixServer
from tests.toolenv import ToolEnv, ensure


@pytest.fixture(scope="session")
def phoenix_env() -> ToolEnv:
    if os.environ.get("SPECSHADOW_SKIP_PHOENIX") == "1":
        pytest.skip("SPECSHADOW_SKIP_PHOENIX=1")
    env = ensure("phoenix")
    print(f"phoenix environment: {env.install}")  # shown with -s: the cold install's cost
    return env


@pytest.fixture(scope="session")
def phoenix(
    phoenix_env: ToolEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PhoenixServer]:
    server = PhoenixServer(phoenix_env, tmp_path_factory.mktemp("phoenix"))
    try:
        ready_s = asyncio.run(server.wait_ready())
        print(f"phoenix ready in {ready_s:.1f} s")
        yield server
    finally:
        server.stop()
