"""Progressive rollout on real sockets: a canary answered by the candidate, guards that roll it
back on their own when the candidate turns slow, divergent, failing or stops speculating, sticky
rollbacks, operator promotion with the token, and automatic promotion to live.

The candidate sits behind a :class:`~tests.fakes.switch.Switch`, so a test can change what it is
mid-run — the ground truth is whichever simulator the switch points at."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core.sinks import MemorySink
from evidence.scrape import parse_sample
from gateway.settings import Settings
from gateway.state import GATEWAY
from simulator.config import Faults
from simulator.switch import Switch
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

TOKEN = "rollout-admin-token"
CHAT = {"model": "sim-model", "max_tokens": 12, "stream": True, "temperature": 0}
FAST = {"prefill_base_s": 0.001, "step_s": 0.002}


def policy(primary: str, candidate: str, **rollout: Any) -> str:
    import json

    block = json.dumps({"stage": "canary", "serve_ratio": 0.3, **rollout})
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n"
        f"  cand: {{url: '{candidate}', kind: sim, metrics_url: '{candidate}/metrics'}}\n"
        "primary: prim\n"
        "default:\n  ratio: 1.0\n  legs: [{backend: cand, role: candidate}]\n"
        f"  rollout: {block}\n"
    )


class Rig:
    """A gateway with a rollout policy, in front of a primary sim and a switchable candidate."""

    def __init__(self, servers: list[Any], tmp: Path, write_policy: Any) -> None:
        self.servers, self.tmp, self.write_policy = servers, tmp, write_policy
        self.sink = MemorySink()
        self.url = ""
        self.sent = 0

    async def start(self, policy_text: str, telemetry: Any = None) -> None:
        settings = Settings(
            policy_path=self.write_policy(policy_text),
            state_path=str(self.tmp / "rollout.json"),
            admin_token=TOKEN,
            shutdown_timeout_s=2.0,
            policy_poll_s=0.05,
            scrape_interval_s=0.1,
            upstream=FAST_UPSTREAM,
        )
        self.sink = MemorySink()
        server = await start_server(build_app(settings, sinks=[self.sink], telemetry=telemetry))
        self.servers.append(server)
        self.server = server
        self.url = str(server.make_url("")).rstrip("/")

    async def stop(self) -> None:
        await self.server.close()
        self.servers.remove(self.server)

    async def send(
        self, n: int, *, concurrency: int = 4, first: int | None = None
    ) -> list[tuple[int, str, str]]:
        """``n`` streamed chats; (status, x-specshadow-served-by, body) each, in order sent.
        ``first``: reuse request ids from there (the sampling key) instead of new ones."""
        if first is None:
            first = self.sent
            self.sent += n
        out: list[tuple[int, str, str]] = [(0, "", "")] * n
        queue = list(range(n))

        async def worker(session: aiohttp.ClientSession) -> None:
            while queue:
                i = queue.pop(0)
                body = {**CHAT, "messages": [{"role": "user", "content": f"question {first + i}"}]}
                headers = {"x-request-id": f"r{first + i}"}
                async with session.post(
                    f"{self.url}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    out[i] = (r.status, r.headers.get("x-specshadow-served-by", ""), await r.text())

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return out

    async def status(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/admin/rollout") as r:
            assert r.status == 200
            data: dict[str, Any] = await r.json()
            return data

    async def stage(self) -> str:
        return str((await self.status())["rules"]["default"]["stage"])

    async def change(self, action: str, token: str | None = TOKEN, **body: Any) -> tuple[int, Any]:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{self.url}/admin/rollout/default/{action}", json=body or None, headers=headers
            ) as r,
        ):
            return r.status, await r.json()

    async def settle(self, n: int) -> None:
        """Wait until the gateway handed ``n`` exchanges to its sinks and its rollout guards have
        seen as many (states, polled: no wait on the clock)."""
        controller = self.server.app[GATEWAY].rollout
        assert controller is not None
        for _ in range(2000):
            if len(self.sink.exchanges) >= n and controller.handled >= len(self.sink.exchanges):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(
            f"{len(self.sink.exchanges)} of {n} exchanges, {controller.handled} seen by the guards"
        )

    async def reloaded(self, reloads: int) -> None:
        """Wait until the gateway's policy store has reloaded more than ``reloads`` times."""
        store = self.server.app[GATEWAY].policy
        for _ in range(2000):
            if store.reloads > reloads:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the policy was not reloaded ({store.reloads} reloads)")

    @property
    def reloads(self) -> int:
        return self.server.app[GATEWAY].policy.reloads


