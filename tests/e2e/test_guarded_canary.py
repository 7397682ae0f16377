"""Guarded after the decision, end to end: real sockets, the official openai SDK at its defaults
(no ``temperature``: every request is sampled), simulators whose truth is known, no baseline leg.

- A canary with ``steps: [0.2, 1.0]``: the quality guard's reference is the primary's own answer
  mirrored behind each canary answer. An honest (lossless) candidate reaches ``live`` with no
  rollback, and ``sampled_divergence`` is never ``unavailable`` after warm-up; a candidate whose
  sampled outputs come from another distribution (it commits the argmax whatever the
  temperature) never reaches ``live``.
- A ``live`` candidate whose acceptance falls from 2.5 to 1.3 tokens per pass mid-run (a switch
  between two simulators, both reporting their per-request counts in every body as llama.cpp
  does): hundreds of steady requests show no breach, then ``acceptance_drop`` breaches and the
  rule leaves ``live`` (``on_drift: canary``) within a few hundred requests; the breach is
  counted in ``specshadow_rollout_drift_breaches_total``.

The guards run on the evidence worker, never on the request path: every guard update of both
tests is recorded with its thread, and none ran on the event loop's (the gateway's) thread.

No client sees an error in either. The waits poll the gateway's own state (its exchanges, its
``/admin/rollout``) with a deadline; no assertion is on a duration.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from core.sinks import MemorySink
from gateway.settings import Settings
from rollout.guards import GuardBank
from simulator.switch import Switch
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

TOKEN = "guarded-canary-token"
SAMPLED: dict[str, Any] = {
    "model": "sim-model",
    "sampling": True,
    "min_output_tokens": 16,
    "max_output_tokens": 48,
    "prefill_base_s": 0.001,
    "step_s": 0.001,
}
WARM_UP = 30  # exchanges before sampled_divergence must have a reference


def policy(primary: str, candidate: str, rollout: dict[str, Any]) -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n"
        f"  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        "default:\n  ratio: 1.0\n"
        "  legs: [{backend: cand, role: candidate}]\n"
        f"  rollout: {json.dumps(rollout)}\n"
    )


class Run:
    """One gateway in process, driven by the SDK; its exchanges and its rollout status."""

    def __init__(self, url: str, sink: MemorySink, client: openai.AsyncOpenAI) -> None:
        self.url, self.sink, self.client = url, sink, client
        self.sent = 0
        self.served: list[str] = []

    async def one(self, i: int) -> None:
        raw = await self.client.chat.completions.with_raw_response.create(
            model="sim-model",  # no temperature: the API's default — sampled
            messages=[{"role": "user", "content": f"Tell me about topic number {i}."}],
            max_tokens=48,
            extra_headers={"x-request-id": f"g-{i}"},
        )
        answer = raw.parse()  # an SDK error would raise: a client error fails the test
        assert answer.choices[0].message.content
        self.served.append(raw.headers.get("x-specshadow-served-by", ""))

    async def send(self, n: int) -> None:
        first = self.sent
        for start in range(first, first + n, 6):
            await asyncio.gather(*(self.one(i) for i in range(start, min(start + 6, first + n))))
        self.sent += n
        for _ in range(800):  # the evidence worker has judged every exchange sent
            if len(self.sink.exchanges) >= self.sent:
                break
            await asyncio.sleep(0.025)
        else:
            raise AssertionError(f"{len(self.sink.exchanges)} of {self.sent} exchanges")
        await self.rule()  # the guards ran on the evidence worker before the sink saw the last

    async def rule(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/admin/rollout") as r:
            data: dict[str, Any] = (await r.json())["rules"]["default"]
            return data


async def start(
    sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any, candidate: str,
    primary: str, rollout: dict[str, Any],
) -> tuple[str, MemorySink]:  # fmt: skip
    settings = Settings(
        policy_path=write_policy(policy(primary, candidate, rollout)),
        state_path=str(tmp_path / "rollout.json"),
        admin_token=TOKEN,
        shutdown_timeout_s=2.0,
        policy_poll_s=0.05,
        upstream=FAST_UPSTREAM,
    )
    sink = MemorySink()
    gateway = await start_server(build_app(settings, sinks=[sink]))
    servers.append(gateway)
    return str(gateway.make_url("")).rstrip("/"), sink


@pytest.fixture(autouse=True)
def guard_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The thread of every guard update; after the test, none is the event loop's: the guards
    ran on the evidence worker, off the request path."""
    threads: list[int] = []
    update = GuardBank.update

    def recorded(self: GuardBank, o: Any) -> None:
        threads.append(threading.get_ident())
        update(self, o)

    monkeypatch.setattr(GuardBank, "update", recorded)
    loop_thread = threading.get_ident()  # the test's loop is the in-process gateway's
    yield threads
    assert threads, "no guard ever ran"
    assert loop_thread not in threads, "a guard ran on the event loop (the request path)"


def guard(rule: dict[str, Any], name: str) -> dict[str, Any]:
    (g,) = [g for g in rule["guards"] if g["guard"] == name]
    return g


