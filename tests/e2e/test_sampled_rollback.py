"""A canary on sampled traffic, end to end: real sockets, the official openai SDK as the client,
simulators whose token distributions are known (``SimConfig.sampling``).

The rule mirrors every request to a baseline leg (a plain copy of production). Its candidate — a
lossless speculative sampler at first, whose outputs are exact draws from the target model — is
switched mid-canary to a lossy mode on default-temperature requests: one that commits the argmax
whatever the temperature (greedy collapse), or one that samples from a different model. Greedy
divergence says nothing here (no request is greedy) and the latency and acceptance guards are off
(a collapsed candidate answers at another length: the point is the guard that reads the
outputs). ``sampled_divergence`` must roll the canary back, and no client may see an error —
before, during or after.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from core.sinks import MemorySink
from gateway.settings import Settings
from simulator.switch import Switch
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

TOKEN = "sampled-rollback-token"
COMMON: dict[str, Any] = {
    "model": "sim-model",
    "sampling": True,
    "min_output_tokens": 16,
    "max_output_tokens": 48,
    "prefill_base_s": 0.001,
    "step_s": 0.001,
}
WARM_UP = 60  # exchanges of the lossless candidate before the switch
# Exchanges after the switch within which the rollback must come. Measured: a collapsed sampler
# is rolled back after 33–41 exchanges, another model after 180–400 (its answers differ only
# request by request — its word statistics across requests are the target's — and only the
# similarity to production's answer sees that).
LIMIT = {"greedy_collapse": 200, "different_model": 1000}


def policy(primary: str, baseline: str, candidate: str) -> str:
    guards = {
        "min_samples": 10,
        "e2e_p99_ratio_max": None,
        "tpot_p99_ratio_max": None,
        "tokens_per_event_min": None,
        "kv_usage_max": None,
    }
    rollout = json.dumps({"stage": "canary", "serve_ratio": 0.3, "guards": guards})
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n"
        f"  base: {{url: '{baseline}', kind: sim}}\n"
        f"  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        "default:\n  ratio: 1.0\n"
        "  legs: [{backend: cand, role: candidate}, {backend: base, role: baseline}]\n"
        f"  rollout: {rollout}\n"
    )


@pytest.mark.parametrize("defect", ["greedy_collapse", "different_model"])
async def test_a_lossy_sampler_is_rolled_back_by_the_sampled_guard_without_a_client_error(
    defect: str, sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any
) -> None:
    primary = await sims(**COMMON)
    baseline = await sims(**COMMON)
    speculative = {"mode": "speculative", "num_speculative_tokens": 4}
    lossless = await sims(**COMMON, **speculative)
    lossy = await sims(**COMMON, **speculative, sampling_defect=defect)
    switch = Switch({"lossless": lossless.base_url, "lossy": lossy.base_url}, "lossless")
    switch_server = await start_server(switch.app())
    servers.append(switch_server)
    candidate_url = str(switch_server.make_url("")).rstrip("/")
    settings = Settings(
        policy_path=write_policy(policy(primary.base_url, baseline.base_url, candidate_url)),
        state_path=str(tmp_path / "rollout.json"),
        admin_token=TOKEN,
        shutdown_timeout_s=2.0,
        policy_poll_s=0.05,
        upstream=FAST_UPSTREAM,
    )
    sink = MemorySink()
    gateway = await start_server(build_app(settings, sinks=[sink]))
    servers.append(gateway)
    url = str(gateway.make_url("")).rstrip("/")
    served: list[str] = []

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:

        async def one(i: int) -> None:
            raw = await client.chat.completions.with_raw_response.create(
                model="sim-model",  # no temperature: the API's default, 1 — sampled
                messages=[{"role": "user", "content": f"Tell me about topic number {i}."}],
                max_tokens=48,
                extra_headers={"x-request-id": f"s-{i}"},
            )
            answer = raw.parse()  # an SDK error would raise: a client error fails the test
            assert answer.choices[0].message.content
            served.append(raw.headers.get("x-specshadow-served-by", ""))

        async def send(first: int, n: int) -> None:
            for start in range(first, first + n, 6):
                await asyncio.gather(*(one(i) for i in range(start, min(start + 6, first + n))))

        async def rule() -> dict[str, Any]:
            async with aiohttp.ClientSession() as s, s.get(f"{url}/admin/rollout") as r:
                data: dict[str, Any] = (await r.json())["rules"]["default"]
                return data

        async def settle(n: int) -> None:
            for _ in range(400):
                if len(sink.exchanges) >= n:
                    await asyncio.sleep(0.1)  # the evidence worker wakes every 50 ms
                    return
                await asyncio.sleep(0.025)
            raise AssertionError(f"{len(sink.exchanges)} of {n} exchanges")

        await send(0, WARM_UP)
        await settle(WARM_UP)
        before = await rule()
        assert before["stage"] == "canary", before["last_transition"]
        (guard,) = [g for g in before["guards"] if g["guard"] == "sampled_divergence"]
        assert guard["status"] == "ok" and guard["samples"] >= WARM_UP - 4, guard
        assert set(served) == {"primary", "candidate"}

        switch.current = "lossy"
        sent = WARM_UP
        while sent < WARM_UP + LIMIT[defect] and (await rule())["stage"] == "canary":
            await send(sent, 12)
            sent += 12
            await settle(sent)
        after = await rule()
        assert after["stage"] == "shadow", (defect, after["guards"])
        transition = after["last_transition"]
        assert transition["by"] == "guard" and transition["guard"] == "sampled_divergence"
        tripped = [e.exchange_id for e in sink.exchanges].index(transition["exchange_id"])
        assert WARM_UP <= tripped < WARM_UP + LIMIT[defect], tripped

        await send(sent, 24)  # after the rollback: the primary answers, still no error
        assert served[-24:] == ["primary"] * 24
    assert len(served) == sent + 24