async def in_flight(base_url: str, n: int) -> None:
    """Wait until the simulator at ``base_url`` holds ``n`` requests (its own /metrics)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(1000):
            async with session.get(f"{base_url}/metrics") as r:
                sample = parse_sample(await r.text(), t_ns=0, unix_ns=0)
            if (sample.num_requests_running or 0) + (sample.num_requests_waiting or 0) >= n:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{base_url} never held {n} requests")


@pytest.fixture
async def rig(servers, tmp_path, write_policy, sims):
    primary = await sims(**FAST)
    good = await sims(mode="speculative", acceptance=0.8, **FAST)
    bad = {
        # At least 5× slower than the primary — ~10× here, so that every one of its answers is
        # past the 1.5× guard however noisy the primary's own p99 is on a loaded machine.
        "slow": await sims(mode="speculative", acceptance=0.8, prefill_base_s=0.05, step_s=0.05),
        "diverging": await sims(mode="speculative", acceptance=0.8, divergence_at=2, **FAST),
        "plain": await sims(**FAST),  # speculation gone: one token per event
        "failing": await sims(mode="speculative", faults=Faults(status=500), **FAST),
    }
    switch = Switch({"good": good.base_url, **{k: v.base_url for k, v in bad.items()}}, "good")
    switch_server = await start_server(switch.app())
    servers.append(switch_server)
    r = Rig(servers, tmp_path, write_policy)
    r.primary_url = primary.base_url  # type: ignore[attr-defined]
    r.switch = switch  # type: ignore[attr-defined]
    r.candidate_url = str(switch_server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
    return r


def policy_for(rig: Any, **rollout: Any) -> str:
    return policy(rig.primary_url, rig.candidate_url, **rollout)


async def test_a_canary_at_30_percent_serves_30_percent_and_pairs_both_legs(rig):
    await rig.start(policy_for(rig, guards={"window": 400}))
    results = await rig.send(400, concurrency=8)
    assert all(status == 200 for status, _, _ in results)  # no client error
    assert all(body.rstrip().endswith("data: [DONE]") for _, _, body in results)
    served = Counter(who for _, who, _ in results)
    assert set(served) == {"primary", "candidate"}
    assert abs(served["candidate"] / 400 - 0.30) <= 0.05, served
    await rig.settle(400)
    exchanges = {e.request_id: e for e in rig.sink.exchanges}
    for i, (_, who, _) in enumerate(results):
        e = exchanges[f"r{i}"]
        assert e.served_by == who and e.primary.role == who
        assert {leg.role for leg in e.legs} == {"primary", "candidate"}  # both legs, paired
        assert all(leg.outcome == "completed" for leg in e.legs)
    # One in-flight book per backend, shared by every leg kind: a candidate answering the
    # canary counts what its backend really carries (the shadow legs to it included), not 1.
    answered = [
        e.primary.inflight_at_dispatch for e in exchanges.values() if e.served_by == "candidate"
    ]
    assert max(answered) > 1, answered
    for e in exchanges.values():
        for leg in e.legs:
            assert leg.load is not None and leg.inflight_at_dispatch == leg.load.in_flight
    # Sticky: the same sampling key is answered by the same backend every time.
    again = await rig.send(100, first=0)
    assert [who for _, who, _ in again] == [who for _, who, _ in results[:100]]
    status = await rig.status()
    assert status["rules"]["default"]["stage"] == "canary"
    assert status["rules"]["default"]["serve_ratio"] == 0.3
    assert all(g["status"] in ("ok", "unavailable") for g in status["rules"]["default"]["guards"])


async def rolled_back_after(rig: Any, since: int, batches: int = 40) -> int:
    """Send until the rule rolls back; the candidate observations the guards took from exchange
    ``since`` (the change) up to the one that tripped them, in the order they were handed over."""
    before = since
    for _ in range(batches):
        status = (await rig.status())["rules"]["default"]
        if status["stage"] != "shadow":
            await rig.send(8)
            await rig.settle(rig.sent)
            status = (await rig.status())["rules"]["default"]
        if status["stage"] == "shadow":
            tripped = status["last_transition"]["exchange_id"]
            after = list(rig.sink.exchanges)[before:]
            ids = [e.exchange_id for e in after]
            assert tripped in ids
            return sum(
                1
                for e in after[: ids.index(tripped) + 1]
                if any(leg.role == "candidate" for leg in e.legs)
            )
    raise AssertionError("no rollback")


# A detection-speed claim on the wall clock (exchanges until the latency guard trips): the timing
# tier (docs/testing.md). A CI run beside four vLLM starts (load average 17) read 93 against 15.
@pytest.mark.timing
async def test_a_candidate_turned_5x_slower_is_rolled_back_within_the_stated_bound(rig):
    window, min_samples = 60, 20
    await rig.start(
        policy_for(
            rig, guards={"window": window, "min_samples": min_samples, "tokens_per_event_min": None}
        )
    )
    await rig.send(80)
    await rig.settle(80)
    assert await rig.stage() == "canary"
    (e2e,) = [
        g
        for g in (await rig.status())["rules"]["default"]["guards"]
        if g["guard"] == "e2e_p99_ratio"
    ]
    assert e2e["status"] == "ok" and e2e["bound"] < e2e["needs"] * 100  # an e-value, near 1
    bound = e2e["needs"]  # the published bound: worst-case pairs in a row that trip it now
    assert 10 <= bound <= 30, e2e
    since = len(rig.sink.exchanges)
    rig.switch.current = "slow"  # the candidate is now 5× slower than the primary
    observed = await rolled_back_after(rig, since)
    # The guard fires after ``needs`` slow pairs (measured idle: needs 15, rolled back after
    # 15–24 candidate observations). Before those, exchanges dispatched before the switch (to the
    # fast candidate) may still land: the 4 clients' requests and the shadow legs of their last
    # primary answers. And the threshold is the primary's p99 over the previous ``window`` pairs,
    # near that window's maximum: one stall of the primary's (a descheduled moment on a loaded
    # machine) raises it until the stall leaves the window, at most ``window`` pairs later, and
    # until then a slow pair counts for nothing. Held: at most ``window + needs``, one such stall
    # per window. Read: 55 in a clean CI run (the guard's ratio 2.18, not ~5), 62 under the flake
    # gate's two busy loops (the tpot guard first, at n = 60); 93 once beside four vLLM starts
    # (load average 17), before this tier ran with nothing beside it. The size is printed.
    print(f"rolled back after {observed} candidate observations (needs {bound})")
    assert observed <= window + bound, (observed, bound)
    transition = (await rig.status())["rules"]["default"]["last_transition"]
    assert transition["by"] == "guard" and transition["guard"] in (
        "e2e_p99_ratio",
        "tpot_p99_ratio",
    )
    after = await rig.send(40)
    assert all(status == 200 and who == "primary" for status, who, _ in after)  # no client error


async def test_a_diverging_candidate_is_rolled_back_by_the_divergence_guard(rig):
    # The latency guards read the wall clock: off, so the guard that fires is the one on the text.
    off = {"e2e_p99_ratio_max": None, "tpot_p99_ratio_max": None}
    await rig.start(policy_for(rig, guards={"window": 60, "min_samples": 20, **off}))
    await rig.send(40)
    await rig.settle(40)
    since = len(rig.sink.exchanges)
    rig.switch.current = "diverging"
    await rolled_back_after(rig, since)
    transition = (await rig.status())["rules"]["default"]["last_transition"]
    assert transition["guard"] == "divergence_rate"


async def test_acceptance_collapse_is_rolled_back_by_the_tokens_per_event_guard(rig):
    await rig.start(
        policy_for(
            rig,
            guards={
                "window": 30,
                "min_samples": 10,
                "e2e_p99_ratio_max": None,
                "tpot_p99_ratio_max": None,
            },
        )
    )
    await rig.send(30)
    await rig.settle(30)
    since = len(rig.sink.exchanges)
    rig.switch.current = "plain"  # same text, one token per event
    await rolled_back_after(rig, since)
    transition = (await rig.status())["rules"]["default"]["last_transition"]
    assert transition["guard"] == "tokens_per_event"


async def test_a_failing_candidate_fails_over_then_rolls_back(rig):
    await rig.start(policy_for(rig, guards={"window": 60, "min_samples": 20}))
    await rig.send(40)
    await rig.settle(40)
    since = len(rig.sink.exchanges)
    rig.switch.current = "failing"
    results = await rig.send(24)
    assert all(status == 200 for status, _, _ in results)  # the client never sees the 500
    assert all(body.rstrip().endswith("data: [DONE]") for _, _, body in results)
    await rig.settle(rig.sent)
    failed_over = [e for e in rig.sink.exchanges if e.failover is not None]
    # A 500 fails over; after a few the candidate's breaker opens and fails over before trying.
    assert failed_over and all(
        e.failover in ("status_500", "breaker_open") and e.served_by == "primary"
        for e in failed_over
    )
    assert any(e.failover == "status_500" for e in failed_over)
    for e in failed_over:  # the failed attempt joins the exchange as a candidate leg
        (attempt,) = [leg for leg in e.legs if leg.role == "candidate" and leg is not e.primary][:1]
        if e.failover == "status_500":
            assert attempt.status == 500 and attempt.outcome == "upstream_status"
        else:
            assert attempt.error_type == "BreakerOpen"
    await rolled_back_after(rig, since)
    transition = (await rig.status())["rules"]["default"]["last_transition"]
    assert transition["guard"] == "error_rate_delta"
    assert (await rig.status())["failovers"] >= len(failed_over)


async def test_a_rollback_survives_restart_and_reload_and_only_the_token_promotes(rig):
    text = policy_for(rig, guards={"window": 60, "min_samples": 20})
    await rig.start(text)
    status, body = await rig.change("rollback", reason="drill")
    assert status == 200 and body["to_stage"] == "shadow" and body["by"] == "operator"
    await rig.stop()
    await rig.start(text)  # a restart: the state file says rolled back
    assert await rig.stage() == "shadow"
    assert (await rig.status())["rules"]["default"]["rolled_back"] is True
    results = await rig.send(12)
    assert all(who == "primary" for _, who, _ in results)
    before = rig.reloads
    rig.write_policy(text + "# reloaded: same rollout block\n")
    await rig.reloaded(before)
    assert await rig.stage() == "shadow"  # a reload does not re-promote
    assert (await rig.change("promote", token=None))[0] == 403
    assert (await rig.change("promote", token="wrong"))[0] == 403
    status, body = await rig.change("promote")
    assert status == 200 and body["to_stage"] == "canary"
    assert (await rig.status())["rules"]["default"]["rolled_back"] is False
    await rig.change("rollback")
    before = rig.reloads
    rig.write_policy(policy_for(rig, serve_ratio=0.5, guards={"window": 60, "min_samples": 20}))
    await rig.reloaded(before)
    assert await rig.stage() == "canary"  # a policy that says so promotes again
    assert (await rig.status())["rules"]["default"]["serve_ratio"] == 0.5
    state = (rig.tmp / "rollout.json").read_text()
    assert '"stage": "canary"' in state


async def test_legs_of_an_earlier_episode_landing_after_a_promotion_are_not_its_evidence(rig, sims):
    # Slow shadow legs in flight when an operator starts a new episode used to be judged in the
    # new one (tagged when they landed): one CI run's fleet rolled a fresh canary back before
    # any of its own traffic. Every exchange carries the episode it was dispatched in.
    await rig.start(policy_for(rig, guards={"window": 60, "min_samples": 20}))
    await rig.send(20)
    await rig.settle(20)
    before = (await rig.status())["rules"]["default"]["episode"]
    # 1.5 s before a first token: every leg dispatched now lands after the promotion below.
    late = await sims(mode="speculative", acceptance=0.8, prefill_base_s=1.5, step_s=0.01)
    rig.switch.targets["late"] = late.base_url
    rig.switch.current = "late"
    batch = asyncio.create_task(rig.send(8, concurrency=8))
    await in_flight(late.base_url, 8)  # every late leg dispatched, none answered yet
    status, body = await rig.change("promote", stage="canary", serve_ratio=0.3)
    assert status == 200, body
    await batch
    rig.switch.current = "good"
    await rig.settle(28)
    after = await rig.status()
    for _ in range(200):  # the guards see each exchange after its tokens are counted
        if after["stale_observations"] + after["rules"]["default"]["window"] >= 8:
            break
        await asyncio.sleep(0.05)
        after = await rig.status()
    rule = after["rules"]["default"]
    assert rule["episode"] != before and rule["stage"] == "canary"
    # The truth, from the exchanges themselves: which episode each was dispatched in.
    tags = Counter(e.rollout_episode for e in list(rig.sink.exchanges)[20:])
    assert set(tags) <= {before, rule["episode"]} and tags[before] >= 1, tags
    assert after["stale_observations"] == tags[before]
    assert rule["window"] == tags[rule["episode"]]  # the new episode saw only its own


async def test_an_operators_serve_ratio_survives_reload_and_restart_and_stops_the_steps(rig):
    text = policy_for(
        rig, steps=[0.2, 0.5, 1.0], hold={"min_requests": 1, "min_s": 0.01},
        guards={"window": 40, "min_samples": 10, "kv_usage_max": None},
    )  # fmt: skip
    await rig.start(text)
    status, body = await rig.change("promote", stage="canary", serve_ratio=0.4)
    assert status == 200 and body["serve_ratio"] == 0.4
    before = rig.reloads
    rig.write_policy(text + "# reloaded: same rollout block\n")
    await rig.reloaded(before)
    await rig.stop()
    await rig.start(text)  # a restart reads the state file
    await rig.send(40)
    await rig.settle(rig.sent)  # the steps would have moved on by now: they held long enough
    rule = (await rig.status())["rules"]["default"]
    assert (rule["stage"], rule["serve_ratio"]) == ("canary", 0.4)


async def test_a_healthy_candidate_under_steps_reaches_live_on_its_own(rig):
    await rig.start(policy_for(
        rig, steps=[0.2, 0.5, 1.0], hold={"min_requests": 8, "min_s": 0.2},
        guards={"window": 40, "min_samples": 10, "kv_usage_max": None},
    ))  # fmt: skip
    for _ in range(60):
        await rig.send(8)
        await rig.settle(rig.sent)
        if await rig.stage() == "live":
            break
    assert await rig.stage() == "live"
    results = await rig.send(16)
    assert all(who == "candidate" and status == 200 for status, who, _ in results), (
        [(status, who) for status, who, _ in results],
        (await rig.status())["rules"]["default"],
    )
    async with aiohttp.ClientSession() as s, s.get(f"{rig.url}/metrics") as r:
        metrics = await r.text()
    assert 'specshadow_rollout_stage{specshadow_rule="default"} 2' in metrics
    transitions = [
        line
        for line in metrics.splitlines()
        if line.startswith("specshadow_rollout_transitions_total")
    ]
    assert any(
        'specshadow_rollout_by="schedule"' in line and 'specshadow_rollout_to_stage="live"' in line
        for line in transitions
    )


async def test_the_rollout_cli_shows_promotes_and_rolls_back(rig, capsys):
    from specshadow.main import main

    await rig.start(policy_for(rig, stage="shadow", steps=[0.1, 0.5]))

    async def cli(*args: str) -> int:
        return await asyncio.to_thread(main, ["rollout", *args, "--gateway", rig.url])

    assert await cli("status") == 0
    assert "default: shadow, serve ratio 0.00, candidate cand" in capsys.readouterr().out
    assert await cli("promote", "default") == 1  # no token
    assert "admin bearer token" in capsys.readouterr().err
    assert await cli("promote", "default", "--token", TOKEN) == 0
    assert "default: shadow → canary (serve ratio 0.10)" in capsys.readouterr().out
    assert await cli("promote", "default", "--token", TOKEN) == 0  # the next step
    assert "canary → canary (serve ratio 0.50)" in capsys.readouterr().out
    assert await cli("rollback", "default", "--token", TOKEN, "--reason", "game day") == 0
    assert "canary → shadow: game day" in capsys.readouterr().out
    assert await cli("promote", "nope", "--token", TOKEN) == 1
    assert "no rule 'nope' has a rollout" in capsys.readouterr().err
    assert await cli("status", "--json") == 0
    assert '"rolled_back": true' in capsys.readouterr().out


async def test_a_transition_is_an_event_in_the_trace_of_the_exchange_that_tripped_it(rig):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel.settings import TelemetrySettings
    from otel.setup import build_telemetry

    spans = InMemorySpanExporter()
    telemetry = build_telemetry(
        TelemetrySettings(), span_exporter=spans, metric_reader=InMemoryMetricReader()
    )
    await rig.start(policy_for(rig, guards={"window": 40, "min_samples": 10}), telemetry=telemetry)
    await rig.send(16)
    await rig.settle(16)
    since = len(rig.sink.exchanges)
    rig.switch.current = "diverging"
    await rolled_back_after(rig, since)
    transition = (await rig.status())["rules"]["default"]["last_transition"]
    (tripper,) = [e for e in rig.sink.exchanges if e.exchange_id == transition["exchange_id"]]
    assert tripper.traceparent is not None
    await rig.stop()  # flushes the exporters
    transitions = [
        s for s in spans.get_finished_spans() if s.name == "specshadow.rollout.transition"
    ]
    by = {s.events[0].attributes["specshadow.rollout.by"]: s for s in transitions}  # type: ignore[index]
    # The policy's own start into canary is one (a root span: no exchange caused it) …
    assert set(by) == {"policy", "guard"} and by["policy"].parent is None
    # … and the guard's rollback the other, in the trace of the exchange that tripped it.
    event_span = by["guard"]
    assert f"{event_span.context.trace_id:032x}" == tripper.traceparent.split("-")[1]
    (event,) = event_span.events
    assert event.attributes is not None
    assert event.attributes["specshadow.guard"] == "divergence_rate"
    assert event.attributes["specshadow.rollout.to_stage"] == "shadow"


async def test_a_gateway_whose_guards_nothing_feeds_never_lets_a_candidate_answer(rig):
    """``gateway.app.create_app`` alone has no evidence pipeline: it refuses to start a canary,
    and a canary reloaded into it is held in shadow (the candidate answers nothing)."""
    from gateway.app import create_app

    canary = policy_for(rig)
    settings = Settings(policy_path=rig.write_policy(canary), state_path=str(rig.tmp / "s.json"),
                        policy_poll_s=0.05, shutdown_timeout_s=2.0, upstream=FAST_UPSTREAM)  # fmt: skip
    with pytest.raises(ValueError, match="nothing would feed their guards"):
        create_app(settings)
    shadow = canary.replace('"stage": "canary"', '"stage": "shadow"')
    settings = Settings(policy_path=rig.write_policy(shadow), state_path=str(rig.tmp / "s.json"),
                        policy_poll_s=0.05, shutdown_timeout_s=2.0, upstream=FAST_UPSTREAM)  # fmt: skip
    server = await start_server(create_app(settings, sinks=[rig.sink]))
    rig.servers.append(server)
    rig.server, rig.url = server, str(server.make_url("")).rstrip("/")
    rig.write_policy(canary)  # the hot reload puts the rule in canary
    for _ in range(100):
        if await rig.stage() == "canary":
            break
        await asyncio.sleep(0.05)
    assert await rig.stage() == "canary"
    results = await rig.send(60)
    assert all(status == 200 for status, _, _ in results)
    assert {who for _, who, _ in results} == {"primary"}
    assert (await rig.status())["guarded"] is False
