"""A rollback by the real gateway's guard reaches the report (issue 27): the demo's story — a
canary, a bad deploy, the guard rolls the rule back — through the gateway, its record store and
its rollout state file, then ``build_report`` over the whole window. The bad deploy is one whose
speculation stopped paying (one token per event, a count the stream shows exactly), so which guard
fires, and that it fires, do not depend on the machine's speed; the demo's own bad deploy (ten
times slower) is the timing tier's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from records.reader import read
from report import build_report
from report.analysis import analyze


def _first_screen_md(md: str) -> str:
    return md.split("## Bottom line", 1)[0]


def _first_screen_html(html: str) -> str:
    return html.split("<h2", 1)[0]


async def test_a_rollback_by_the_real_gateways_guard_is_on_the_reports_first_screen(
    servers: Any, tmp_path: Path, write_policy: Any, sims: Any
) -> None:
    """The demo's story on the real gateway: a canary, a bad deploy (its drafts no longer
    accepted), the guard rolls the rule back; the report over the whole window must not adopt the
    candidate, and says why."""
    from gateway.settings import Settings
    from report.gather import gather
    from simulator.switch import Switch
    from specshadow.app import build_app
    from tests.conftest import FAST_UPSTREAM, start_server
    from tests.gateway.test_rollout import FAST, Rig, policy

    primary = await sims(**FAST)
    good = await sims(mode="speculative", acceptance=0.8, **FAST)
    # The same engine (a change of engine would start a new episode), the same text, no draft
    # accepted: one token per event.
    collapsed = await sims(mode="speculative", acceptance=0.0, **FAST)
    switch = Switch({"good": good.base_url, "collapsed": collapsed.base_url}, "good")
    switch_server = await start_server(switch.app())
    servers.append(switch_server)
    store, state = tmp_path / "r.sqlite", tmp_path / "rollout.json"
    rig = Rig(servers, tmp_path, write_policy)
    text = policy(
        primary.base_url,
        str(switch_server.make_url("")).rstrip("/"),
        # Only the guard on a count: the latency guards read the wall clock, and the acceptance
        # drift watch (the same collapse) answers with a stage change, not a rollback.
        guards={
            "window": 60,
            "min_samples": 20,
            "e2e_p99_ratio_max": None,
            "tpot_p99_ratio_max": None,
            "acceptance_drop_max": None,
        },
    )
    settings = Settings(
        policy_path=rig.write_policy(text), state_path=str(state), store_path=str(store),
        shutdown_timeout_s=2.0, policy_poll_s=0.05, scrape_interval_s=0.1, upstream=FAST_UPSTREAM,
    )  # fmt: skip
    rig.server = await start_server(build_app(settings, sinks=[rig.sink]))
    servers.append(rig.server)
    rig.url = str(rig.server.make_url("")).rstrip("/")
    await rig.send(60)
    await rig.settle(60)
    assert await rig.stage() == "canary"
    switch.current = "collapsed"
    for _ in range(40):
        await rig.send(8)
        await rig.settle(rig.sent)
        if await rig.stage() == "shadow":
            break
    last = (await rig.status())["rules"]["default"]["last_transition"]
    assert last["by"] == "guard", last
    await rig.send(24)  # after the rollback: the primary answers, the candidate is mirrored
    await rig.settle(rig.sent)
    await rig.stop()
    _, recs = gather([str(store)])
    # The records alone show the rollback; the state file says by which guard, on which reading.
    alone = analyze(recs)
    assert [(rb.rule, rb.backends, rb.by) for rb in alone.rollbacks] == [
        ("default", ("cand",), None)
    ]
    paths = build_report(recs, None, tmp_path / "report", rollout_state=state)
    a = paths.analysis
    (rb,) = a.rollbacks
    assert (rb.by, rb.guard, rb.reason) == ("guard", last["guard"], last["reason"])
    assert rb.guard == "tokens_per_event" and rb.threshold == 1.2  # the default floor
    # The reading is the window's mean (it may still hold good exchanges from before the deploy:
    # the test fired on the evidence since), and no exchange has fewer than one token per event.
    assert rb.observed is not None and rb.observed >= 1.0
    assert rb.at_unix_ns == int(last["at_unix"] * 1e9)
    assert {v.decision for v in a.candidates["cand"].verdicts} == {"rolled_back"}
    assert all(r.backend is None for r in a.recommendations.values())
    want = f"by guard {rb.guard}: observed {rb.observed:g} against threshold {rb.threshold:g}"
    md, html = paths.markdown.read_text(), paths.html.read_text()
    for screen in (_first_screen_md(md), _first_screen_html(html)):
        assert want in screen and rb.at() in screen
    js = json.loads(paths.json.read_text())
    assert js["verdict"] == "rolled_back" and js["rollbacks"][0]["guard"] == rb.guard
    assert not paths.rollout  # nothing to roll out again
    # Issue 36: every record carries the episode the gateway stamped at dispatch — the state
    # file's episode, one for the whole run (a rollback starts no new one) — and the report
    # splits at it: the rolled-back episode spans the run, so no leg of the bad deploy is judged.
    episode = json.loads(state.read_text())["rules"]["default"]["episode"]
    assert episode and {r.rollout_episode for r in map(read, recs)} == {episode}
    (ep,) = a.episodes
    assert ep.episode == episode and ep.end_unix_ns is None
    assert ep.start_unix_ns == min(r.started_unix_ns for r in map(read, recs))
    cand = a.candidates["cand"]
    assert cand.span is not None and cand.load_points == [] and cand.crossover is None
