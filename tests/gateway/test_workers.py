"""``specshadow serve --workers 2`` as real processes on loopback, the official openai SDK as the
client, simulators as the primary and the shadow.

Ground truth is counted independently of the gateway: the requests the test sent, the shadow
simulator's own count of what reached it, and the pids the kernel shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from core.procs import free_port
from gateway.workers import WORKER_HEADER, Supervisor
from tests.receivers.otlp import OtlpHttpReceiver
from tests.reliability.helpers import wait_healthy

pytestmark = pytest.mark.e2e

SAMPLED = 'specshadow_outcome="sampled"'
TOKEN = "workers-admin-token"


def flags(primary: str, shadow: str) -> list[str]:
    return [
        "--primary",
        primary,
        "--primary-kind",
        "sim",
        "--shadow",
        shadow,
        "--shadow-kind",
        "sim",
    ]


@asynccontextmanager
async def workers_gateway(
    args: list[str], tmp: Path, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes], Callable[[], str]]]:
    port = free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 — closed in finally
    state = f"sqlite://{tmp / 'state.sqlite'}"
    proc = subprocess.Popen(  # noqa: ASYNC220 — started once; the loop is idle meanwhile
        [
            sys.executable,
            "-m",
            "specshadow",
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--state",
            state,
            *args,
        ],
        env={**os.environ, "XDG_STATE_HOME": str(tmp), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )

    def stderr() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, proc, stderr)
        await wait_for(lambda: ready_workers(url), lambda n: n == 2)
        yield url, proc, stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


async def wait_for(
    fetch: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], timeout_s: float = 20.0
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await fetch()
        if ok(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not met; last: {last}")


async def get(url: str, path: str) -> tuple[str, Any]:
    """One GET on a fresh connection (so the kernel may pick either worker): (worker, body)."""
    async with aiohttp.ClientSession() as session, session.get(url + path) as resp:
        assert resp.status == 200, resp.status
        body = await resp.json() if "json" in resp.content_type else await resp.text()
        return resp.headers[WORKER_HEADER], body


async def ready_workers(url: str) -> int:
    try:
        _, doc = await get(url, "/admin/workers")
    except aiohttp.ClientError:
        return 0
    return sum(1 for w in doc["workers"] if w["ready"])


def sampled(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specshadow_shadow_requests_total{") and SAMPLED in line)  # fmt: skip


def pid_of(worker_header: str) -> int:
    return int(worker_header.split("pid=")[1])


async def send(url: str, n: int) -> set[int]:
    """``n`` chat requests through the SDK, each on its own connection; the pids that answered."""
    pids: set[int] = set()

    async def one(i: int) -> None:
        # A client of its own: its own connection, so the kernel spreads the requests.
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="sim-model", messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=4,
            )  # fmt: skip
        assert raw.parse().choices[0].message.content
        pids.add(pid_of(raw.headers[WORKER_HEADER]))

    for start in range(0, n, 8):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8))))
    return pids


def policy(primary: str, candidate: str, ratio: float, rollout: str = "") -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        f"default:\n  ratio: {ratio}\n  legs: [{{backend: cand, role: candidate}}]\n"
        + (f"  rollout: {rollout}\n" if rollout else "")
    )


def record_rows(store: Path) -> tuple[int, int]:
    """(records, distinct exchanges) in a SQLite record store."""
    with contextlib.closing(sqlite3.connect(store, timeout=30)) as db:
        n, distinct = db.execute(
            "SELECT count(*), count(DISTINCT exchange_id) FROM records"
        ).fetchone()
    return int(n), int(distinct)


def otlp_sampled(receiver: OtlpHttpReceiver) -> dict[str, float]:
    """Per worker instance: its newest cumulative OTLP count of sampled shadow legs."""
    out: dict[str, float] = {}
    for m in list(receiver.collected.metrics):
        if m.name != "specshadow.shadow.requests":
            continue
        for p in m.points:
            if p.attributes.get("specshadow.outcome") == "sampled":
                out[m.resource["service.instance.id"]] = p.value or 0.0
    return out


async def test_two_workers_one_port_one_metrics_own_otlp_restarted_and_stopped_together(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path, otlp_http_receiver: OtlpHttpReceiver
) -> None:
    """One gateway, every property of the worker set in turn (one start keeps CI short)."""
    primary, shadow = await sims(), await sims(mode="speculative")
    n = 40
    env = otlp_http_receiver.env(OTEL_METRIC_EXPORT_INTERVAL="300")
    store = tmp_path / "records.sqlite"  # one SQLite record store, written by both workers
    args = [*flags(primary.base_url, shadow.base_url), "--store", str(store)]
    async with workers_gateway(args, tmp_path, env) as (
        url, proc, err,
    ):  # fmt: skip
        _, status = await get(url, "/admin/workers")
        worker_pids = {w["pid"] for w in status["workers"]}
        assert len(worker_pids) == 2 and proc.pid not in worker_pids

        # One port, both workers serving the SDK's requests.
        answered = await send(url, n)
        assert answered == worker_pids

        # Every mirrored request reached the shadow (its own count), and a scrape through the
        # shared port counts them all, whichever worker answers it.
        await wait_for(lambda: asyncio.sleep(0, len(shadow.state.requests)), lambda c: c == n)
        scraped_by: set[str] = set()
        for _ in range(12):
            worker, text = await get(url, "/metrics")
            scraped_by.add(worker.split(";")[0])
            assert sampled(text) == n, text
        assert scraped_by == {"0", "1"}

        # OTLP: each worker exports its own counts under its own instance id; together they
        # are what was sent.
        await wait_for(
            lambda: asyncio.sleep(0, otlp_sampled(otlp_http_receiver)),
            lambda c: sum(c.values()) == n,
        )
        resources = {
            (m.resource["specshadow.worker.index"],
             (m.resource["service.instance.id"], m.resource["process.pid"]))
            for m in list(otlp_http_receiver.collected.metrics)
        }  # fmt: skip
        by_index = dict(resources)
        assert len(resources) == 2 and set(by_index) == {0, 1}
        gateway_id = status["gateway_id"]
        assert {by_index[0][0], by_index[1][0]} == {f"{gateway_id}-0", f"{gateway_id}-1"}
        assert {by_index[0][1], by_index[1][1]} == worker_pids

        # Both workers write the one record store (WAL; each waits its turn).
        await wait_for(lambda: asyncio.to_thread(record_rows, store), lambda r: r == (n, n))

        # A killed worker is restarted; what a scrape showed is never taken back (the dead
        # worker's last snapshot is folded into the totals).
        victim = status["workers"][1]["pid"]
        survivor = status["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def restarted(doc: Any) -> bool:
            w = doc["workers"][1]
            return bool(w["ready"] and w["pid"] not in (None, victim))

        status = await wait_for(lambda: get_body(url, "/admin/workers"), restarted)
        slot = status["workers"][1]
        # One restart, of the killed worker: a fresh worker that died too would show here (seen
        # once in a clean CI run, not reproduced in 40 runs on a loaded machine; the log says why).
        assert (slot["restarts"], slot["last_exit"].get("signal")) == (1, "SIGKILL"), (
            status,
            err(),
        )
        assert status["workers"][0]["pid"] == survivor
        assert f"worker 1 (pid {victim}) killed by SIGKILL" in err()
        assert "threads running in the parent" not in err()  # every fork from one thread
        for _ in range(6):
            _, text = await get(url, "/metrics")
            assert sampled(text) == n
            # The set itself: the supervisor's restarts per slot, the workers serving.
            workers_lines = [line for line in text.splitlines() if "workers_" in line]
            assert {
                'specshadow_workers_restarts_total{specshadow_worker="0"} 0',
                'specshadow_workers_restarts_total{specshadow_worker="1"} 1',
                "specshadow_workers_ready 2",
            } <= set(workers_lines), (workers_lines, status, err())
        await send(url, 8)
        await wait_for(lambda: get_body(url, "/metrics"), lambda t: sampled(t) == n + 8)

        # SIGTERM to the parent: every worker drains and exits, the parent exits 0.
        pids = [w["pid"] for w in status["workers"]]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0, err()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists(), pid  # noqa: ASYNC240 — one stat
    # Every mirrored exchange has exactly one record, whichever worker wrote it.
    assert record_rows(store) == (n + 8, n + 8)


async def get_body(url: str, path: str) -> Any:
    return (await get(url, path))[1]


async def test_sighup_and_an_operator_rollback_reach_every_worker_and_sigterm_drains(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    primary, shadow = await sims(step_s=0.02), await sims(mode="speculative")
    path = tmp_path / "policy.yaml"
    canary = "{stage: canary, serve_ratio: 0.3}"
    path.write_text(policy(primary.base_url, shadow.base_url, 1.0, canary))
    # Poll rarely, so only the forwarded signal can explain a prompt reload.
    env = {"SPECSHADOW_POLICY_POLL_S": "3600", "SPECSHADOW_ADMIN_TOKEN": TOKEN}
    async with workers_gateway(["--policy", str(path)], tmp_path, env) as (url, proc, err):
        # SIGHUP to the parent: every worker reloads the file.
        path.write_text(policy(primary.base_url, shadow.base_url, 1.0, canary) + "# edited\n")
        proc.send_signal(signal.SIGHUP)
        reloaded: set[str] = set()

        async def generation() -> int:
            worker, doc = await get(url, "/admin/policy")
            if doc["generation"] == 2:
                reloaded.add(worker.split(";")[0])
            return len(reloaded)

        await wait_for(generation, lambda n: n == 2)  # both workers answered with generation 2

        # An operator's rollback through the port, answered by one worker, is what every
        # worker's /admin/rollout comes to say (how soon is the fleet's sync step, proven under a
        # fake clock in tests/rollout; here only that the real processes get there).
        stages = {(await get(url, "/admin/rollout"))[1]["rules"]["default"]["stage"]}
        assert stages == {"canary"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{url}/admin/rollout/default/rollback",
                json={"reason": "operator"},
                headers={"authorization": f"Bearer {TOKEN}"},
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
        t0 = time.monotonic()
        shadow_seen: set[str] = set()

        async def rolled_back() -> int:
            worker, doc = await get(url, "/admin/rollout")
            rule = doc["rules"]["default"]
            if rule["stage"] == "shadow" and rule["rolled_back"]:
                shadow_seen.add(worker.split(";")[0])
            else:
                shadow_seen.discard(worker.split(";")[0])
            return len(shadow_seen)

        await wait_for(rolled_back, lambda n: n == 2, timeout_s=30.0)
        took = time.monotonic() - t0
        print(f"an operator's rollback through one worker: both workers say shadow in {took:.2f} s")

        # SIGTERM mid-stream: the stream in flight finishes whole, then every worker exits.
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "a long answer"}],
            max_tokens=60, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = 0
        usage = None
        async for chunk in stream:
            chunks += 1
            if chunks == 2:
                proc.send_signal(signal.SIGTERM)  # mid-stream
            usage = chunk.usage or usage
        await client.close()
        assert usage is not None and usage.completion_tokens == 60
        assert await asyncio.to_thread(proc.wait, 30) == 0, err()


async def test_an_unusable_store_stops_the_gateway_with_status_2_before_any_worker_starts(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    primary = await sims()
    port = free_port()
    (tmp_path / "a-file").write_text("not a folder")
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "specshadow",
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--primary",
            primary.base_url,
            "--primary-kind",
            "sim",
            "--store",
            str(tmp_path / "a-file" / "records.db"),
            "--state",
            f"sqlite://{tmp_path / 'state.sqlite'}",
        ],
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr.decode()
    # Opened once, in the parent, before the fork: one line naming it, not one per worker.
    err = result.stderr.decode()
    assert err.count("cannot make its folder") == 1 and "a-file" in err, err
    assert "Traceback" not in err and "could not start" not in err, err


def test_a_worker_that_keeps_crashing_before_it_is_ready_stops_the_supervisor(
    tmp_path: Path,
) -> None:
    attempts = tmp_path / "attempts"

    def crash(identity: Any, _socks: Any, _ready: Callable[[], None]) -> int:
        with open(attempts, "a") as f:
            f.write(f"{identity.index}\n")
        return 1

    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    supervisor = Supervisor([[], []], crash, run_dir=run_dir, shutdown_timeout_s=1.0)
    assert supervisor.run() == 1
    counts = attempts.read_text().split()
    # Worker slots are retried with a back-off until one has failed three times in a row.
    assert max(counts.count("0"), counts.count("1")) == 3


def test_a_configuration_error_in_one_worker_stops_the_healthy_one_without_a_restart(
    tmp_path: Path,
) -> None:
    starts = tmp_path / "starts"

    def main(identity: Any, _socks: Any, ready: Callable[[], None]) -> int:
        with open(starts, "a") as f:
            f.write(f"{identity.index}\n")
        if identity.index == 1:
            time.sleep(0.3)
            return 2  # what a worker returns when its application cannot be built
        ready()
        time.sleep(3600)  # until the parent's SIGTERM (default action: the worker ends)
        return 0

    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    supervisor = Supervisor([[], []], main, run_dir=run_dir, shutdown_timeout_s=5.0)
    # run() returns at all: the healthy worker sleeps for an hour, far past the test's timeout,
    # unless the supervisor stops it.
    assert supervisor.run() == 2
    assert sorted(starts.read_text().split()) == ["0", "1"]  # and neither was started again
    assert not run_dir.exists()
