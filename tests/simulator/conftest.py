"""Fixtures: simulators on real sockets (127.0.0.1, free ports) and one client session per test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from simulator import SimConfig, SimServer, run_simulator

StartSim = Callable[[SimConfig], Awaitable[SimServer]]

FAST = {"prefill_base_s": 0.0, "step_s": 0.0}


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: SimConfig) -> SimServer:
            return await stack.enter_async_context(run_simulator(config))

        yield start


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
