"""Helpers shared by the reliability tests and ``scripts/soak.py`` (no tests here).

- In-process: request helpers over real sockets, exchange waiting, the shadow policy text.
- Subprocess: :func:`spawn_gateway` starts ``python -m specshadow serve`` and exposes what the
  leak checks read from ``/proc`` (resident memory, open descriptors, sockets by peer) and from
  ``/admin/shadow``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import IO, Any

import aiohttp

from core.exchange import Exchange
from core.procs import free_port
from core.sinks import MemorySink

PROMPT = "Tell me about speculative decoding."


def chat(*, stream: bool, max_tokens: int = 16, prompt: str = PROMPT) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def closed_url() -> str:
    """A loopback URL where nothing listens (connects are refused)."""
    return f"http://127.0.0.1:{free_port()}"


def shadow_policy(
    primary: str,
    candidate: str,
    *,
    ratio: float = 1.0,
    idle_s: float = 2.0,
    total_s: float = 10.0,
    extra: str = "",
) -> str:
    """One primary, one candidate leg, a breaker that never opens unless ``extra`` says so."""
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n"
        f"  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        f"default:\n  ratio: {ratio}\n  legs: [{{backend: cand, role: candidate}}]\n"
        f"timeouts: {{connect_s: 1, idle_s: {idle_s}, total_s: {total_s}}}\n"
        f"{extra}"
    )


NEVER_OPEN = "budgets: {max_in_flight: 1000, breaker: {failures: 100000, window_s: 1}}\n"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    error: str | None  # the client-side exception, if the response broke off
    done_ns: int  # perf_counter_ns when the client had read everything it would get


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> Reply:
    """POST and read to the end; a broken-off body is returned with the exception's name."""
    data = body if isinstance(body, bytes) else None
    payload = None if isinstance(body, bytes) else body
    received = bytearray()
    async with session.post(
        f"{url}{path}",
        json=payload,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
    ) as resp:
        try:
            async for chunk in resp.content.iter_any():
                received += chunk
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            return Reply(resp.status, bytes(received), type(exc).__name__, time.perf_counter_ns())
        return Reply(resp.status, bytes(received), None, time.perf_counter_ns())


async def get_json(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(f"{url}{path}") as resp:
        assert resp.status == 200, resp.status
        return await resp.json()


async def wait_for_exchanges(sink: MemorySink, n: int, timeout_s: float = 10.0) -> list[Exchange]:
    deadline = time.monotonic() + timeout_s
    while len(sink.exchanges) < n:
        assert time.monotonic() < deadline, f"{len(sink.exchanges)} of {n} exchanges"
        await asyncio.sleep(0.01)
    return list(sink.exchanges)


async def wait_until(
    fetch_fn: Callable[[], Any], predicate: Callable[[Any], bool], timeout_s: float = 10.0
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await fetch_fn()
        if predicate(last):
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met; last: {last}")


# -- the gateway as a subprocess --------------------------------------------------------------


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        """Resident set size from ``/proc/PID/status`` (VmRSS)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def sockets(self) -> int:
        count = 0
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                if os.readlink(f"/proc/{self.pid}/fd/{fd}").startswith("socket:"):
                    count += 1
            except OSError:
                continue  # closed between listdir and readlink
        return count

    def sockets_by_kind(self, upstream_ports: Collection[int]) -> dict[str, set[str]]:
        """This process's sockets (their inodes) by kind: ``upstream`` (TCP to one of
        ``upstream_ports``), ``inbound`` (TCP accepted on the gateway's port), ``listening``,
        ``unix`` (the event loop's socketpairs) and ``other``: any other TCP, or a socket in no
        table — a TCP connection the kernel already finished whose descriptor is still open.
        From ``/proc/PID/fd``, ``/proc/net/tcp{,6}`` and ``/proc/net/unix``."""
        port = int(self.url.rsplit(":", 1)[1])
        tcp: dict[str, tuple[int, int, str]] = {}  # inode → (local port, remote port, state)
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    local, remote = (int(cols[i].rsplit(":", 1)[1], 16) for i in (1, 2))
                    tcp[cols[9]] = (local, remote, cols[3])
        with open("/proc/net/unix") as f:
            unix = {cols[6] for cols in (line.split() for line in f.readlines()[1:])}
        names = ("upstream", "inbound", "listening", "unix", "other")
        kinds: dict[str, set[str]] = {k: set() for k in names}
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
            except OSError:
                continue  # closed between listdir and readlink
            if not target.startswith("socket:["):
                continue
            inode = target[len("socket:[") : -1]
            local, remote, state = tcp.get(inode, (0, 0, ""))
            if inode in unix:
                kinds["unix"].add(inode)
            elif state == "0A":  # TCP_LISTEN
                kinds["listening"].add(inode)
            elif local == port:
                kinds["inbound"].add(inode)
            elif remote in upstream_ports:
                kinds["upstream"].add(inode)
            else:
                kinds["other"].add(inode)
        return kinds

    async def shadow_status(self) -> dict[str, Any]:
        result: dict[str, Any] = await get_json(self.url, "/admin/shadow")
        return result

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


async def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], stderr: Callable[[], str], timeout_s: float = 30
) -> None:
    """Until ``url``'s ``/healthz`` answers 200; fails with the process's stderr if it exits
    first, and after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if proc.poll() is not None:
                raise AssertionError(stderr())
            assert time.monotonic() < deadline, "gateway did not start"
            await asyncio.sleep(0.05)


@asynccontextmanager
async def spawn_gateway(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    preexec: Callable[[], None] | None = None,
) -> AsyncIterator[GatewayProcess]:
    """``python -m specshadow serve --port P ARGS``; waits for /healthz; SIGTERM on exit."""
    port = free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 — closed in finally
    proc = subprocess.Popen(  # noqa: ASYNC220 — started once; the loop is idle meanwhile
        [
            sys.executable,
            "-m",
            "specshadow",
            "--log-level",
            "WARNING",
            "serve",
            "--port",
            str(port),
            *args,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
        preexec_fn=preexec,  # only setrlimit; the child has no threads yet
    )
    gp = GatewayProcess(url=f"http://127.0.0.1:{port}", proc=proc, log=log)
    try:
        await wait_healthy(gp.url, proc, gp.stderr)
        yield gp
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
