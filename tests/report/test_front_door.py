"""Issue 27, "the front door tells the truth": the first screen of a report never contradicts what
happened or what sits beside it. On records of known truth:

- a candidate a rollout rolled back inside the window is ``rolled_back`` (never adopted or
  recommended), and the first screen says when, by which guard, its reading against the threshold;
- an ``adopt`` whose measured p99 already breaches its own checklist trigger is not an adopt;
- a candidate whose legs cannot connect (the real gateway, a closed loopback port) is
  ``candidate_failing`` with its failures counted by kind, and no word about load;
- a load-mismatched report leads with its one fix, the same in Markdown, HTML and JSON, and its
  thin categories say the mismatch;
- no sentence denies a table beside it; report.json names no single verdict among several.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path
from typing import Any

from records.sqlite_store import query_records
from report import build_report
from report.analysis import ALL, analyze
from report.rollbacks import load_transitions
from specshadow.main import main
from tests.gateway.test_shadow import CHAT, raw_stream
from tests.report.synthetic import records, several

GUARD = "guard tpot_p99_ratio: 2.41 against 1.5, e-value 1.4e+03 (anytime-valid), n=60"
T0 = 1_700_000_000_000_000_000  # synthetic.record's first start (ns)


def _rolled_out() -> list[dict[str, Any]]:
    """Two candidates; eagle's rule goes shadow → canary → shadow (rolled back); the shadow
    evidence alone adopts it for chat."""
    out = several(
        {"ngram": {"speedups": {"chat": 1.1, "code": 1.8}, "method": "ngram"},
         "eagle": {"speedups": {"chat": 1.6, "code": 1.2}, "method": "eagle3", "k": 3}},
        n=40,
    )  # fmt: skip
    for r in out:
        i = r["started_unix_ns"] - T0
        r["policy"] = {"generation": 2, "rule": "eagle"}
        r["sampling"] = {"sampled": True, "candidates": ["eagle"], "dropped": []}
        r["rollout"] = {"stage": "canary" if 10 <= i < 30 else "shadow", "failover": None}
    return out


def _transition(at_ns: int, **over: Any) -> dict[str, Any]:
    return {
        "rule": "eagle", "from_stage": "canary", "to_stage": "shadow", "serve_ratio": 0.0,
        "at_unix": at_ns / 1e9, "by": "guard", "reason": GUARD, "guard": "tpot_p99_ratio",
        "exchange_id": None,
    } | over  # fmt: skip


def _first_screen_md(md: str) -> str:
    return md.split("## Bottom line", 1)[0]


def _first_screen_html(html: str) -> str:
    return html.split("<h2", 1)[0]


def test_a_rolled_back_candidate_is_rolled_back_for_the_window_and_the_first_screen_says_why(
    tmp_path: Path,
) -> None:
    recs = _rolled_out()
    # The state file the gateway writes (rollout/state.py), with the guard's transition.
    state = tmp_path / "rollout.json"
    state.write_text(json.dumps({"version": 1, "rules": {"eagle": {
        "stage": "shadow", "fingerprint": "x", "rolled_back": True,
        "last": _transition(T0 + 30)}}}))  # fmt: skip
    assert load_transitions(state)[0]["guard"] == "tpot_p99_ratio"
    paths = build_report(recs, None, tmp_path / "r", rollout_state=state)
    a = paths.analysis
    eagle = a.candidates["eagle"]
    assert {v.decision for v in eagle.verdicts} == {"rolled_back"}
    assert all(r.backend != "eagle" for r in a.recommendations.values())
    # What the shadow evidence said before is kept, not hidden.
    chat = next(v for v in eagle.verdicts if v.category == "chat")
    assert (
        chat.without_rollback == "adopt"
        and chat.at_load is not None
        and chat.at_load.e2e is not None
    )
    (rb,) = a.rollbacks
    assert (rb.guard, rb.observed, rb.threshold, rb.backends) == (
        "tpot_p99_ratio",
        2.41,
        1.5,
        ("eagle",),
    )
    want = "by guard tpot_p99_ratio: observed 2.41 against threshold 1.5"
    assert want in chat.reasons[0] and "rolled back at 2023-11-14 22:13:20 UTC" in chat.reasons[0]
    md, html = paths.markdown.read_text(), paths.html.read_text()
    for screen in (_first_screen_md(md), _first_screen_html(html)):
        assert want in screen and "2023-11-14 22:13:20 UTC" in screen
        assert "Rests on:" in screen  # what each verdict stands on
        assert "eagle3 k=3: rolled back" in screen
    js = json.loads(paths.json.read_text())
    assert js["candidates"]["eagle"]["overall"]["verdict"] == "rolled_back"
    assert js["candidates"]["eagle"]["overall"]["without_rollback"] in ("adopt", "do_not_adopt")
    assert js["candidates"]["eagle"]["rollback"]["guard"] == "tpot_p99_ratio"
    assert js["rollbacks"][0]["threshold"] == 1.5 and js["summary"]["eagle"]["verdict"] == (
        "rolled_back"
    )
    assert "eagle" not in (js["recommendation"] or {}).values()


def test_the_records_alone_show_a_rollback_and_other_transitions_do_not_invent_one() -> None:
    recs = _rolled_out()
    a = analyze(recs)  # no state file: the records' stages still show it
    (rb,) = a.rollbacks
    assert rb.by is None and rb.at_unix_ns == T0 + 30 and rb.backends == ("eagle",)
    assert {v.decision for v in a.candidates["eagle"].verdicts} == {"rolled_back"}
    assert "canary to shadow" in a.candidates["eagle"].verdicts[0].reasons[0]
    # A policy edit back to shadow is no rollback; a guard's rollback outside the window is not
    # this window's.
    edited = analyze(recs, transitions=[_transition(T0 + 30, by="policy", reason="policy")])
    assert edited.rollbacks == [] and "rolled_back" not in {
        v.decision for v in edited.candidates["eagle"].verdicts
    }
    plain = [dict(r, rollout=None) for r in recs]
    later = analyze(plain, transitions=[_transition(T0 + 10**12 * 3600)])
    assert later.rollbacks == []
    inside = analyze(plain, transitions=[_transition(T0 + 20)])
    assert [x.guard for x in inside.rollbacks] == ["tpot_p99_ratio"]


def test_an_adopt_already_past_its_own_rollback_trigger_is_not_an_adopt() -> None:
    recs = records(speedups={"chat": 1.5}, n=60, seed=4)
    base = analyze(recs)
    (before,) = [v for v in base.candidates["candidate-backend"].verdicts if v.category == "chat"]
    assert before.decision == "adopt", before.reasons
    assert base.recommendations["chat"].backend == "candidate-backend"
    # Two of sixty candidate legs ten times slower than the slowest primary: the median speed-up
    # holds, the p99 TPOT and e2e do not.
    slowest = max(r["legs"][0]["e2e_s"] for r in recs)
    for r in recs[:2]:
        cand = r["legs"][1]
        cand["e2e_s"] = 10 * slowest
        cand["tpot_s"] = (cand["e2e_s"] - cand["ttft_s"]) / (cand["output_tokens"] - 1)
    a = analyze(recs)
    chat = next(v for v in a.candidates["candidate-backend"].verdicts if v.category == "chat")
    assert chat.at_load is not None and chat.at_load.e2e is not None
    assert chat.at_load.e2e.low > 1  # the speed-up alone would adopt
    assert chat.decision == "do_not_adopt", chat.reasons
    assert re.search(
        r"measured p99 TPOT [\d.]+ ms is already past its rollback trigger", chat.reasons[0]
    )
    assert a.recommendations["chat"].backend is None
    # … and so the checklist no longer lists a trigger its own numbers breach.
    assert not any("Roll back chat" in item for item in a.checklist)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_candidate_is_failing_not_slow(
    sims: Any, gateway: Any, write_policy: Any, tmp_path: Path, capsys: Any
) -> None:
    primary = await sims()
    base = await sims()
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  dead: {{url: 'http://127.0.0.1:{_closed_port()}', kind: sim}}\n"
        f"  base: {{url: '{base.base_url}', kind: sim}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: dead, role: candidate}, {backend: base, role: baseline}]}\n"
    )
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy), store_path=str(store))
    await asyncio.sleep(0.3)
    for i in range(30):
        cat = ("chat", "code")[i % 2]
        body = {**CHAT, "messages": [{"role": "user", "content": f"{cat} question {i}"}]}
        headers = {"x-request-id": f"f{i}", "x-specshadow-category": cat}
        status, _ = await raw_stream(gw.url, body, headers)
        assert status == 200  # the client never sees the candidate
        await gw.sink.wait_for(lambda e, i=i: e.request_id == f"f{i}")
    await gw.server.close()
    recs = list(query_records(store))
    assert len(recs) == 30
    a = analyze(recs)
    dead = a.candidates["dead"]
    f = dead.failures
    # The ground truth: every leg sent could not connect, the rest the breaker kept back.
    assert f.connect == f.sent > 0 and f.failed == f.connect and f.attempted == 30
    assert f.connect + f.breaker == 30 and not f.http and not f.timeout
    assert f.first is not None and f.first.kind == "UpstreamConnectError"
    assert {v.decision for v in dead.verdicts} == {"candidate_failing"}
    load_words = re.compile(r"\b(load|capacity|rate|fell behind|sustain)\b", re.I)
    for v in dead.verdicts:
        assert f"{f.connect} could not connect" in v.reasons[0]
        assert "first error: UpstreamConnectError at " in v.reasons[1]
        assert not any(load_words.search(r) for r in v.reasons), v.reasons
    assert all(r.backend is None for r in a.recommendations.values())
    out = tmp_path / "report"
    assert main(["report", "--store", str(store), "--out", str(out)]) == 0
    assert re.search(r"^all +candidate_failing$", capsys.readouterr().out, re.M)
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    js = json.loads((out / "report.json").read_text())
    for screen in (_first_screen_md(md), _first_screen_html(html)):
        assert "Failing: dead" in screen and "could not connect" in screen
        assert "UpstreamConnectError" in screen
    # Every line of the first screen about it, and its rows in the bottom line, without a word
    # about load.
    about = [line for line in _first_screen_md(md).splitlines() if "dead" in line]
    about += [line for line in md.split("## Bottom line", 1)[1].split("##", 1)[0].splitlines()
              if "candidate failing" in line]  # fmt: skip
    assert len(about) >= 5 and not any(load_words.search(line) for line in about), about
    assert js["verdict"] == "candidate_failing"
    assert js["candidates"]["dead"]["failures"]["could_not_connect"] == f.connect
    assert js["candidates"]["dead"]["failures"]["breaker_open_drops"] == f.breaker
    # The page has no load diagnosis of it either: no capacity problem, no admission-drop verdict.
    assert "fell behind" not in md + html and "cannot sustain" not in md + html
    assert "## Failures" in md and ">Failures</h2>" in html
    assert "Load: measured at production" not in html  # no load section for it at all


def _mismatched() -> list[dict[str, Any]]:
    """A 10 % mirror: the candidate at a tenth of production's per-replica rate; chat has
    plenty of pairs, code too few to decide alone."""
    out = records(speedups={"chat": 1.5}, n=60) + records(speedups={"code": 1.3}, n=6, seed=9)
    for r in out:
        for leg in r["legs"][1:]:
            leg["share"] = 0.1
            leg["load"] = dict(leg["load"], per_replica_rate_rps=1.0, rate_rps=1.0)
            leg["load_parity"] = 0.1
    return out


def test_a_load_mismatched_report_leads_with_its_one_fix_everywhere(
    tmp_path: Path, capsys: Any
) -> None:
    paths = build_report(_mismatched(), None, tmp_path)
    c = paths.analysis.candidates["candidate-backend"]
    overall = c.overall
    assert overall is not None and overall.decision == "not_load_matched" and overall.fix
    fix = overall.fix
    by = {v.category: v for v in c.verdicts}
    # Every category says the load mismatch, the thin one included, with the same fix.
    assert {v.decision for v in c.verdicts} == {"not_load_matched"}, {
        k: v.reasons for k, v in by.items()
    }
    assert by["code"].fix == fix and any("ran at 0.10×" in r for r in by["code"].reasons)
    assert {v.fix for v in c.verdicts} == {fix}  # one fix: the candidate's share, not a category's
    assert all(v.reasons[-1] == f"to measure it at production's load: {fix}" for v in c.verdicts)
    # The terminal (the demo's act 1) prints the same words.
    from specshadow.story import print_mismatch

    print_mismatch(paths.analysis)
    assert f"to measure it at production's load: {fix}\n" in capsys.readouterr().out
    md, html = paths.markdown.read_text(), paths.html.read_text()
    js = json.loads(paths.json.read_text())
    assert f"The fix: {fix}." in _first_screen_md(md)
    assert f"The fix: {fix}." in _first_screen_html(html).replace("&#x27;", "'")
    # The fix comes first: before any verdict line.
    glance = _first_screen_md(md)
    assert glance.index("Fix first") < glance.index(": not load-matched** —")
    assert js["overall"]["fix"] == fix and js["categories"]["code"]["fix"] == fix
    assert js["summary"]["candidate-backend"]["fix"] == fix
    assert "not enough data" not in md.split("## Candidates", 1)[0]


def test_no_sentence_denies_the_head_to_head_table_beside_it(tmp_path: Path) -> None:
    recs = several({"a": {"speedups": {"chat": 1.3}}, "b": {"speedups": {"chat": 1.5}}}, n=12)
    for r in recs:
        for leg in r["legs"]:
            if leg["role"] == "candidate":
                leg["load_parity"] = 0.1  # mirrored to both, never at production's load
    paths = build_report(recs, None, tmp_path)
    html = paths.html.read_text()
    assert "No request reached two candidates" not in html
    (h,) = [h for h in paths.analysis.head_to_head if h.category == ALL]
    assert h.mirrored == 24 and h.e2e is None
    assert f"{h.mirrored} requests reached two candidates (the table below)" in html


def test_report_json_names_one_verdict_only_when_there_is_one_candidate(tmp_path: Path) -> None:
    one = json.loads(
        build_report(records(speedups={"chat": 1.5}), None, tmp_path / "1").json.read_text()
    )
    assert one["verdict"] == one["overall"]["verdict"] == "adopt"
    assert one["candidate"] == "candidate-backend" and set(one["summary"]) == {"candidate-backend"}
    two = json.loads(build_report(_rolled_out(), None, tmp_path / "2").json.read_text())
    for key in ("verdict", "overall", "categories", "candidate", "capacity"):
        assert key not in two, key
    assert set(two["summary"]) == {"ngram", "eagle"} == set(two["candidates"])
    assert (
        two["summary"]["ngram"]["categories"]["code"]
        == (two["candidates"]["ngram"]["categories"]["code"]["verdict"])
    )


def test_a_minute_to_read_contents_glosses_and_no_empty_chart(tmp_path: Path) -> None:
    recs = records(speedups={"chat": 1.5, "code": 1.3}, n=40, baseline_divergence=0.0)
    paths = build_report(recs, None, tmp_path)
    md, html = paths.markdown.read_text(), paths.html.read_text()
    # A table of contents linking every section.
    headings = re.findall(r"^## (.+)$", md, re.M)
    contents = md.split("## Contents", 1)[1].split("\n## ", 1)[0]
    for name in headings:
        if name not in ("At a glance", "Contents"):
            assert f"[{name}](#" in contents, name
    ids = set(re.findall(r'<h2 id="([^"]+)"', html))
    links = re.findall(r'<nav class="toc">.*?</nav>', html, re.S)[0]
    assert set(re.findall(r'href="#([^"]+)"', links)) == ids and len(ids) >= 8
    # Each term glossed once, right after the block of its first use; the page uses them all.
    terms = {"load parity": r"(?i:\bload parity\b)", "MAL": r"\bMAL\b|(?i:mean acceptance length)",
             "MMD": r"\bMMD\b", "TOST": r"\bTOST\b", "Holm": r"\bHolm\b"}  # fmt: skip
    for doc, gloss, blocks in (
        (md, "> *{term}", md.split("\n\n")),
        (html, '<p class="gloss"><b>{term}', html.split("\n")),
    ):
        for term, pattern in terms.items():
            glosses = [i for i, b in enumerate(blocks) if b.startswith(gloss.format(term=term))]
            used = [i for i, b in enumerate(blocks)
                    if re.search(pattern, re.sub(r'\s(alt|src|href)="[^"]*"', "", b))
                    and not b.startswith(("> *", '<p class="gloss"'))]  # fmt: skip
            if doc is html:
                assert used, term
            assert len(glosses) == (1 if used else 0), term
            if used:  # right after the first use, among the glosses of that block
                between = blocks[used[0] + 1 : glosses[0]]
                assert glosses[0] > used[0], term
                assert all(g.startswith(("> *", '<p class="gloss"')) for g in between), term
    # No chart of zeros: no candidate output differs, and the page says so in words.
    assert paths.analysis.candidates["candidate-backend"].quality[ALL].candidate_divergence.k == 0
    assert re.search(
        r"0 of \d+ greedy outputs differ from the primary", html.replace("&#x27;", "'")
    )
