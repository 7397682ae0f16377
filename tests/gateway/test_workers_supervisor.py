"""The supervisor of ``serve --workers N``, stepped by the test under a fake clock.

The workers are real forked processes (the supervisor's own ``fork``), but each one only says
*ready* (or does not) and exits with a status the test chose, and the test waits for that exit
with ``waitid(WNOWAIT)`` — an event, not a sleep — before it calls :meth:`Supervisor.step`. The
back-off between restarts is the supervisor's clock, a fake one here: a restart is scheduled,
not taken a moment before it is due, taken when it is, and counted once. (The real gateway's
workers — sockets, signals, SIGTERM drains — are tests/gateway/test_workers.py.)"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core import jsonx
from gateway.workers import STATUS_FILE, Supervisor, WorkerIdentity
from tests.rollout.test_fleet_controller import FakeClock


def crashing(status: int, *, ready: bool) -> Callable[..., int]:
    """A worker that says ready (or not) and exits with ``status``."""

    def main(
        _who: WorkerIdentity, _socks: list[socket.socket], say_ready: Callable[[], None]
    ) -> int:
        if ready:
            say_ready()
        return status

    return main


def workers(run_dir: Path) -> list[dict[str, Any]]:
    doc = jsonx.loads((run_dir / STATUS_FILE).read_bytes())
    return list(doc["workers"])


def exit_of(sup: Supervisor, run_dir: Path) -> None:
    """Wait for the one worker to exit (left for the supervisor to reap), then step once."""
    (w,) = workers(run_dir)
    os.waitid(os.P_PID, w["pid"], os.WEXITED | os.WNOWAIT)
    sup.step(0)


def test_a_worker_that_crashes_after_ready_is_restarted_once_when_its_back_off_is_due(
    tmp_path: Path,
) -> None:
    clock = FakeClock(now=1000.0)
    (tmp_path / "metrics").mkdir()
    sup = Supervisor([[]], crashing(3, ready=True), run_dir=tmp_path, shutdown_timeout_s=1.0,
                     clock=clock)  # fmt: skip
    sup.start()
    first = workers(tmp_path)[0]["pid"]
    exit_of(sup, tmp_path)
    (w,) = workers(tmp_path)
    assert (w["pid"], w["restarts"], w["last_exit"]["status"]) == (None, 1, 3)
    clock.advance(0.24)
    sup.step(0)
    assert workers(tmp_path)[0]["pid"] is None  # 0.25 s back-off: not yet
    clock.advance(0.01)
    sup.step(0)
    (w,) = workers(tmp_path)
    assert w["pid"] not in (None, first) and w["restarts"] == 1  # restarted, counted once
    clock.advance(5.0)  # a second crash within the minute: the back-off doubles
    exit_of(sup, tmp_path)
    assert workers(tmp_path)[0]["restarts"] == 2
    clock.advance(0.49)
    sup.step(0)
    assert workers(tmp_path)[0]["pid"] is None
    clock.advance(0.01)
    sup.step(0)
    assert workers(tmp_path)[0]["pid"] is not None
    exit_of(sup, tmp_path)  # leave no worker behind
    assert sup.fatal is None


def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path: Path) -> None:
    """Status 2 before ready (a configuration error every worker would hit): give up at once
    with 2. Three failures of another kind before ready in a row: give up with 1."""
    sup = Supervisor([[]], crashing(2, ready=False), run_dir=tmp_path, shutdown_timeout_s=1.0,
                     clock=FakeClock())  # fmt: skip
    sup.start()
    exit_of(sup, tmp_path)
    assert sup.fatal == 2 and workers(tmp_path)[0]["restarts"] == 0
    clock = FakeClock()
    other = tmp_path / "other"
    other.mkdir()
    sup = Supervisor([[]], crashing(1, ready=False), run_dir=other, shutdown_timeout_s=1.0,
                     clock=clock)  # fmt: skip
    sup.start()
    for attempt in (1, 2):
        exit_of(sup, other)
        assert sup.fatal is None and workers(other)[0]["restarts"] == attempt
        clock.advance(10.0)  # the back-off is due
        sup.step(0)
    exit_of(sup, other)
    assert sup.fatal == 1
