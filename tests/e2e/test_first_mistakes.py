"""The first mistakes a user makes, typed as a user types them: each ends in one line on stderr
that names the thing and what to do, the exit status the README documents (2 for a bad argument
or setting, 1 for nothing to work on) and no traceback — from every subcommand, with and
without ``serve --workers``. Each test runs the real console script (``python -m specshadow``)
on files: no server where a file will do (``serve`` fails before anything listens)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from core.procs import free_port
from records.sqlite_store import RecordStore
from rollout.state import RuleState, Transition
from rollout.store import SqliteStateStore
from tests.report.synthetic import records
from tests.report.test_front_door import T0, _rolled_out

pytestmark = pytest.mark.e2e


def specshadow(*args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specshadow", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "0"},
    )


def one_line(result: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    """The run ended with ``status`` and exactly one line on stderr, holding ``words``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode == status, (result.returncode, result.stderr)
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A store of 30 records, an empty store, a corrupt file and a folder."""
    root = tmp_path_factory.mktemp("stores")
    store = RecordStore(root / "records.sqlite")
    store.append(records(speedups={"chat": 1.5}, n=30))
    store.close()
    RecordStore(root / "empty.sqlite").close()
    (root / "corrupt.sqlite").write_text("not a database\n")
    (root / "folder").mkdir()
    return {
        "good": root / "records.sqlite",
        "empty": root / "empty.sqlite",
        "corrupt": root / "corrupt.sqlite",
        "folder": root / "folder",
    }


# -- store faults -----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("fault", ["corrupt", "folder"])
def test_serve_on_a_bad_store_says_so_once_and_exits_2(
    stores: dict[str, Path], fault: str, workers: str
) -> None:
    result = specshadow(
        "serve", "--port", "0", "--primary", "http://127.0.0.1:9", "--primary-kind", "openai",
        "--store", str(stores[fault]), "--workers", workers,
        "--state", f"sqlite:///{stores['good'].parent}/state-{fault}-{workers}.sqlite",
    )  # fmt: skip
    line = one_line(result, 2, "specshadow serve:", str(stores[fault]))
    assert ("is a folder" if fault == "folder" else "not a SQLite record store") in line


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_corrupt_state_store_says_so_once_and_exits_2(
    stores: dict[str, Path], workers: str
) -> None:
    state = f"sqlite:///{stores['corrupt']}"
    result = specshadow(
        "serve", "--port", "0", "--primary", "http://127.0.0.1:9", "--primary-kind", "openai",
        "--state", state, "--workers", workers,
    )  # fmt: skip
    one_line(result, 2, "specshadow serve:", state, "not a rollout state store")


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("corrupt", "not a SQLite record store"),
        ("folder", "is a folder"),
        ("missing", "no such record store"),
    ],
)
def test_records_on_a_bad_store_says_so_and_exits_2(
    stores: dict[str, Path], fault: str, words: str
) -> None:
    path = str(stores.get(fault, stores["good"].parent / "missing.sqlite"))
    one_line(specshadow("records", "--store", path), 2, "specshadow records:", path, words)


@pytest.mark.parametrize("command", ["report", "counterfactual"])
def test_report_and_counterfactual_on_a_corrupt_store_say_so_and_exit_2(
    stores: dict[str, Path], command: str, tmp_path: Path
) -> None:
    result = specshadow(command, "--store", str(stores["corrupt"]), "--out", str(tmp_path))
    one_line(result, 2, f"specshadow {command}:", "not a SQLite record store")


# -- nothing to work on -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["report", "counterfactual"])
def test_report_and_counterfactual_on_an_empty_store_exit_1_saying_0_records(
    stores: dict[str, Path], command: str, tmp_path: Path
) -> None:
    result = specshadow(command, "--store", str(stores["empty"]), "--out", str(tmp_path / "o"))
    one_line(result, 1, f"0 records in {stores['empty']} (window: all time)")
    assert not (tmp_path / "o" / "report.html").exists()


def test_report_on_an_empty_window_exits_1_naming_the_window(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    result = specshadow(
        "report", "--store", str(stores["good"]), "--since", "2030-01-01", "--out", str(tmp_path)
    )
    one_line(result, 1, f"0 records in {stores['good']} (window 2030-01-01 00:00:00 UTC to now)")


# -- report --state ---------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["missing.json", "sqlite:///{dir}/missing.sqlite"])
def test_report_refuses_a_state_that_does_not_exist_naming_it(
    stores: dict[str, Path], state: str, tmp_path: Path
) -> None:
    state = state.format(dir=tmp_path)
    result = specshadow(
        "report", "--store", str(stores["good"]), "--out", str(tmp_path / "o"), "--state", state
    )
    one_line(result, 2, f"--state {state.replace('sqlite:///', 'sqlite:///')}", "no such file")
    assert not Path(tmp_path / "missing.sqlite").exists()  # a read never creates a store
    assert not (tmp_path / "o" / "report.html").exists()


def _seconds_apart(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records one second apart (synthetic ones are a nanosecond apart): a rollback's own
    time and the first shadow record's are then told apart."""
    for r in recs:
        r["started_unix_ns"] = T0 + (r["started_unix_ns"] - T0) * 1_000_000_000
    return recs