@pytest.mark.parametrize("candidate", ["honest", "argmax_whatever_the_temperature"])
async def test_an_sdk_default_canary_without_a_baseline_is_judged_against_the_primary(
    candidate: str, sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any
) -> None:
    primary = await sims(**SAMPLED)
    defect = {"sampling_defect": "greedy_collapse"} if candidate != "honest" else {}
    cand = await sims(**SAMPLED, mode="speculative", num_speculative_tokens=4, **defect)
    rollout = {
        "stage": "canary",
        "steps": [0.2, 1.0],
        "hold": {"min_requests": 30, "min_s": 0.01},
        # The latency guards read the wall clock: off, so the outcome is the quality guard's.
        "guards": {"min_samples": 10, "kv_usage_max": None, "e2e_p99_ratio_max": None,
                   "tpot_p99_ratio_max": None},
    }  # fmt: skip
    url, sink = await start(sims, servers, tmp_path, write_policy, cand.base_url,
                            primary.base_url, rollout)  # fmt: skip
    stages: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
        run = Run(url, sink, client)
        while run.sent < 420:
            await run.send(12)
            rule = await run.rule()
            stages.append(rule["stage"])
            if run.sent >= WARM_UP:
                sd = guard(rule, "sampled_divergence")
                assert sd["status"] != "unavailable", sd
            if rule["stage"] == "live" or (candidate != "honest" and rule["stage"] == "shadow"):
                break
        await run.send(12)  # after the decision: still no client error
    rule = await run.rule()
    last = rule["last_transition"]
    if candidate == "honest":
        assert rule["stage"] == "live", (rule["waiting"], rule["guards"])
        assert not rule["rolled_back"] and last["by"] == "schedule", last
        sd = guard(rule, "sampled_divergence")
        assert sd["samples"] > 0 and "the primary's own answer" in sd["detail"], sd
    else:
        assert "live" not in stages, stages
        assert rule["stage"] == "shadow" and rule["rolled_back"], rule
        assert last["by"] == "guard" and last["guard"] == "sampled_divergence", last
        assert run.served[-12:] == ["primary"] * 12


async def test_a_live_candidate_whose_acceptance_decays_leaves_live(
    sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any
) -> None:
    common: dict[str, Any] = {
        "model": "sim-model",
        "min_output_tokens": 40,
        "max_output_tokens": 48,
        "prefill_base_s": 0.001,
        "step_s": 0.001,
    }
    primary = await sims(**common)
    # per-position acceptance p with k = 4: 1 + p + p² + p³ + p⁴ tokens per pass
    spec = {"mode": "speculative", "num_speculative_tokens": 4, "always_metrics": True}
    steady = await sims(**common, **spec, acceptance=0.655)  # 2.5 tokens per pass
    decayed = await sims(**common, **spec, acceptance=0.235)  # 1.3
    switch = Switch({"steady": steady.base_url, "decayed": decayed.base_url}, "steady")
    switch_server = await start_server(switch.app())
    servers.append(switch_server)
    rollout = {
        "stage": "live",
        "guards": {
            "min_samples": 10,
            "e2e_p99_ratio_max": None,  # a decayed candidate is slower: the point is the
            "tpot_p99_ratio_max": None,  # guard that reads its acceptance
            "tokens_per_event_min": None,
            "kv_usage_max": None,
        },
    }
    candidate = str(switch_server.make_url("")).rstrip("/")
    url, sink = await start(sims, servers, tmp_path, write_policy, candidate,
                            primary.base_url, rollout)  # fmt: skip
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
        run = Run(url, sink, client)
        await run.send(300)
        before = await run.rule()
        assert before["stage"] == "live", before["last_transition"]
        drop = guard(before, "acceptance_drop")
        assert drop["status"] == "ok", drop
        level = before["acceptance_reference"][""]
        assert 2.3 < level < 2.7, before["acceptance_reference"]
        assert guard(before, "speculation_off")["status"] == "ok"

        switch.current = "decayed"
        changed_at = run.sent
        while run.sent < changed_at + 400 and (await run.rule())["stage"] == "live":
            await run.send(12)
        await run.send(12)  # after the breach: still no client error
    after = await run.rule()
    last = after["last_transition"]
    assert last["by"] == "guard" and last["guard"] == "acceptance_drop", last
    assert last["from_stage"] == "live" and last["to_stage"] == "canary", last
    tripped = [e.exchange_id for e in sink.exchanges].index(last["exchange_id"])
    assert changed_at <= tripped < changed_at + 400, (changed_at, tripped)
    status = await fetch_status(url)
    (breach,) = [b for b in status["drift_breaches"] if b["guard"] == "acceptance_drop"]
    assert breach["action"] == "canary" and "against reference" in breach["detail"], breach
    assert len(run.served) == run.sent
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        metrics = await r.text()
    counted = [
        line for line in metrics.splitlines()
        if line.startswith("specshadow_rollout_drift_breaches_total{")
        and 'guard="acceptance_drop"' in line
    ]  # fmt: skip
    assert len(counted) == 1 and float(counted[0].rsplit(" ", 1)[1]) == 1, counted


async def fetch_status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/admin/rollout") as r:
        data: dict[str, Any] = await r.json()
        return data
