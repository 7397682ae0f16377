"""Session fixtures for tests against real vLLM CPU servers (``@pytest.mark.vllm``).

``vllm_env`` runs ``specshadow vllm setup`` (cached outside the repo; minutes when cold, instant
when warm). ``vllm_servers`` starts four servers once per session, all at once (on 2 cores four
start in about 2 minutes, one alone in about 40 s): ``plain`` (the primary), ``baseline`` (a
second plain server: the noise floor), ``ngram`` and ``draft`` (the candidates). On teardown it
asserts that they left no process and no work folder behind. Every vLLM test module shares them,
so the session pays for one start.

A test that needs another configuration asks ``vllm_server(name)`` for it, by the name of one of
:data:`EXTRA_SPECS` (or of the four): the server starts on the first ask and every later ask, from
any module, gets the same one. At most :data:`MAX_EXTRAS` extra servers run at once (each holds
about 3 GB): asking for another stops the one asked for least recently.

Set ``SPECSHADOW_SKIP_VLLM=1`` to skip these tests on a machine that cannot host vLLM; nothing
else skips them. For a quick edit-and-rerun loop, ``SPECSHADOW_VLLM_URLS=plain=URL,ngram=URL,
draft=URL[,baseline=URL]`` reuses running servers (e.g. ``specshadow vllm up``; without
``baseline`` the plain server doubles as baseline) — nothing else may use them meanwhile, or the
counter-agreement tests see foreign traffic.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.server import (
    SERVED_MODEL_NAME,
    VllmServer,
    VllmServerSpec,
    session_pids,
    spread_cores,
    start_servers,
    stop_servers,
)
from backends.setup import VllmEnv, setup
from core import jsonx

# Short rows of two real traces, vendored with their origin and licence (ATTRIBUTION.md there).
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    if os.environ.get("SPECSHADOW_SKIP_VLLM") == "1":
        pytest.skip("SPECSHADOW_SKIP_VLLM=1")
    return setup()


# Each server's engine runs one OpenMP thread, and vLLM's ``auto`` binding puts every server's on
# the first core: a primary and its mirrored candidate took turns on one core while the other
# idled. Measured here: 16 requests sent to a plain and an n-gram server at once took 19.8 s with
# both on ``auto``, 6.2 s with each bound to its own core. So the primary (``plain``) has the first
# core and the servers mirrored beside it the second; ``other`` (mirrored beside ``baseline`` and
# ``ngram`` in test_quality) goes back to the first.
PRIMARY_CORE, MIRROR_CORE = spread_cores(2)

SERVER_SPECS = (
    VllmServerSpec("plain", "plain", cores=PRIMARY_CORE),
    VllmServerSpec("baseline", "plain", cores=MIRROR_CORE),
    VllmServerSpec("ngram", "ngram", cores=MIRROR_CORE),
    VllmServerSpec("draft", "draft", cores=MIRROR_CORE),
)
# Configurations some tests need beyond the four, started on the first ask (``vllm_server``).
EXTRA_SPECS = {
    spec.name: spec
    for spec in (
        # The draft model served plainly under the target's name: "another model" (test_quality).
        VllmServerSpec("other", "plain", weights="draft", cores=PRIMARY_CORE),
        # n-gram at depth 2: what vLLM reports at another depth (test_counterfactual).
        VllmServerSpec("ngram-k2", "ngram", num_speculative_tokens=2, cores=MIRROR_CORE),
        # Suffix decoding (arctic-inference built once, cached): test_suffix_live.
        VllmServerSpec("suffix", "suffix", num_speculative_tokens=8, cores=MIRROR_CORE),
    )
}
MAX_EXTRAS = 1


def reused_servers(text: str, env: VllmEnv) -> dict[str, VllmServer]:
    """``name=URL,...`` → never-launched :class:`VllmServer` handles (stop() is a no-op on them)."""
    specs = {spec.name: spec for spec in (*SERVER_SPECS, *EXTRA_SPECS.values())}
    out: dict[str, VllmServer] = {}
    for item in text.split(","):
        name, _, url = item.partition("=")
        port = int(url.rstrip("/").removesuffix("/v1").rsplit(":", 1)[1])
        out[name] = VllmServer(dataclasses.replace(specs[name], port=port), env)
    out.setdefault("baseline", out["plain"])
    return out


@pytest.fixture(scope="session")
def vllm_servers(vllm_env: VllmEnv) -> Iterator[dict[str, VllmServer]]:
    reuse = os.environ.get("SPECSHADOW_VLLM_URLS")
    if reuse:
        yield reused_servers(reuse, vllm_env)
        return
    servers = start_servers(SERVER_SPECS, vllm_env)
    leaders = {s.spec.name: s.pid for s in servers}
    work_dirs = [s.work_dir for s in servers]
    try:
        yield {s.spec.name: s for s in servers}
    finally:
        stop_servers(servers)
    stray = {name: session_pids(pid) for name, pid in leaders.items() if pid is not None}
    assert all(not pids for pids in stray.values()), f"stray vLLM processes: {stray}"
    assert all(d is not None and not d.exists() for d in work_dirs), work_dirs


class VllmServerPool:
    """The run's vLLM servers by configuration name: the four of ``vllm_servers`` and the
    :data:`EXTRA_SPECS` started on demand (at most :data:`MAX_EXTRAS` at once)."""

    def __init__(self, env: VllmEnv, servers: dict[str, VllmServer]) -> None:
        self.env = env
        self.servers = servers
        self.extras: dict[str, VllmServer] = {}  # least recently asked first
        self.started: list[tuple[str, int | None, Path | None]] = []

    def __call__(self, name: str) -> VllmServer:
        if name in self.servers:
            return self.servers[name]
        if name in self.extras:
            self.extras[name] = self.extras.pop(name)  # now the most recently asked
            return self.extras[name]
        spec = EXTRA_SPECS[name]  # a KeyError names a configuration nobody declared
        while len(self.extras) >= MAX_EXTRAS:
            oldest = next(iter(self.extras))
            stop_servers([self.extras.pop(oldest)])
        (server,) = start_servers([spec], self.env)
        self.started.append((name, server.pid, server.work_dir))
        self.extras[name] = server
        return server

    def close(self) -> None:
        stop_servers(list(self.extras.values()))
        self.extras.clear()


@pytest.fixture(scope="session")
def vllm_server(vllm_env: VllmEnv, vllm_servers: dict[str, VllmServer]) -> Iterator[VllmServerPool]:
    """``vllm_server("other")``: a configuration's shared server, started on the first ask."""
    reuse = os.environ.get("SPECSHADOW_VLLM_URLS")
    pool = VllmServerPool(vllm_env, vllm_servers)
    if reuse:  # extras named in the list are reused too; others start here
        pool.servers.update(
            {k: v for k, v in reused_servers(reuse, vllm_env).items() if k in EXTRA_SPECS}
        )
    try:
        yield pool
    finally:
        pool.close()
    stray = {name: session_pids(pid) for name, pid, _ in pool.started if pid is not None}
    assert all(not pids for pids in stray.values()), f"stray vLLM processes: {stray}"
    assert all(d is None or not d.exists() for _, _, d in pool.started), pool.started


def trace_requests(
    name: str, count: int, *, max_prompt_chars: int = 400, max_tokens: int = 32
) -> list[dict[str, object]]:
    """The first ``count`` short requests of a vendored trace, ready for the tiny model."""
    out: list[dict[str, object]] = []
    with (TRACES / name).open(encoding="utf-8") as fh:
        for line in fh:
            record = jsonx.loads(line)
            if record["meta"]["prompt_chars"] > max_prompt_chars:
                continue
            body = {k: v for k, v in record.items() if k not in ("category", "meta")}
            body.update(model=SERVED_MODEL_NAME, max_tokens=max_tokens, temperature=0)
            out.append(body)
            if len(out) == count:
                break
    return out