@pytest.mark.parametrize("kind", ["json", "sqlite"])
def test_report_state_reads_every_store_serve_writes_keeping_the_operators_reason_and_time(
    tmp_path: Path, kind: str
) -> None:
    """An operator rolls rule ``eagle`` back at T0 + 25 s; the records show shadow from 30 s.
    The report names the operator, their words, and 25 s — read from the JSON file or a shared
    SQLite store, where a later promotion does not hide the rollback."""
    recs = _seconds_apart(_rolled_out())
    store = RecordStore(tmp_path / "records.sqlite")
    store.append(recs)
    store.close()
    at = (T0 + 25 * 10**9) / 1e9
    reason = "operator: p99 looks wrong on the dashboard"
    back = Transition("eagle", "canary", "shadow", 0.0, at, "operator", reason)
    rolled = RuleState("shadow", "x", rolled_back=True, since_unix=at, last=back)
    if kind == "json":
        state = str(tmp_path / "rollout.json")
        Path(state).write_text(json.dumps({"version": 1, "rules": {"eagle": rolled.to_json()}}))
    else:
        state = f"sqlite:///{tmp_path}/rollout.sqlite"
        shared = SqliteStateStore(f"{tmp_path}/rollout.sqlite")
        up = Transition("eagle", "shadow", "canary", 0.1, at - 15, "operator", "promote")
        head = shared.cas("eagle", None, RuleState("canary", "x", last=up), "r1")
        head = shared.cas("eagle", head, rolled, "r1")
        again = Transition("eagle", "shadow", "canary", 0.1, at + 9, "operator", "promote")
        shared.cas("eagle", head, RuleState("canary", "x", last=again), "r1")
        shared.close()
    out = tmp_path / "report"
    result = specshadow(
        "report", "--store", str(tmp_path / "records.sqlite"), "--out", str(out), "--state", state
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    (rb,) = jsonx.loads((out / "report.json").read_bytes())["rollbacks"]
    assert (rb["by"], rb["reason"], rb["rule"]) == ("operator", reason, "eagle")
    assert abs(rb["at_unix_ns"] - (T0 + 25 * 10**9)) < 1000  # its own time, not the 30 s record
    assert reason in (out / "report.md").read_text()


# -- records: copy, shared options, pipes -----------------------------------------------------


def test_records_copy_writes_json_lines_to_a_jsonl_that_report_reads_and_adds_nothing_twice(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "x.jsonl"
    for added in (30, 0):
        result = specshadow("records", "copy", "--from", str(stores["good"]), "--to", str(target))
        one_line(result, 0, f"copied {added} new records to {target}")
    lines = target.read_bytes().splitlines()
    assert len(lines) == 30 and len({jsonx.loads(x)["exchange_id"] for x in lines}) == 30
    again = tmp_path / "again.sqlite"
    for added in (30, 0):  # SQLite alike: the insert is idempotent on the exchange id
        result = specshadow("records", "copy", "--from", str(target), "--to", str(again))
        one_line(result, 0, f"copied {added} new records")
    with sqlite3.connect(again) as db:
        assert db.execute("SELECT count(*) FROM records").fetchone() == (30,)
    result = specshadow("report", "--store", str(target), "--out", str(tmp_path / "report"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (tmp_path / "report" / "report.html").exists()


def test_records_copy_refuses_a_destination_named_for_another_format(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "x.csv"
    result = specshadow("records", "copy", "--from", str(stores["good"]), "--to", str(target))
    one_line(result, 2, f"--to {target}", ".jsonl")
    assert not target.exists()


def test_the_shared_options_are_read_before_and_after_the_subcommand(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    for args in (
        ["records", "--store", str(stores["good"]), "export"],
        ["records", "export", "--store", str(stores["good"])],
    ):
        out = tmp_path / "rows.jsonl"
        result = specshadow(*args, "--format", "conversations", "--out", str(out))
        one_line(result, 0, "of 30 records")
    # --since before `copy` is the copy's window: nothing from 2030 on.
    result = specshadow(
        "records", "--since", "2030-01-01", "copy",
        "--from", str(stores["good"]), "--to", str(tmp_path / "none.jsonl"),
    )  # fmt: skip
    one_line(result, 0, "copied 0 new records")


@pytest.mark.parametrize(
    "args", [["records", "--store", "{store}"], ["records", "sql", "--otel-logs", "otel.logs"]]
)
def test_piping_records_into_head_prints_no_traceback(tmp_path: Path, args: list[str]) -> None:
    big = tmp_path / "big.sqlite"
    store = RecordStore(big)
    store.append(records(speedups={"chat": 1.5}, n=600))  # far more than a pipe buffer holds
    store.close()
    argv = [a.format(store=big) for a in args]
    # `| head` that has already gone: the pipe's reader is closed before the first write, so
    # every write fails, however little the command prints (no race with the reader).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = specshadow(*argv, stdout=write_end)
    finally:
        os.close(write_end)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_rollout_status_json_into_a_closed_pipe_does_not_blame_the_gateway() -> None:
    """``rollout status --json | head``: the reader left, the gateway answered — no "cannot
    reach" line, no traceback, status 0. The gateway here is a stdlib server with its answer."""
    body = json.dumps({"rules": {f"rule-{i}": {"stage": "shadow"} for i in range(2000)}}).encode()

    class Admin(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Admin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = specshadow("rollout", "status", "--json", "--gateway", url, stdout=write_end)
    finally:
        os.close(write_end)
        server.shutdown()
        server.server_close()
        thread.join()
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_simulate_on_a_busy_port_says_so_and_exits_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = specshadow("simulate", "--port", str(port))
    one_line(result, 2, f"cannot listen on 127.0.0.1:{port}", "already in use")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_single_gateway_says_it_is_stopping_on_sigint_and_sigterm(sig: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specshadow", "serve", "--port", str(port),
         "--primary", "http://127.0.0.1:9", "--primary-kind", "openai"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    log = []
    for line in proc.stderr:  # up once it says where it serves
        log.append(line)
        if "Running on" in line:
            break
    proc.send_signal(sig)
    log += proc.stderr.readlines()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0
    text = "".join(log)
    assert "stopping: no new connections" in text and text.rstrip().endswith("stopped"), text
    assert "Traceback" not in text
