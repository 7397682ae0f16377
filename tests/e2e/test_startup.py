"""How ``specshadow serve`` starts, as the real subprocess: backend kinds detected or stated (and
what that buys in the records), the startup summary, warnings for idle flags, failing shadow legs
in the log, one line and exit status 2 for every start that cannot work, ``--version``, and the
help of every subcommand."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from core.procs import free_port
from specshadow.main import HelpFormatter, build_parser
from tests.reliability.helpers import wait_healthy

pytestmark = pytest.mark.e2e

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def specshadow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specshadow", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log: Any

    def stderr(self) -> str:
        self.log.seek(0)
        return str(self.log.read().decode(errors="replace"))


@asynccontextmanager
async def serve(args: Sequence[str], env: dict[str, str] | None = None) -> AsyncIterator[Gateway]:
    """``specshadow serve`` at INFO with its stderr kept; up once /healthz answers."""
    port = free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 — closed in finally
    proc = subprocess.Popen(  # noqa: ASYNC220 — started once
        [sys.executable, "-m", "specshadow", "serve", "--port", str(port), *args],
        env={**os.environ, "XDG_STATE_HOME": tempfile.gettempdir(), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log)
    try:
        await wait_healthy(gw.url, proc, gw.stderr)
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 20)
        log.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def chat(url: str) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=CHAT) as resp,
    ):
        assert resp.status == 200
        await resp.read()


def records(store: str) -> list[dict[str, Any]]:
    out = specshadow("records", "--store", store, "--last", "1h")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def leg(record: dict[str, Any], backend: str) -> dict[str, Any]:
    return next(x for x in record["legs"] if x["backend"] == backend)


async def test_kinds_are_detected_or_stated_and_the_records_show_the_difference(sims, tmp_path):
    """A policy-free start against simulators: the ones asked are found to be ``sim`` — so the
    candidate's records carry what it runs and its acceptance — the stated ``openai`` baseline is
    taken at its word (no such data), and a shadow on a closed port is ``openai`` with a warning;
    the summary says all of it, and the failing shadow's legs are logged by name, URL and error."""
    primary, candidate, baseline = await sims(), await sims(mode="speculative"), await sims()
    dead = closed_port_url()
    store = str(tmp_path / "records.sqlite")
    args = [
        "--primary", primary.base_url,
        "--shadow", candidate.base_url,
        "--shadow", dead,  # no --shadow-kind: both shadows are asked
        "--baseline", baseline.base_url,
        "--baseline-kind", "openai",
        "--shadow-ratio", "1",
        "--store", store,
    ]  # fmt: skip
    async with serve(args) as gw:
        for _ in range(6):  # the closed port's breaker opens after 5 failures
            await chat(gw.url)
        deadline = time.monotonic() + 20
        found: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            found = [r for r in records(store) if leg(r, "shadow-1")["speculative"] is not None]
            if len(found) >= 1:
                break
            await chat(gw.url)
            await asyncio.sleep(0.2)
        log = gw.stderr()
    lines = {re.sub(r"^\S+ \S+ ", "", line) for line in log.splitlines()}
    assert f"INFO specshadow.serve: primary at {primary.base_url}: sim (detected: " \
        "serves the simulator's /sim/requests)" in lines, log  # fmt: skip
    assert any(
        line.startswith("INFO specshadow.serve: shadow shadow-1 (candidate) at "
                        f"{candidate.base_url}: sim (detected")
        and line.endswith("mirrored 100 % of requests")
        for line in lines
    ), log  # fmt: skip
    assert any(
        f"shadow shadow-2 (candidate) at {dead}: openai (not reachable at startup" in line
        for line in lines
    ), log
    assert any(
        f"shadow baseline (baseline) at {baseline.base_url}: openai (stated)" in line
        for line in lines
    ), log
    assert any(f"store {store}; policy: none" in line for line in lines), log
    warned = [line for line in lines if "could not be asked what it is" in line]
    assert len(warned) == 1 and "shadow-2" in warned[0] and "--shadow-kind KIND" in warned[0]
    failed = [line for line in lines if "shadow leg to backend shadow-2" in line]
    assert len(failed) == 1, log  # rate-limited: one line however many legs failed
    assert dead in failed[0] and "UpstreamConnectError" in failed[0]
    opened = [line for line in lines if "shadow breaker for backend shadow-2" in line]
    assert len(opened) == 1 and "closed → open" in opened[0] and dead in opened[0], log
    assert "last error: UpstreamConnectError" in opened[0]
    assert "Traceback" not in log
    # What the kinds buy: the detected simulator's legs say what it runs and what it accepted.
    record = found[-1]
    cand, base = leg(record, "shadow-1"), leg(record, "baseline")
    assert cand["speculative"]["reported"]["source"] == "vllm_server_info"
    assert cand["acceptance"]["source"] is not None
    assert base["speculative"] is None and base["acceptance"]["source"] is None


async def test_a_stated_kind_wins_over_detection(sims):
    primary, candidate = await sims(), await sims(mode="speculative")
    args = ["--primary", primary.base_url, "--primary-kind", "openai",
            "--shadow", candidate.base_url, "--shadow-kind", "vllm"]  # fmt: skip
    async with serve(args) as gw:
        log = gw.stderr()
    assert f"primary at {primary.base_url}: openai (stated)" in log, log
    assert f"at {candidate.base_url}: vllm (stated)" in log, log
    assert "detected" not in log


