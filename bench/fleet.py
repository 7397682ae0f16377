"""The process fleet of one benchmark run, on :mod:`core.procs`, and where each process is pinned.

Every arm of a benchmark is a real process on 127.0.0.1 (``specshadow simulate`` upstreams,
``specshadow serve`` gateways, ``bench.raw_relay``, other proxies), started in parallel, waited for,
and always stopped: each is a :class:`core.procs.ChildProcess` (its own process group, a
parent-death signal, a log under :attr:`Fleet.log_dir`), and :meth:`Fleet.stop` runs when the
``with Fleet()`` block ends, on SIGTERM (see :func:`bench.tables.run_main`) and at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from core.procs import ChildProcess, ProcessError, can_pin, free_port, wait_http_ready_async

__all__ = [
    "CLIENT_CPU",
    "GATEWAY_CPU",
    "REPO_ROOT",
    "UPSTREAM_CPU",
    "Fleet",
    "StartupError",
    "pin_self",
    "simulator_args",
    "specshadow_argv",
]

# Pinning (when the machine has ≥ 2 cores): the gateway gets a core to itself; the upstreams and
# the load-generating client share the other, in every arm alike.
GATEWAY_CPU = 0
UPSTREAM_CPU = 1
CLIENT_CPU = 1

REPO_ROOT = Path(__file__).resolve().parents[1]
_URL_LINE = re.compile(rb" on (http://[0-9.]+:\d+)")


class StartupError(ProcessError):
    """A benchmark process exited or never became ready; the message carries its log tail."""


def specshadow_argv() -> list[str]:
    """The ``specshadow`` console script next to this interpreter, else ``python -m specshadow``."""
    script = Path(sys.executable).with_name("specshadow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specshadow"]


def pin_self(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def simulator_args(
    *, mode: str, prefill_ms: float, step_ms: float, tokens: int, fault: str | None = None
) -> list[str]:
    """Every request gets exactly ``tokens`` output tokens, so every arm does the same work."""
    args = ["--mode", mode, "--prefill-ms", str(prefill_ms), "--step-ms", str(step_ms)]
    args += ["--min-output-tokens", str(tokens), "--max-output-tokens", str(tokens)]
    return [*args, "--fault", fault] if fault else args


class Fleet:
    """Owns every child process of one benchmark run; ``stop()`` is idempotent and always runs."""

    def __init__(self, *, pin: bool, grace_s: float = 5.0) -> None:
        self.pin = pin and can_pin()
        self.grace_s = grace_s
        self.log_dir = Path(tempfile.mkdtemp(prefix="specshadow-bench-"))
        self.procs: dict[str, ChildProcess] = {}
        self.stop_s: dict[str, float] = {}  # name → seconds from SIGTERM to exit
        self.killed: list[str] = []  # names that needed SIGKILL
        atexit.register(self.stop)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        cpu: int | None,
        env: Mapping[str, str] | None = None,
    ) -> ChildProcess:
        proc = ChildProcess(
            argv,
            name=name,
            log_path=self.log_dir / f"{name}.log",
            append_log=True,  # a retried start keeps the first attempt's lines
            env={**os.environ, **env} if env else None,
            cwd=REPO_ROOT,
            cpu=cpu if self.pin else None,
            error=StartupError,
        )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        proc = self.procs.get(name)
        return proc.log_tail(lines) if proc is not None else ""

    async def simulator(self, name: str, args: Sequence[str], *, timeout_s: float = 60.0) -> str:
        """Start ``specshadow simulate --port 0 …``; return the base URL it prints."""
        simulate = ["simulate", "--host", "127.0.0.1", "--port", "0", *args]
        proc = self._spawn(
            name, [*specshadow_argv(), "--log-level", "WARNING", *simulate], UPSTREAM_CPU
        )
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            match = _URL_LINE.search(proc.log_bytes())
            if match:
                return match.group(1).decode()
            proc.check_running()
            await asyncio.sleep(0.05)
        raise StartupError(f"{name} printed no URL within {timeout_s} s:\n{proc.log_tail()}")

    async def gateway(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``specshadow serve`` on a free port; return its base URL once /healthz answers.

        ``env`` is added to this process's environment (e.g. ``SPECSHADOW_TELEMETRY=off``).
        """
        serve = [*specshadow_argv(), "--log-level", "WARNING", "serve", "--host", "127.0.0.1"]
        argv_for = lambda port: [*serve, "--port", str(port), *args]  # noqa: E731
        return await self.http_server(name, argv_for, env=env, timeout_s=timeout_s)

    async def relay(self, name: str, upstream: str, *, timeout_s: float = 60.0) -> str:
        """Start ``bench.raw_relay`` (the floor for a Python proxy) on the gateway's core."""
        relay = [sys.executable, "-m", "bench.raw_relay", "--upstream", upstream]
        argv_for = lambda port: [*relay, "--port", str(port)]  # noqa: E731
        return await self.http_server(name, argv_for, timeout_s=timeout_s)

    async def http_server(
        self,
        name: str,
        argv_for: Callable[[int], list[str]],
        *,
        env: Mapping[str, str] | None = None,
        health_path: str = "/healthz",
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``argv_for(port)`` on a free port, pinned like a gateway; wait for ``health_path``."""
        for attempt in range(2):
            port = free_port()
            proc = self._spawn(name, argv_for(port), GATEWAY_CPU, env)
            url = f"http://127.0.0.1:{port}"
            try:
                await wait_http_ready_async(url + health_path, proc, timeout_s, interval_s=0.05)
            except StartupError:
                lost_race = b"address already in use" in proc.log_bytes().lower()
                if attempt == 0 and proc.returncode is not None and lost_race:
                    proc.stop(0.0)  # reaped; its name goes to the second attempt
                    continue  # the free port was taken between our probe and its bind
                raise
            return url
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """SIGTERM every process group at once, wait ``grace_s`` in all, SIGKILL what is left."""
        started = time.perf_counter()
        live = {n: p for n, p in self.procs.items() if n not in self.stop_s}
        for proc in live.values():
            proc.terminate()
        for name, proc in live.items():
            remaining = max(0.0, started + self.grace_s - time.perf_counter())
            if proc.stop(remaining):
                self.killed.append(name)
            self.stop_s[name] = time.perf_counter() - started
