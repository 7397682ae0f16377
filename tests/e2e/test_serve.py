"""`specshadow serve` as a real subprocess (uvloop): startup, SIGHUP reload, fail-fast, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import aiohttp
import openai
import pytest

from core.procs import free_port
from tests.reliability.helpers import spawn_gateway

pytestmark = pytest.mark.e2e


async def admin_policy(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/admin/policy") as resp:
        assert resp.status == 200
        return await resp.json()


async def wait_until(
    fetch: Callable[[], object], predicate: Callable[[dict], bool], timeout_s: float = 10.0
) -> dict:
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    while time.monotonic() < deadline:
        last = await fetch()  # type: ignore[misc]
        if predicate(last):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met; last: {last}")


def policy(primary: str, candidate: str, ratio: float) -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        f"default:\n  ratio: {ratio}\n  legs: [{{backend: cand, role: candidate}}]\n"
    )


async def test_serve_relays_for_the_openai_sdk_and_exits_cleanly_on_sigterm(sims):
    sim = await sims()
    async with spawn_gateway(["--primary", sim.base_url]) as gp:
        url, proc = gp.url, gp.proc
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        assert text == "".join(next(iter(sim.state.requests.values())).tokens)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


async def test_sighup_reloads_the_policy_file(sims, tmp_path):
    primary, candidate = await sims(), await sims(mode="speculative")
    path = tmp_path / "policy.yaml"
    path.write_text(policy(primary.base_url, candidate.base_url, 0.0))
    # Poll rarely, so only the signal can explain a prompt reload.
    async with spawn_gateway(["--policy", str(path)], {"SPECSHADOW_POLICY_POLL_S": "3600"}) as gp:
        url, proc = gp.url, gp.proc
        assert (await admin_policy(url))["generation"] == 1
        path.write_text(policy(primary.base_url, candidate.base_url, 1.0))
        proc.send_signal(signal.SIGHUP)
        status = await wait_until(lambda: admin_policy(url), lambda s: s["generation"] == 2)
        assert status["last_reload"]["ok"] is True
        path.write_text("version: 1\nrules:\n  - {name: r, ratio: 2}\n")
        proc.send_signal(signal.SIGHUP)
        status = await wait_until(
            lambda: admin_policy(url), lambda s: s["last_reload"]["ok"] is False
        )
        assert status["generation"] == 2
        assert "rules[0]" in status["last_reload"]["error"]


async def test_kubernetes_configmap_symlink_swap_is_picked_up(sims, tmp_path):
    primary, candidate = await sims(), await sims(mode="speculative")
    mount = tmp_path / "mount"
    mount.mkdir()
    first = mount / "..2026_11_30_a"
    first.mkdir()
    (first / "policy.yaml").write_text(policy(primary.base_url, candidate.base_url, 0.0))
    os.symlink(first.name, mount / "..data")
    os.symlink("..data/policy.yaml", mount / "policy.yaml")
    async with spawn_gateway(
        ["--policy", str(mount / "policy.yaml")], {"SPECSHADOW_POLICY_POLL_S": "0.1"}
    ) as gp:
        url = gp.url
        assert (await admin_policy(url))["generation"] == 1
        second = mount / "..2026_11_30_b"
        second.mkdir()
        (second / "policy.yaml").write_text(policy(primary.base_url, candidate.base_url, 0.5))
        os.symlink(second.name, mount / "..data_tmp")
        os.replace(mount / "..data_tmp", mount / "..data")  # the atomic swap kubelet does
        await wait_until(lambda: admin_policy(url), lambda s: s["generation"] == 2)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("version: 1\ndefault: {ratio: 1.5}\n", "default.ratio"),
        ("version: 1\nbogus: 1\n", "bogus"),
        ("version: 1\ndefault: {ratio: [\n", "line"),
    ],
)
def test_an_invalid_policy_fails_startup_with_the_field_path(tmp_path, text, fragment):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specshadow",
            "serve",
            "--port",
            str(free_port()),
            "--primary",
            "http://127.0.0.1:9",
            "--policy",
            str(path),
        ],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr.decode()


def test_serve_without_a_primary_fails_fast():
    proc = subprocess.run(
        [sys.executable, "-m", "specshadow", "serve", "--port", str(free_port())],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "primary" in proc.stderr.decode()


async def test_quick_flags_mirror_to_a_candidate_and_a_baseline_without_a_policy_file(sims):
    primary, candidate, baseline = await sims(), await sims(mode="speculative"), await sims()
    args = [
        "--primary",
        primary.base_url,
        "--shadow",
        candidate.base_url,
        "--baseline",
        baseline.base_url,
        "--shadow-ratio",
        "1.0",
    ]
    async with spawn_gateway(args) as gp:
        client = openai.AsyncOpenAI(base_url=f"{gp.url}/v1", api_key="x", max_retries=0)
        for i in range(3):
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
            )
        await client.close()
        status = await wait_until(
            lambda: gp.shadow_status(),
            lambda s: sum(c["count"] for c in s["counts"] if c["event"] == "completed") == 6,
        )
        policy_status = await admin_policy(gp.url)
    assert policy_status["source"] == "flags"
    assert sorted(policy_status["backends"]) == ["baseline", "primary", "shadow-1"]
    roles = {c["role"] for c in status["counts"] if c["event"] == "completed"}
    assert roles == {"candidate", "baseline"}

    # The backends are detected as simulators, so the baseline also scores sampled candidate
    # outputs (POST /v1/completions, docs/quality.md): count the mirrored chat requests.
    def chats(sim) -> int:  # type: ignore[no-untyped-def]
        return sum(r.route == "chat" for r in sim.state.requests.values())

    assert chats(candidate) == chats(baseline) == 3


async def test_serve_writes_records_into_a_chdb_store_and_flushes_them_on_sigterm(sims, tmp_path):
    """``--store chdb:///dir`` as an SRE types it: the records of every exchange are in the
    embedded column store once the process has exited."""
    primary, candidate = await sims(), await sims(mode="speculative")
    store = f"chdb://{tmp_path}/records"
    args = ["--primary", primary.base_url, "--shadow", candidate.base_url, "--shadow-ratio", "1"]
    async with spawn_gateway([*args, "--store", store]) as gp:
        client = openai.AsyncOpenAI(base_url=f"{gp.url}/v1", api_key="x", max_retries=0)
        for i in range(5):
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
            )
        await client.close()
        await wait_until(
            lambda: gp.shadow_status(),
            lambda s: sum(c["count"] for c in s["counts"] if c["event"] == "completed") == 5,
        )
        gp.proc.send_signal(signal.SIGTERM)
        assert gp.proc.wait(timeout=30) == 0
    from records.readback import read_records

    records = read_records([store])
    assert len(records) == 5
    assert all([leg["role"] for leg in r["legs"]] == ["primary", "candidate"] for r in records)
