"""Session fixtures for tests against real llama.cpp servers (``@pytest.mark.llamacpp``).

``llamacpp_env`` runs ``specshadow llamacpp setup`` (cached outside the repo: the tiny models come
from ``specshadow vllm setup``, minutes when cold; llama.cpp's environment and the GGUFs then take
seconds). ``llamacpp_servers`` starts the servers once per session, all at once (about a second
each): ``plain`` (the primary), ``draft`` (draft-simple with the tiny draft model, depth 4),
``ngram-mod`` and ``ngram-map-k``. On teardown it asserts that they left no process behind.

Set ``SPECSHADOW_SKIP_LLAMACPP=1`` to skip these tests on a machine that cannot host them; nothing
else skips them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from backends.llamacpp import (
    LlamaEnv,
    LlamaServer,
    LlamaServerSpec,
    setup,
    start_servers,
    stop_servers,
)
from core.procs import session_pids

SPECS = (
    LlamaServerSpec("plain", "plain"),
    LlamaServerSpec("draft", "draft"),
    LlamaServerSpec("ngram-mod", "ngram-mod"),
    LlamaServerSpec("ngram-map-k", "ngram-map-k"),
)


@pytest.fixture(scope="session")
def llamacpp_env() -> LlamaEnv:
    if os.environ.get("SPECSHADOW_SKIP_LLAMACPP") == "1":
        pytest.skip("SPECSHADOW_SKIP_LLAMACPP=1")
    return setup()


@pytest.fixture(scope="session")
def llamacpp_servers(llamacpp_env: LlamaEnv) -> Iterator[dict[str, LlamaServer]]:
    servers = start_servers(SPECS, llamacpp_env)
    leaders = {s.spec.name: s.pid for s in servers if s.pid is not None}
    try:
        yield {s.spec.name: s for s in servers}
    finally:
        stop_servers(servers)
    stray = {name: session_pids(pid) for name, pid in leaders.items()}
    assert all(not pids for pids in stray.values()), f"stray llama.cpp processes: {stray}"
