"""The child-process supervisor: every process the project starts, and how it is always stopped.

Owns:

- :func:`free_port`: a loopback port that was free a moment ago;
- the argv prefixes a child is started under: :func:`die_with_parent` (util-linux ``setpriv
  --pdeathsig``: the kernel signals the child when its parent dies without cleaning up) and
  :func:`pin_prefix` (``taskset -c N``). Prefixes rather than a ``preexec_fn``: preexec_fn runs
  Python between fork and exec, which is unsafe once the parent has threads (aiohttp's resolver,
  OTel exporters, ``asyncio.to_thread``); ``setpriv`` and ``taskset`` exec the real command, so
  the pid, the process group and the exit status stay the command's own;
- :class:`ChildProcess`: one argv in its own session and process group (``start_new_session``),
  stdout and stderr in a log file, and :meth:`ChildProcess.stop`: SIGTERM to the whole group, a
  grace period, SIGKILL to whatever is left, reap, and return only once no process of the group
  (nor of its session) is alive — also when the group ignores SIGTERM or the leader exits before
  its workers;
- readiness: :func:`wait_http_ready` (sync, urllib) and :func:`wait_http_ready_async` (aiohttp)
  poll a URL until it answers 200 and fail fast, with the log tail, when the process exits;
- the ``/proc`` readings of a started session: :func:`session_pids`, :func:`rss_bytes`.

Linux only (process groups, ``/proc``). Imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp

__all__ = [
    "ChildProcess",
    "ProcessError",
    "can_pin",
    "die_with_parent",
    "free_port",
    "http_ok",
    "log_tail",
    "pin_prefix",
    "rss_bytes",
    "session_pids",
    "wait_http_ready",
    "wait_http_ready_async",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
_REAP_LIMIT_S = (
    30.0  # after SIGKILL: the kernel ends a group in milliseconds; this only bounds D-state
)


class ProcessError(RuntimeError):
    """A child exited, or did not become ready in time; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (a child binding it may still lose a race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def die_with_parent(signal_name: str = "KILL") -> list[str]:
    """The argv prefix that has the kernel send ``signal_name`` to the child when its parent dies.

    ``[]`` where util-linux ``setpriv`` is missing. The parent-death signal follows the *thread*
    that started the child (prctl ``PR_SET_PDEATHSIG``), so start children from long-lived threads.
    """
    return ["setpriv", "--pdeathsig", signal_name] if shutil.which("setpriv") else []


def can_pin() -> bool:
    """Pinning makes sense: at least two CPUs and ``taskset`` installed."""
    return (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None


def pin_prefix(cpu: int | None) -> list[str]:
    """``taskset -c CPU`` (``[]`` for ``None`` or without ``taskset``)."""
    if cpu is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(cpu)]


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (``""`` when it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ChildProcess:
    """One started argv: its own session and process group, output in ``log_path``.

    Starts in the constructor. ``env`` is the child's whole environment (``None``: this
    process's). ``cpu`` pins it with ``taskset``; ``pdeathsig`` (a signal name, ``None`` for
    none) is what it gets if this process dies first. Errors raised about it are ``error``
    (a :class:`ProcessError` subclass of the owner's choosing), named by ``name``, and end with
    the last ``tail_lines`` lines of the log.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        cpu: int | None = None,
        pdeathsig: str | None = "KILL",
        append_log: bool = False,
        error: type[ProcessError] = ProcessError,
        tail_lines: int = 20,
    ) -> None:
        if not argv:
            raise ValueError("empty argv")
        self.name = name or Path(argv[0]).name
        self.log_path = log_path
        self.error = error
        self.tail_lines = tail_lines
        prefix = die_with_parent(pdeathsig) if pdeathsig is not None else []
        self.argv = [*prefix, *pin_prefix(cpu), *argv]
        with log_path.open("ab" if append_log else "wb") as log_file:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,  # session id = group id = pid: one killpg reaches all
            )
        self.started_ns = time.perf_counter_ns()
        self._killed: bool | None = None  # set by stop(): whether SIGKILL was needed

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the process group's and the session's id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The leader's exit status once it has exited, else ``None``."""
        return self._popen.poll()

    @property
    def stopped(self) -> bool:
        return self._killed is not None

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the leader to exit (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
        return self._popen.wait(timeout=timeout_s)

    def log_bytes(self) -> bytes:
        try:
            return self.log_path.read_bytes()
        except OSError:
            return b""

    def log_tail(self, lines: int | None = None) -> str:
        return log_tail(self.log_path, self.tail_lines if lines is None else lines)

    def process_ids(self) -> list[int]:
        """The live processes of its session: the leader and every descendant that stayed in it."""
        return session_pids(self.pid)

    def check_running(self) -> None:
        """Raise ``error`` ("NAME exited with N:" and the log tail) if the leader has exited."""
        code = self._popen.poll()
        if code is not None:
            raise self.error(f"{self.name} exited with {code}:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Send SIGTERM to the whole process group and return at once (see :meth:`stop`)."""
        if self._killed is None:
            _signal_group(self.pid, signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> bool:
        """SIGTERM the group, wait up to ``grace_s`` for all of it, SIGKILL what is left, reap.

        Returns once neither the group nor any process of the session is alive; ``True`` when
        SIGKILL was needed. Idempotent: a second call returns the first one's answer.
        """
        if self._killed is not None:
            return self._killed
        pgid = self.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=grace_s)
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed = self._popen.poll() is None or _group_alive(pgid)
        if killed:
            log.warning(
                "%s (process group %d) still running %.1f s after SIGTERM: killing",
                self.name,
                pgid,
                grace_s,
            )
            _signal_group(pgid, signal.SIGKILL)
        self._popen.wait()
        reap_deadline = time.monotonic() + _REAP_LIMIT_S
        while _group_alive(pgid) and time.monotonic() < reap_deadline:
            time.sleep(0.01)  # SIGKILL cannot be ignored; the kernel ends them within milliseconds
        strays = session_pids(pgid)  # left the group (setpgid) but not the session
        while strays and time.monotonic() < reap_deadline:
            killed = True
            for pid in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
            strays = session_pids(pgid)
        self._killed = killed
        return killed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Some process of group ``pgid`` still runs (zombies waiting for their reaper do not count:
    a killed worker reparented to a slow init would otherwise look alive for seconds)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a reused id we do not own: ours is gone
        return False
    return bool(_live_pids(pgid, _PGRP))


# -- readiness -----------------------------------------------------------------------------------


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url`` answered 200 (any error, refusal or other status: ``False``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


def _not_ready(proc: ChildProcess, url: str, timeout_s: float) -> ProcessError:
    return proc.error(f"{proc.name} not ready at {url} after {timeout_s:.0f} s:\n{proc.log_tail()}")


def wait_http_ready(
    url: str,
    proc: ChildProcess,
    timeout_s: float,
    *,
    interval_s: float = 0.1,
    request_timeout_s: float = 2.0,
) -> None:
    """Block until ``GET url`` answers 200; raise ``proc.error`` at once if ``proc`` exits, or
    after ``timeout_s``, with the log tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.check_running()
        if http_ok(url, request_timeout_s):
            return
        if time.monotonic() >= deadline:
            raise _not_ready(proc, url, timeout_s)
        time.sleep(interval_s)


async def wait_http_ready_async(
    url: str,
    proc: ChildProcess,
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    request_timeout_s: float = 2.0,
) -> None:
    """:func:`wait_http_ready` for an event loop (aiohttp; the loop keeps running meanwhile)."""
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            proc.check_running()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() >= deadline:
                raise _not_ready(proc, url, timeout_s)
            await asyncio.sleep(interval_s)


# -- /proc ---------------------------------------------------------------------------------------


_PGRP, _SESSION = 2, 3  # /proc/PID/stat after the ")" of the command: state ppid pgrp session …


def _live_pids(ident: int, field: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[field]) == ident and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return sorted(pids)


def session_pids(sid: int) -> list[int]:
    """Ids of the live processes in session ``sid`` (Linux ``/proc``): a server and its workers."""
    return _live_pids(sid, _SESSION)


def rss_bytes(pids: Iterable[int]) -> int:
    """Sum of resident set sizes (``VmRSS``); shared pages are counted once per process."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total