@pytest.mark.parametrize(
    ("args", "warning"),
    [
        (["--shadow-ratio", "0.5"], "--shadow-ratio does nothing without --shadow or --baseline"),
        (["--shadow-kind", "vllm"], "--shadow-kind does nothing without --shadow"),
        (["--policy", "POLICY", "--shadow", "http://127.0.0.1:9"], "--shadow does nothing with"),
    ],
)
async def test_flags_that_do_nothing_are_warned_about(sims, tmp_path, args, warning):
    primary = await sims()
    path = tmp_path / "policy.yaml"
    path.write_text(f"version: 1\nbackends:\n  p: {{url: '{primary.base_url}', kind: sim}}\n"
                    "primary: p\n")  # fmt: skip
    args = [str(path) if a == "POLICY" else a for a in args]
    async with serve(["--primary", primary.base_url, *args]) as gw:
        log = gw.stderr()
    assert warning in log, log


def test_a_busy_port_is_one_line_and_status_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = specshadow("serve", "--port", str(port), "--primary", "http://127.0.0.1:9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"specshadow serve: cannot listen on 127.0.0.1:{port}: the port is already in use "
        "(another gateway, or another server?)"
    ]


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["--port", "70000"], {}, "specshadow serve: --port: must be 0–65535, got 70000"),
        ([], {"SPECSHADOW_SHADOW_RATIO": "2"},
         "specshadow serve: SPECSHADOW_SHADOW_RATIO: must be between 0 and 1, got 2.0"),
        (["--primary", "http://primary.invalid:8000"], {},
         "specshadow serve: --primary http://primary.invalid:8000: cannot resolve host "
         "'primary.invalid'"),
        (["--policy", "POLICY"], {},
         "specshadow serve: backend cand: api_key_env names SPECSHADOW_TEST_UNSET_KEY, which is "
         "not set"),
        (["--policy", "MISSING"], {}, "specshadow serve: --policy: cannot read "),
        (["--host", "192.0.2.1"], {},  # TEST-NET-1: never an address of this machine
         "specshadow serve: cannot listen on 192.0.2.1:"),
    ],
)  # fmt: skip
def test_a_start_that_cannot_work_is_one_line_and_status_2(tmp_path, args, env, line):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nbackends:\n"
        "  cand: {url: 'http://127.0.0.1:9', kind: vllm, api_key_env: SPECSHADOW_TEST_UNSET_KEY}\n"
        "default: {ratio: 1, legs: [{backend: cand, role: candidate}]}\n"
    )
    args = [
        str(path) if a == "POLICY" else str(tmp_path / "no.yaml") if a == "MISSING" else a
        for a in args
    ]
    if "--primary" not in args:
        args += ["--primary", "http://127.0.0.1:9"]
    environ = {k: v for k, v in os.environ.items() if k != "SPECSHADOW_TEST_UNSET_KEY"}
    out = subprocess.run(
        [sys.executable, "-m", "specshadow", "serve", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **env},
    )
    assert out.returncode == 2, out.stderr
    problems = out.stderr.strip().splitlines()
    assert len(problems) == 1 and problems[0].startswith(line), out.stderr


def test_argparse_errors_keep_argparse_status_and_message():
    out = specshadow("serve", "--port", "abc")
    assert out.returncode == 2
    assert "argument --port: invalid int value: 'abc'" in out.stderr
    assert "Traceback" not in out.stderr
    out = specshadow("serve", "--shadow-kind", "tgi")
    assert out.returncode == 2 and "invalid choice: 'tgi'" in out.stderr


def test_version_prints_the_installed_version():
    out = specshadow("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"specshadow {importlib.metadata.version('specshadow')}"


def _subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out.append(((*path, name), child))
                out += _subcommands(child, (*path, name))
    return out


def test_every_subcommand_has_a_description_and_shows_its_defaults():
    commands = _subcommands(build_parser())
    names = {c[0][0] for c in commands}
    assert {"serve", "report", "records", "rollout", "simulate", "loadgen", "policy"} <= names
    for path, parser in commands:
        assert parser.description, f"specshadow {' '.join(path)} has no description"
        assert parser.formatter_class is HelpFormatter, path
        text = parser.format_help()
        for action in parser._actions:
            default = action.default
            if (
                not action.option_strings
                or default in (None, False, argparse.SUPPRESS)
                or (isinstance(default, list) and not default)
            ):
                continue
            # argparse wraps on spaces and hyphens: compare without whitespace.
            flat, shown = "".join(text.split()), "".join(f"default: {default}".split())
            assert "default" in (action.help or "").lower() or shown in flat, (
                f"specshadow {' '.join(path)} {action.option_strings[0]}: default {default!r} "
                "not in --help"
            )


def test_store_is_described_the_same_way_everywhere_it_is_read():
    commands = dict(_subcommands(build_parser()))
    helps = {
        path: next(a.help for a in parser._actions if "--store" in a.option_strings)
        for path, parser in commands.items()
        if any("--store" in a.option_strings for a in parser._actions)
    }
    assert {("serve",), ("records",), ("report",), ("counterfactual",)} <= set(helps)
    prefix = "a record store: a SQLite path, clickhouse://host:port/db"
    for path in helps:
        assert str(helps[path]).startswith(prefix), (path, helps[path])
    assert helps[("records",)] == helps[("report",)] == helps[("counterfactual",)]


def test_report_takes_last_like_records():
    parser = build_parser()
    args = parser.parse_args(["report", "--store", "x.sqlite", "--last", "15m", "--out", "o"])
    assert args.last == 900.0
    from records.cli import window_since

    assert window_since(args, now_ns=10**12) == 10**12 - 900 * 10**9
    out = specshadow("report", "--store", "x", "--since", "2024-01-01", "--last", "1h",
                     "--out", "o")  # fmt: skip
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
