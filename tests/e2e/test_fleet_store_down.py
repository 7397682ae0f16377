"""Fail static, on the fleet's real ClickHouse server: two ``specshadow serve`` replicas share
``--state clickhouse://…``; the server is stopped mid-canary and started again.

While it is down the replicas keep serving the last decision (the canary), say so (``/readyz``'s
``rollout_store``, ``specshadow_rollout_store_up 0``, ``/admin/rollout``'s ``store``), and their
local guards still roll a candidate that started failing back on their own. When it returns, the
rollback they decided and the observations they kept are published: the store's chain ends in
that rollback, and its evidence log holds every exchange sent."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout.store import parse_state_url
from rollout.store_clickhouse import ClickHouseStateStore
from simulator.config import Faults
from simulator.switch import Switch
from tests.conftest import start_server
from tests.e2e.test_fleet_rollout import FAST, Traffic, admin, policy, stage, start
from tests.receivers.clickhouse import ClickHouseServer, requires_clickhouse
from tests.rollout.test_fleet_store import restart_clickhouse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), requires_clickhouse]


async def get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, await r.text()


async def until(what: str, check: Any, timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout_s, what
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_replicas_keep_the_last_decision_without_the_store_and_publish_theirs_when_it_returns(
    servers: list[Any], sims: Any, tmp_path: Path
) -> None:
    primary = await sims(mode="speculative", acceptance=0.8, **FAST)
    good = await sims(mode="speculative", acceptance=0.8, **FAST)
    failing = await sims(mode="speculative", faults=Faults(status=500), **FAST)
    switch = Switch({"good": good.base_url, "failing": failing.base_url}, "good")
    switch_server = await start_server(switch.app())
    servers.append(switch_server)
    candidate = str(switch_server.make_url("")).rstrip("/")
    guards = {"window": 60, "min_samples": 20, "tokens_per_event_min": None}
    (tmp_path / "policy.yaml").write_text(policy(primary.base_url, candidate, guards=guards))
    with ClickHouseServer(tmp_path / "clickhouse") as clickhouse:
        state = clickhouse.url("rollout") + "?poll_s=0.5"
        args = ["--policy", str(tmp_path / "policy.yaml"), "--state", state]
        async with AsyncExitStack() as stack:
            fleet = await start(stack, args, 2)
            urls = [g.url for g in fleet]
            sent = Traffic(urls)
            await sent.run(40)
            assert {await stage(u) for u in urls} == {"canary"}
            for u in urls:
                assert "reachable" in (await get(u, "/readyz"))[1]

            async def pooled_read() -> bool:
                # Every replica's guards read the pooled log: all 40 exchanges, both replicas'.
                samples = [
                    {
                        g["guard"]: g["samples"]
                        for g in (await admin(u))["rules"]["default"]["guards"]
                    }
                    for u in urls
                ]
                return all(s.get("error_rate_delta", 0) >= 40 for s in samples)

            await until("the replicas never read the pooled evidence", pooled_read)

            clickhouse._proc.stop(10.0)  # the store goes away mid-canary

            async def all_down() -> bool:
                bodies = [(await get(u, "/readyz"))[1] for u in urls]
                return all("unreachable" in b for b in bodies)

            noticed = await until("the replicas never noticed the store was gone", all_down)
            for u in urls:
                status, body = await get(u, "/readyz")
                assert status == 200 and "serving the last decision" in body
                assert "specshadow_rollout_store_up 0" in (await get(u, "/metrics"))[1]
                assert (await admin(u))["store"]["up"] is False
            during = Traffic(urls)
            await during.run(60)  # the last decision still holds: the canary answers its share
            assert {who for _, who in during.answers} == {"primary", "candidate"}

            # The candidate fails (clients get the primary's answer: failover) and the local guards
            # still protect each replica.
            switch.current = "failing"
            load = Traffic(urls)
            stop = asyncio.Event()
            clients = asyncio.create_task(load.run(None, stop))

            async def all_shadow() -> bool:
                return {await stage(u) for u in urls} == {"shadow"}

            try:
                local = await until("no local rollback without the store", all_shadow, 90.0)
            finally:
                stop.set()
                await clients
            for u in urls:
                rule = (await admin(u))["rules"]["default"]
                assert rule["last_transition"]["by"] == "guard"
                assert "store is unreachable" in rule["last_transition"]["reason"]
                assert (await admin(u))["store"]["pending_decisions"] == ["default"]

            restart_clickhouse(clickhouse)

            async def published() -> bool:
                stores = [(await admin(u))["store"] for u in urls]
                return all(s["up"] and s["pending_decisions"] == [] for s in stores)

            back = await until("the local rollback was never published", published)
            for u in urls:
                assert "specshadow_rollout_store_up 1" in (await get(u, "/metrics"))[1]
            store = ClickHouseStateStore(parse_state_url(clickhouse.url("rollout")), settle_s=0)
            chain = store.history("default")
            assert chain[-1].state.stage == "shadow" and chain[-1].state.rolled_back
            assert "store is unreachable" in (
                chain[-1].state.last.reason if chain[-1].state.last else ""
            )
            assert [s.state.stage for s in chain].count("shadow") == 1  # published once
            total = sent.sent + during.sent + load.sent
            _, pooled = store.evidence("default", chain[-1].state.episode, None, 100_000)
            # Nothing observed while it was down is lost: every replica's observations (one per
            # exchange with a candidate leg; fewer than sent once the candidate's breaker opens).
            stores = [(await admin(u))["store"] for u in urls]
            assert all(
                s["unpublished_observations"] == s["dropped_observations"] == 0 for s in stores
            )
            assert len(pooled) == sum(s["observations"] for s in stores) >= sent.sent + during.sent
            print(f"\nstore down noticed in {noticed:.2f} s; local rollback {local:.2f} s after the"
                  f" switch; published {back:.2f} s after the store returned; {len(pooled)} of {total} exchanges pooled")  # fmt: skip
