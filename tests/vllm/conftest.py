"""Session fixtures for tests against real vLLM CPU servers (``@pytest.mark.vllm``).

``vllm_env`` runs ``specshadow vllm setup`` (cached outside the repo; minutes when cold, instant
when warm). ``vllm_started`` starts the session's servers once, all at once, in one batch: the
four every module uses — ``plain`` (the primary), ``baseline`` (a second plain server: the noise
floor), ``ngram`` and ``draft`` (the candidates), which ``vllm_servers`` returns — and the extra
configurations the collected tests mark (below). On teardown it asserts that they left no process
and no work folder behind. Every vLLM test module shares them, so the session pays for one start.

A test that needs another configuration asks ``vllm_server(name)`` for it, by the name of one of
:data:`EXTRA_SPECS` (or of the four), and its module says so with ``pytest.mark.vllm_extra(name)``:
the session starts every configuration its collected tests mark together with the four, in one
batch (a start is CPU-bound, and a server started alone leaves one core idle for half its start:
its worker is bound to one core from the middle of it). A configuration asked for without the mark
starts on the first ask; every later ask, from any module, gets the same one. At most
:data:`MAX_EXTRAS` of those run at once: asking for another stops the one asked for least
recently.

Set ``SPECSHADOW_SKIP_VLLM=1`` to skip these tests on a machine that cannot host vLLM; nothing
else skips them. For a quick edit-and-rerun loop, ``SPECSHADOW_VLLM_URLS=plain=URL,ngram=URL,
draft=URL[,baseline=URL]`` reuses running servers (e.g. ``specshadow vllm up``; without
``baseline`` the plain server doubles as baseline) — nothing else may use them meanwhile, or the
counter-agreement tests see foreign traffic.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
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
# both on ``auto``, 6.2 s with each bound to its own core. So a mirror's primary and candidates are
# on different cores: ``plain`` (the primary) on the first, the three servers mirrored beside it on
# the second. The extra configurations are on the first core, so the seven start with their
# workers split four and three (the second half of a start runs on the bound core: seven with five
# on one core took 124 s, and its other core idled for about 37 s of them); a test that mirrors
# ``ngram-k2`` or ``suffix`` makes ``baseline`` (a plain server on the second core) its primary.
# ``other`` is mirrored beside ``baseline`` and ``ngram`` in test_quality.
PRIMARY_CORE, MIRROR_CORE = spread_cores(2)

SERVER_SPECS = (
    VllmServerSpec("plain", "plain", cores=PRIMARY_CORE),
    VllmServerSpec("baseline", "plain", cores=MIRROR_CORE),
    VllmServerSpec("ngram", "ngram", cores=MIRROR_CORE),
    VllmServerSpec("draft", "draft", cores=MIRROR_CORE),
)
# Configurations some tests need beyond the four (``vllm_server``; ``pytest.mark.vllm_extra``).
EXTRA_SPECS = {
    spec.name: spec
    for spec in (
        # The draft model served plainly under the target's name: "another model" (test_quality).
        VllmServerSpec("other", "plain", weights="draft", cores=PRIMARY_CORE),
        # n-gram at depth 2: what vLLM reports at another depth (test_counterfactual).
        VllmServerSpec("ngram-k2", "ngram", num_speculative_tokens=2, cores=PRIMARY_CORE),
        # Suffix decoding (arctic-inference built once, cached): test_suffix_live.
        VllmServerSpec("suffix", "suffix", num_speculative_tokens=8, cores=PRIMARY_CORE),
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


def marked_extras(items: Iterable[pytest.Item]) -> list[str]:
    """The extra configurations the tests mark with ``pytest.mark.vllm_extra(name, ...)``."""
    names: dict[str, None] = {}
    for item in items:
        for mark in item.iter_markers("vllm_extra"):
            for name in mark.args:
                if name not in EXTRA_SPECS:
                    raise pytest.UsageError(
                        f"{item.nodeid}: vllm_extra({name!r}): no such configuration "
                        f"(EXTRA_SPECS: {', '.join(EXTRA_SPECS)})"
                    )
                names[name] = None
    return list(names)


@pytest.fixture(scope="session")
def vllm_started(
    request: pytest.FixtureRequest, vllm_env: VllmEnv
) -> Iterator[dict[str, VllmServer]]:
    """Every server of the session's first batch by name: the four and the marked extras."""
    reuse = os.environ.get("SPECSHADOW_VLLM_URLS")
    if reuse:
        yield reused_servers(reuse, vllm_env)
        return
    extras = [EXTRA_SPECS[name] for name in marked_extras(request.session.items)]
    servers = start_servers((*SERVER_SPECS, *extras), vllm_env)
    leaders = {s.spec.name: s.pid for s in servers}
    work_dirs = [s.work_dir for s in servers]
    try:
        yield {s.spec.name: s for s in servers}
    finally:
        stop_servers(servers)
    stray = {name: session_pids(pid) for name, pid in leaders.items() if pid is not None}
    assert all(not pids for pids in stray.values()), f"stray vLLM processes: {stray}"
    assert all(d is not None and not d.exists() for d in work_dirs), work_dirs


@pytest.fixture(scope="session")
def vllm_servers(vllm_started: dict[str, VllmServer]) -> dict[str, VllmServer]:
    """The four servers every vLLM module shares: ``plain``, ``baseline``, ``ngram``, ``draft``."""
    four = {spec.name for spec in SERVER_SPECS}
    return {name: server for name, server in vllm_started.items() if name in four}


class VllmServerPool:
    """The run's vLLM servers by configuration name: those of the session's first batch and the
    :data:`EXTRA_SPECS` started on demand (at most :data:`MAX_EXTRAS` of those at once)."""

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
def vllm_server(vllm_env: VllmEnv, vllm_started: dict[str, VllmServer]) -> Iterator[VllmServerPool]:
    """``vllm_server("other")``: a configuration's shared server (started with the session's first
    batch when its tests mark it, else on the first ask)."""
    pool = VllmServerPool(vllm_env, dict(vllm_started))
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
