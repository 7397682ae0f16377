"""``--workers``: the number, the shared state it needs, and binding the one port N times."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from core.procs import free_port
from gateway.serve import ListenError
from gateway.settings import Settings, SettingsError, parse_workers
from gateway.workers import bind_sockets, make_run_dir
from specshadow.workers import state_for_workers


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("1", 1),
        ("3", 3),
        (" 2 ", 2),
        ("auto", len(os.sched_getaffinity(0))),
        ("AUTO", len(os.sched_getaffinity(0))),
        ("0", len(os.sched_getaffinity(0))),
    ],
)
def test_worker_counts(value: str, want: int) -> None:
    assert parse_workers(value) == want


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("two", "expected a number of workers or 'auto', got 'two'"),
        ("-1", "must be 0 (auto) or more, got -1"),
    ],
)
def test_a_bad_worker_count_names_the_variable(value: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"SPECSHADOW_WORKERS": value})
    assert info.value.problems == [f"SPECSHADOW_WORKERS: {message}"]


def test_one_worker_keeps_the_json_file_and_more_need_a_shared_store(tmp_path: Path) -> None:
    default = str(tmp_path / "specshadow" / "rollout.json")
    assert state_for_workers(None, default, 1) == (default, None)
    assert state_for_workers("mine.json", default, 1) == ("mine.json", None)
    sqlite = f"sqlite://{tmp_path / 'specshadow' / 'rollout.sqlite'}"
    assert state_for_workers(None, default, 2) == (sqlite, None)
    assert state_for_workers("sqlite:///x/y.db", default, 4) == ("sqlite:///x/y.db", None)
    state, problem = state_for_workers(str(tmp_path / "r.json"), default, 2)
    assert state is None and problem is not None
    assert problem.startswith(f"--state {tmp_path / 'r.json'}: 2 workers cannot share a JSON")
    assert f"sqlite://{tmp_path / 'r.sqlite'}" in problem


def test_serve_refuses_a_json_state_file_for_two_workers_before_it_starts(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specshadow",
            "serve",
            "--workers",
            "2",
            "--port",
            str(free_port()),
            "--primary",
            "http://127.0.0.1:9",
            "--state",
            str(tmp_path / "state.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "2 workers cannot share a JSON state file" in out.stderr


def test_n_sockets_share_one_port_and_a_taken_port_is_one_line() -> None:
    groups = bind_sockets("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for g in groups for s in g}
        assert len(groups) == 3 and len(ports) == 1
        port = ports.pop()
        # Another program (no SO_REUSEPORT) cannot take the port while the gateway holds it.
        with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(
                ListenError, match=r"cannot listen on 127\.0\.0\.1:\d+: the port is already in use"
            ):
                bind_sockets("127.0.0.1", taken.getsockname()[1], 2)
    finally:
        for g in groups:
            for s in g:
                s.close()


def test_a_run_folder_left_by_a_killed_gateway_is_removed_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer exists
    for name, pid in (
        ("specshadow-gateway-dead", dead.pid),
        ("specshadow-gateway-live", os.getpid()),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "workers.json").write_text(json.dumps({"parent_pid": pid}))
    (tmp_path / "specshadow-gateway-starting").mkdir()  # no status yet: left alone
    mine = make_run_dir()
    assert mine.parent == tmp_path and (mine / "metrics").is_dir()
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"specshadow-gateway-live", "specshadow-gateway-starting", mine.name}
