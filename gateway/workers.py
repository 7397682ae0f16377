"""``serve --workers N``: N gateway processes behind one port, supervised by their parent.

**One port, N sockets.** The parent binds N listening sockets to the one address, each with
``SO_REUSEPORT``, before any worker exists, and hands socket *i* to worker *i* (inherited across
``fork``). The kernel spreads new connections over the N sockets by a hash of the connection's
addresses, so the workers share the load evenly without a thundering herd — a single socket
shared by every worker leaves the balance to whichever process wins each ``accept``, which on a
busy core is seldom the idle one. Because the *parent* holds every socket for the life of the
gateway:

- the port is bound once, at start, with the one-line errors of :func:`gateway.serve.check_listen`
  (in use, not local, not permitted) and exit status 2 — no worker can lose a bind race later;
- a worker that dies leaves its socket open: connections the kernel queued on it wait there
  (instead of being reset) and the worker that replaces it accepts them; the set of sockets, and
  so the kernel's spreading, never changes while the gateway runs;
- no other program can take a share of the port between a crash and the restart.

**Lifecycle.** Workers are forked from the parent after the settings were checked and the
backends asked what they are (once, so every worker runs the same policy). A worker reports
*ready* over a pipe when its application has started. The parent then:

- restarts a worker that exits after it was ready, after a back-off that grows while it keeps
  crashing (0.25 s doubling, at most :data:`MAX_BACKOFF_S`), and logs the exit (status or
  signal, how long it had run);
- gives up when a worker fails before it was ready :data:`STARTUP_ATTEMPTS` times in a row (exit
  status 1), or at once when it exits with status 2 (a configuration error every worker would
  hit: the worker printed the reason);
- on SIGTERM or SIGINT closes its copies of the sockets and sends SIGTERM to every worker; each
  stops accepting and drains in-flight requests for ``shutdown_timeout_s`` (as one process
  does); a worker still alive :data:`KILL_AFTER_S` later is killed; a second signal kills at once;
- forwards SIGHUP (reload the policy) to every worker;
- and, when a worker dies, folds its last metric snapshot into the gateway's retired counters
  (:func:`otel.multiproc.retire`). Workers die with the parent (``PR_SET_PDEATHSIG``).

The parent keeps ``workers.json`` in the run folder (each worker's pid, start, readiness,
restarts and last exit), which every worker serves as ``GET /admin/workers``; every response of a
worker carries :data:`WORKER_HEADER` (``<index>;pid=<pid>``) so an operator can tell who answered.

Size: the supervisor is one loop over one set of state (slots, pipes, signals, the stop); its
helpers (binding, the child's setup, the status file) make no sense apart from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

from core import jsonx
from gateway.admin import authorize
from gateway.serve import ListenError, listen_problem
from otel.multiproc import retire

log = logging.getLogger(__name__)

WORKER_HEADER = "x-specshadow-worker"
STARTUP_ATTEMPTS = 3  # a worker that fails before it is ready this many times in a row: give up
MAX_BACKOFF_S = 10.0
KILL_AFTER_S = 10.0  # after shutdown_timeout_s: the stop is forced
CRASH_WINDOW_S = 60.0  # crashes within this window make the back-off grow
BACKLOG = 1024
STATUS_FILE = "workers.json"

# What the worker function is given: who it is, its sockets, and a callable to say "ready".
WorkerMain = Callable[["WorkerIdentity", list[socket.socket], Callable[[], None]], int]


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who a worker is: its slot, the gateway it belongs to, and the gateway's run folder."""

    index: int
    count: int
    gateway_id: str
    run_dir: Path

    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / "metrics"

    @property
    def instance_id(self) -> str:
        return f"{self.gateway_id}-{self.index}"

    def resource_attributes(self) -> dict[str, str | int]:
        """What tells this worker's OTLP export apart from its siblings'."""
        return {
            "service.instance.id": self.instance_id,
            "specshadow.worker.index": self.index,
            "specshadow.worker.count": self.count,
            "process.pid": os.getpid(),
        }


def bind_sockets(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """``count`` sets of listening sockets (one per address ``host`` resolves to), all on one
    port with ``SO_REUSEPORT``. Port 0: the first bind picks it, the rest follow. Raises
    :class:`ListenError` with one line."""
    if not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - every platform we ship on
        raise ListenError("--workers needs SO_REUSEPORT, which this platform lacks")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"--host: cannot resolve {host!r}: {exc.strerror}") from None
    addresses: list[tuple[socket.AddressFamily, Any]] = []
    for info in infos:
        if (info[0], info[4]) not in addresses:
            addresses.append((info[0], info[4]))
    out: list[list[socket.socket]] = []
    chosen = port
    try:
        for _ in range(count):
            group: list[socket.socket] = []
            out.append(group)
            for family, addr in addresses:
                sock = _listener(family, (addr[0], chosen, *addr[2:]), host)
                if sock is None:
                    continue
                group.append(sock)
                chosen = sock.getsockname()[1]
            if not group:
                raise ListenError(f"cannot listen on {host}:{port}: no address is available")
    except BaseException:
        for group in out:
            for sock in group:
                sock.close()
        raise
    return out


