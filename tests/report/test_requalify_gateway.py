"""Re-qualification through the real gateway (issue 30): the candidate's engine is upgraded in
the middle of the window (the simulator's version changes mid-run, as a rolling upgrade does); the
report lists the change — when, which backend, which field, from what to what — and judges only
the exchanges after it.

Ground truth: the test changes the version itself, then sends requests one at a time until the
gateway's evidence shows the new version (the probe refreshes every ten scrapes), then sends a
known number more. The exchanges after the change are exactly those: the report must judge that
many, and the pairs its verdict counts are those exchanges' pairs. The candidate is upgraded
first (then it differs from production in its version: confounded), production after it (one
version on both legs again: judged as any clean candidate)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import aiohttp

from core.evidence import Evidence
from core.sinks import MemorySink
from gateway.settings import Settings
from records.reader import read
from records.sqlite_store import query_records
from report import build_report
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server
from tests.report.test_confound_gateway import PLAIN, SPEC, policy

BEFORE, MID, AFTER = 16, 16, 20


class Versions:
    """An evidence consumer: each leg's engine version as each exchange's record says."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str | None]] = {"prim": [], "cand": []}
        self.changed = threading.Condition()  # notified after each exchange (worker thread)

    def handle(self, evidence: Evidence) -> None:
        r = read(evidence.record)
        with self.changed:
            for name, leg in (("prim", r.primary), ("cand", r.candidate_leg("cand"))):
                engine = leg.engine if leg is not None else None
                settings = engine.settings if engine is not None else None
                self.seen[name].append(settings.get("version") if settings is not None else None)
            self.changed.notify_all()

    def wait_for(self, n: int, timeout_s: float = 30.0) -> bool:
        """Block until ``n`` exchanges were seen (a deadline only turns a hang into a failure)."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.seen["prim"]) >= n, timeout_s)


async def test_an_engine_upgrade_mid_window_splits_the_evidence(
    sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any
) -> None:
    prim, cand = await sims(**PLAIN), await sims(**SPEC)
    store = tmp_path / "r.sqlite"
    text = policy({"prim": prim.base_url, "cand": cand.base_url}, baseline=False)
    settings = Settings(
        policy_path=write_policy(text), store_path=str(store), shutdown_timeout_s=2.0,
        scrape_interval_s=0.05, upstream=FAST_UPSTREAM,
    )  # fmt: skip
    sink, versions = MemorySink(), Versions()
    server = await start_server(build_app(settings, sinks=[sink], consumers=[versions]))
    url = str(server.make_url("")).rstrip("/")
    sent = 0

    async def send(n: int, session: aiohttp.ClientSession) -> None:
        nonlocal sent
        gate = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": f"question {i}"}],
                "max_tokens": 48,
                "stream": True,
            }
            async with gate, session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()

        await asyncio.gather(*(one(sent + i) for i in range(n)))
        sent += n
        await sink.wait_for(lambda e: len(sink.exchanges) >= sent)

    async def upgrade(sim: Any, backend: str) -> int:
        """Upgrade ``sim`` to 0.33.0; send one at a time until the evidence shows it."""
        sim.engine.update(version="0.33.0")
        for n in range(1, 200):
            await send(1, session)
            await evidence_of(sent)
            if versions.seen[backend][-1] == "0.33.0":
                return n
        raise AssertionError(versions.seen[backend][-5:])

    async def evidence_of(n: int) -> None:
        """Wait until the evidence consumer (on the worker thread, behind the sink) has seen
        ``n`` exchanges."""
        if not await asyncio.to_thread(versions.wait_for, n):
            raise AssertionError(f"the evidence consumer saw {len(versions.seen['prim'])} of {n}")

    await asyncio.sleep(0.3)  # the probe's first answers
    async with aiohttp.ClientSession() as session:
        await send(BEFORE, session)
        old = cand.engine.version
        waited_cand = await upgrade(cand, "cand")  # the candidate alone is upgraded …
        await send(MID, session)
        mid = sent
        waited_prim = await upgrade(prim, "prim")  # … then production too
        await send(AFTER, session)
    await server.close()
    records = sorted(query_records(store), key=lambda r: r["started_unix_ns"])
    assert len(records) == BEFORE + waited_cand + MID + waited_prim + AFTER
    assert versions.seen["cand"][:BEFORE] == [old] * BEFORE

    # Up to the end of MID: the candidate's upgrade splits the window, and since production
    # still runs the old version, the candidate is confounded by it — judged on MID + 1 exchanges.
    a = build_report(records[:mid], None, tmp_path / "mid").analysis
    (change,) = a.config_changes
    assert (change.backend, change.fields) == ("cand", ("version",))
    assert (change.before["version"], change.after["version"]) == (old, "0.33.0")
    assert a.judged == MID + 1
    c = a.candidates["cand"]
    assert c.confound is not None and c.confound.fields == ("version",)
    assert {v.decision for v in c.verdicts} == {"confounded"}
    overall = c.overall
    assert overall is not None and overall.at_load is not None
    assert overall.at_load.mirrored_pairs == MID + 1  # only the pairs after the change

    # The whole window: production's upgrade is the latest change; the exchanges after it run
    # one version on both legs and are judged as any clean candidate — AFTER + 1 of them.
    paths = build_report(records, None, tmp_path / "all")
    a = paths.analysis
    assert [(ch.backend, ch.fields) for ch in a.config_changes] == [
        ("cand", ("version",)),
        ("prim", ("version",)),
    ]
    assert a.judged == AFTER + 1
    c = a.candidates["cand"]
    assert c.confound is not None and c.confound.fields == ()
    overall = c.overall
    assert overall is not None and overall.decision != "confounded"
    assert overall.at_load is not None and overall.at_load.mirrored_pairs == AFTER + 1
    md = paths.markdown.read_text()
    assert "prim changed configuration" in md and f"version {old} → 0.33.0" in md
    js = json.loads(paths.json.read_text())
    assert js["judged_exchanges"] == AFTER + 1
    assert any(f"judge the {AFTER + 1} exchanges" in n for n in js["notes"])
    assert [ch["backend"] for ch in js["config_changes"]] == ["cand", "prim"]


async def test_a_rollback_before_a_new_build_no_longer_decides_the_verdict(
    servers: Any, tmp_path: Path, write_policy: Any, sims: Any
) -> None:
    """A canary rolled back by its operator, then a new build of the candidate: the rollout
    starts the new build at its first canary step, and the report judges the new build on its
    own exchanges — not ``rolled_back`` — while still showing the rollback, marked as before."""
    from tests.gateway.test_rollout import FAST, Rig, policy as rollout_policy

    prim = await sims(**FAST)
    cand = await sims(mode="speculative", acceptance=0.8, **FAST)
    rig = Rig(servers, tmp_path, write_policy)
    store = tmp_path / "r.sqlite"
    text = rollout_policy(prim.base_url, cand.base_url, guards={"window": 60, "min_samples": 10})
    settings = Settings(
        policy_path=write_policy(text), store_path=str(store), shutdown_timeout_s=2.0,
        policy_poll_s=0.05, scrape_interval_s=0.05, upstream=FAST_UPSTREAM, admin_token="t",
    )  # fmt: skip
    rig.server = await start_server(build_app(settings, sinks=[rig.sink]))
    servers.append(rig.server)
    rig.url = str(rig.server.make_url("")).rstrip("/")
    await rig.send(30)
    await rig.settle(rig.sent)
    status, _ = await rig.change("rollback", token="t", reason="operator: bad deploy")
    assert status == 200
    await rig.send(20)
    await rig.settle(rig.sent)
    assert (await rig.stage()) == "shadow"
    cand.engine.update(version="0.33.0")  # a new build
    for _ in range(100):
        await rig.send(2)
        await rig.settle(rig.sent)
        if await rig.stage() == "canary":
            break
    assert await rig.stage() == "canary"
    last = (await rig.status())["rules"]["default"]["last_transition"]
    assert "the rollback is lifted" in last["reason"]
    prim.engine.update(version="0.33.0")  # production follows: one version on both again
    for _ in range(100):
        await rig.send(2)
        await rig.settle(rig.sent)
        recs = [read(r) for r in query_records(store)] if store.exists() else []
        if recs and any(
            r.primary is not None
            and r.primary.engine is not None
            and (r.primary.engine.settings or {}).get("version") == "0.33.0"
            for r in recs
        ):
            break
    await rig.send(30)
    await rig.settle(rig.sent)
    await rig.stop()
    records = list(query_records(store))
    paths = build_report(records, None, tmp_path / "report")
    a = paths.analysis
    assert [ch.backend for ch in a.config_changes] == ["cand", "prim"]
    (rb,) = a.rollbacks
    assert a.judged_since is not None and rb.at_unix_ns < a.judged_since
    c = a.candidates["cand"]
    assert {v.decision for v in c.verdicts}.isdisjoint({"rolled_back", "confounded"})
    md = paths.markdown.read_text()
    assert "Before the configuration change below" in md