def _listener(
    family: socket.AddressFamily, addr: tuple[Any, ...], host: str
) -> socket.socket | None:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # the family is not enabled here: asyncio skips it too
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:  # an IPv6 "localhost" without IPv6: skipped
            return None
        raise ListenError(listen_problem(host, addr[1], exc)) from None
    return sock


RUN_PREFIX = "specshadow-gateway-"


def make_run_dir() -> Path:
    """A private folder for this gateway's workers (metric snapshots, sockets, status);
    under ``$XDG_RUNTIME_DIR`` when set. Removed when the gateway stops; the folders of gateways
    whose parent was killed (SIGKILL leaves no time to remove them) are removed here."""
    env = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(env) if env and os.path.isdir(env) else Path(tempfile.gettempdir())
    for old in base.glob(f"{RUN_PREFIX}*"):
        _remove_if_orphaned(old)
    path = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=base))
    (path / "metrics").mkdir()
    return path


def _remove_if_orphaned(folder: Path) -> None:
    try:
        parent = int(jsonx.loads((folder / STATUS_FILE).read_bytes())["parent_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # starting right now, or not ours to judge
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        shutil.rmtree(folder, ignore_errors=True)
    except PermissionError:  # alive, another user's
        return


@dataclass(slots=True)
class _Slot:
    index: int
    sockets: list[socket.socket]
    pid: int | None = None
    started: float = 0.0  # the supervisor's clock
    started_unix: float = 0.0
    ready: bool = False
    ready_fd: int | None = None
    restarts: int = 0
    failed_starts: int = 0  # in a row, before ready
    crashes: list[float] = field(default_factory=list)  # the supervisor's clock, recent
    restart_at: float | None = None
    last_exit: dict[str, Any] | None = None


def _exit_text(status: int) -> tuple[str, dict[str, Any]]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return f"killed by {name}", {"signal": name}
    code = os.WEXITSTATUS(status)
    return f"exited with status {code}", {"status": code}


class Supervisor:
    """The parent of ``serve --workers N``: see the module docstring. :meth:`run` returns the
    process's exit status."""

    def __init__(
        self,
        sockets: Sequence[list[socket.socket]],
        main: WorkerMain,
        *,
        run_dir: Path,
        shutdown_timeout_s: float,
        gateway_id: str | None = None,
        where: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = [_Slot(i, list(socks)) for i, socks in enumerate(sockets)]
        self.clock = clock  # seconds: a worker's age, crash window and back-off
        self.main = main
        self.run_dir = run_dir
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.shutdown_timeout_s = shutdown_timeout_s
        self.where = where
        self._sel = selectors.DefaultSelector()
        self._stop_signals = 0
        self._hup = False
        self._fatal: int | None = None
        self._stopping = False  # the set is being stopped: an exit is not restarted
        self._announced = False
        self._wake: tuple[int, ...] = ()  # the signal wake-up pipe, while run() runs

    # --- the parent's loop ------------------------------------------------------------------

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self._sel.register(wake_r, selectors.EVENT_READ, None)
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT,
                                                      signal.SIGHUP, signal.SIGCHLD)}  # fmt: skip
        old_wakeup = signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # wakes the selector
        self._wake = (wake_r, wake_w)
        try:
            self.start()
            while not self._stop_signals and self._fatal is None:
                self.step(0.5)
            return self._stop()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._sel.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            for slot in self.slots:
                self._close_ready(slot)
                for sock in slot.sockets:
                    sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_stop(self, _sig: int, _frame: FrameType | None) -> None:
        self._stop_signals += 1
        if self._stop_signals > 1:
            self._signal_all(signal.SIGKILL)

    def _on_hup(self, _sig: int, _frame: FrameType | None) -> None:
        self._hup = True

    def start(self) -> None:
        """Fork every worker (:meth:`run` does, after installing its signal handlers)."""
        for slot in self.slots:
            self._spawn(slot)

    @property
    def fatal(self) -> int | None:
        """The exit status the supervisor gives up with (a worker that cannot start), if any."""
        return self._fatal

    def step(self, timeout_s: float) -> None:
        """One turn of the supervisor: wait up to ``timeout_s`` for a ready pipe or a signal,
        reap the workers that exited (a restart is scheduled on :attr:`clock`), forward a
        SIGHUP, fork the workers whose restart is due by :attr:`clock`. :meth:`run` repeats it
        with the monotonic clock; a test calls it under a fake one."""
        for key, _mask in self._sel.select(timeout_s):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    while os.read(key.fd, 512):
                        pass
            else:
                self._on_ready_pipe(key.data)
        self._reap()
        if self._hup:
            self._hup = False
            log.info("SIGHUP: the policy is reloaded in every worker")
            self._signal_all(signal.SIGHUP, ready_only=True)
        now = self.clock()
        for slot in self.slots:
            due = slot.restart_at is not None and now >= slot.restart_at
            if slot.pid is None and due and not self._stopping:
                self._spawn(slot)

    def _on_ready_pipe(self, slot: _Slot) -> None:
        assert slot.ready_fd is not None
        try:
            data = os.read(slot.ready_fd, 16)
        except OSError:
            data = b""
        if data:
            slot.ready = True
            slot.failed_starts = 0
            if slot.restarts:
                log.warning("worker %d (pid %d) is serving again", slot.index, slot.pid)
            if not self._announced and all(s.ready for s in self.slots):
                self._announced = True
                log.info("%d workers serving%s (pids %s)", len(self.slots), self.where,
                         ", ".join(str(s.pid) for s in self.slots))  # fmt: skip
            self._write_status()
        self._close_ready(slot)

    def _close_ready(self, slot: _Slot) -> None:
        if slot.ready_fd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(slot.ready_fd)
            with contextlib.suppress(OSError):
                os.close(slot.ready_fd)
            slot.ready_fd = None

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is not None:
                self._exited(slot, status)

    def _exited(self, slot: _Slot, status: int) -> None:
        pid = slot.pid
        assert pid is not None
        lived = self.clock() - slot.started
        text, detail = _exit_text(status)
        slot.last_exit = {**detail, "pid": pid, "at_unix": time.time(), "after_s": round(lived, 3)}
        was_ready, slot.pid, slot.ready = slot.ready, None, False
        self._close_ready(slot)
        with contextlib.suppress(OSError):
            retire(self.run_dir / "metrics", pid)
        if self._stopping or self._stop_signals:
            self._write_status()
            return
        now = self.clock()
        if not was_ready:
            slot.failed_starts += 1
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 2:
                log.error("worker %d (pid %d) could not start (%s): stopping the gateway",
                          slot.index, pid, text)  # fmt: skip
                self._fatal = 2
                return
            if slot.failed_starts >= STARTUP_ATTEMPTS:
                log.error("worker %d failed to start %d times in a row (last: %s): stopping the "
                          "gateway", slot.index, slot.failed_starts, text)  # fmt: skip
                self._fatal = 1
                return
        slot.crashes = [t for t in slot.crashes if now - t < CRASH_WINDOW_S] + [now]
        backoff = min(MAX_BACKOFF_S, 0.25 * 2 ** (len(slot.crashes) - 1))
        slot.restart_at = now + backoff
        slot.restarts += 1
        log.warning("worker %d (pid %d) %s after %.1f s%s: restarting in %.2f s", slot.index, pid,
                    text, lived, "" if was_ready else " before it was ready", backoff)  # fmt: skip
        self._write_status()

    def _spawn(self, slot: _Slot) -> None:
        read_fd, write_fd = os.pipe()
        identity = WorkerIdentity(slot.index, len(self.slots), self.gateway_id, self.run_dir)
        parent = os.getpid()
        if threading.active_count() > 1:  # a lock held by another thread stays held in the child
            log.warning("forking worker %d with %d threads running in the parent: %s", slot.index,
                        threading.active_count(), [t.name for t in threading.enumerate()])  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.close(read_fd)
                self._child_setup(slot, parent)
                code = self.main(identity, slot.sockets, _ready_signal(write_fd))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("worker %d failed", slot.index)
                code = 1
            finally:
                logging.shutdown()
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(write_fd)
        slot.pid, slot.ready, slot.restart_at = pid, False, None
        slot.started, slot.started_unix = self.clock(), time.time()
        slot.ready_fd = read_fd
        self._sel.register(read_fd, selectors.EVENT_READ, slot)
        self._write_status()

    def _child_setup(self, slot: _Slot, parent: int) -> None:
        """In the forked worker: the parent's signal handling undone, other slots' sockets and
        the parent's pipes closed, death with the parent arranged."""
        # A group of its own: a terminal's Ctrl-C reaches the parent alone, which then stops
        # every worker once (a second signal would cut a worker's drain short).
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A SIGHUP forwarded before the policy watcher took it must not kill the worker.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._sel.close()
        for fd in self._wake:
            os.close(fd)
        for other in self.slots:
            if other is not slot:
                for sock in other.sockets:
                    sock.close()
                if other.ready_fd is not None:
                    os.close(other.ready_fd)
        _die_with_parent(parent)

    def _signal_all(self, sig: signal.Signals, *, ready_only: bool = False) -> None:
        for slot in self.slots:
            if slot.pid is not None and (slot.ready or not ready_only):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, sig)

    def _stop(self) -> int:
        """Every worker stopped: SIGTERM (graceful drain), then SIGKILL after the bound."""
        self._stopping = True
        if self._stop_signals:
            log.info("stopping %d workers", sum(s.pid is not None for s in self.slots))
        # The parent's copies closed first: once a worker closes its own, the socket is gone
        # and new connections are refused at once rather than queued for nobody.
        for slot in self.slots:
            for sock in slot.sockets:
                sock.close()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout_s + KILL_AFTER_S
        while any(s.pid is not None for s in self.slots):
            if time.monotonic() >= deadline:
                log.error("workers still running %.0f s after SIGTERM: killed",
                          self.shutdown_timeout_s + KILL_AFTER_S)  # fmt: skip
                self._signal_all(signal.SIGKILL)
                deadline = time.monotonic() + 5.0
            self.step(0.1)
        failed = [
            s for s in self.slots if s.last_exit and s.last_exit.get("status") not in (0, None)
        ]
        if self._fatal is not None:
            return self._fatal
        return 1 if failed else 0

    def _write_status(self) -> None:
        doc = {
            "gateway_id": self.gateway_id,
            "parent_pid": os.getpid(),
            "workers": [
                {
                    "index": s.index,
                    "pid": s.pid,
                    "ready": s.ready,
                    "started_unix": s.started_unix if s.pid is not None else None,
                    "restarts": s.restarts,
                    "last_exit": s.last_exit,
                }
                for s in self.slots
            ],
        }
        path = self.run_dir / STATUS_FILE
        tmp = path.with_name(f".{STATUS_FILE}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_bytes(jsonx.dumps(doc))
            os.replace(tmp, path)


def status_families(run_dir: Path) -> list[dict[str, Any]]:
    """The worker set as metric families (the snapshot format of :mod:`otel.multiproc`), from
    the parent's ``workers.json``: ``specshadow_workers_restarts_total{specshadow_worker}`` (the
    supervisor's count per slot: alert on its increase for a crash loop) and
    ``specshadow_workers_ready``."""
    try:
        doc = jsonx.loads((run_dir / STATUS_FILE).read_bytes())
    except (OSError, ValueError):
        return []
    workers = doc.get("workers", [])
    restarts = [
        {"attributes": {"specshadow.worker": str(w["index"])}, "value": int(w["restarts"])}
        for w in workers
    ]
    ready = [{"attributes": {}, "value": sum(1 for w in workers if w["ready"])}]
    return [
        {"name": "specshadow.workers.restarts", "unit": "{restart}", "kind": "counter",
         "description": "Worker processes the supervisor restarted, per slot (serve --workers).",
         "points": restarts},
        {"name": "specshadow.workers.ready", "unit": "{worker}", "kind": "updown",
         "description": "Worker processes serving (serve --workers).", "points": ready},
    ]  # fmt: skip


def _ready_signal(fd: int) -> Callable[[], None]:
    done = False

    def ready() -> None:
        nonlocal done
        if not done:
            done = True
            with contextlib.suppress(OSError):
                os.write(fd, b"r")
                os.close(fd)

    return ready


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this worker when the parent dies (Linux); a worker never outlives it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # died between fork and prctl
        os._exit(1)


# --- the worker's side of the admin API -----------------------------------------------------


def install(app: web.Application, identity: WorkerIdentity, ready: Callable[[], None]) -> None:
    """Make ``app`` a worker of the set: the worker header on every response, ``GET
    /admin/workers``, and *ready* once the application has started."""
    value = f"{identity.index};pid={os.getpid()}"

    async def stamp(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = value

    async def started(_app: web.Application) -> None:
        ready()

    async def workers(request: web.Request) -> web.Response:
        authorize(request)
        try:
            doc = jsonx.loads((identity.run_dir / STATUS_FILE).read_bytes())
        except (OSError, ValueError):
            doc = {"workers": []}
        doc["answered_by"] = {"index": identity.index, "pid": os.getpid()}
        return web.Response(body=jsonx.dumps(doc, indent=True), content_type="application/json")

    app.on_response_prepare.append(stamp)
    app.on_startup.append(started)
    app.router.add_get("/admin/workers", workers)
