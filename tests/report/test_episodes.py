"""Issue 36, "load figures from the evidence they describe": the window is split at rollbacks as
it is split at configuration changes. On records of known truth:

- a candidate that is 1.8× faster at every load in shadow, then gets a bad deploy (0.2×, at a
  higher load) inside a rollout episode its guard rolls back, keeps the crossover, schedule and
  verdicts of its shadow evidence — with the records' episodes and, for records written before
  the field, from their stages alone; the same records without the rollout make a crossover (the
  test can fail);
- when a new episode starts after the rolled-back one, the candidate is judged on it alone;
- a category whose pick differs between the window before the split and the judged one is on the
  first screen with why — the rollback, or the verdict's own number behind "not enough data";
- a guard breach is read by guard name, against a threshold or a reference level, for guards
  the parser has never seen (``acceptance_drop``, ``speculation_off``).
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

from report import build_report
from report.analysis import ALL, analyze
from report.load import MAX_BATCH
from report.rollbacks import _BREACH
from tests.report.synthetic import comparison, leg, record, several

T0 = 1_700_000_000_000_000_000
SHADOW, EPISODE, AFTER = 120, 120, 40  # exchanges in each part of the window


def _exchange(i: int, speedup: float, rate: float, rng: random.Random) -> dict[str, Any]:
    """One chat exchange mirrored to candidate ``eagle`` and a baseline, at per-replica ``rate``."""
    tokens = rng.randint(40, 120)
    e2e = 0.05 + tokens * 0.01 * math.exp(rng.gauss(0, 0.1))
    cand = leg("candidate", ttft=0.02, e2e=e2e / speedup * math.exp(rng.gauss(0, 0.05)),
               tokens=tokens, tpe=2.0, mal=2.5, rate=rate, parity=1.0)  # fmt: skip
    cand["backend"] = "eagle"
    cand["speculative"] = {"method": "eagle3", "num_speculative_tokens": 3}
    base = leg("baseline", ttft=0.05, e2e=e2e * math.exp(rng.gauss(0, 0.05)), tokens=tokens,
               tpe=1.0, rate=rate, parity=1.0)  # fmt: skip
    legs = [leg("primary", ttft=0.05, e2e=e2e, tokens=tokens, tpe=1.0, rate=rate), cand, base]
    return record("chat", i, legs, [comparison("primary", "candidate", True),
                                    comparison("primary", "baseline", True)])  # fmt: skip


def _window(*, next_episode: bool = False) -> list[dict[str, Any]]:
    """Shadow (no rollout): 1.8× at 2–8 requests/s. Rule ``eagle``'s episode ``ep-1``: a canary,
    then a bad deploy (0.2×, at 9–12 requests/s), rolled back at ``SHADOW + 60``; after it the
    rule stays rolled back in the same episode (still the bad deploy) — or, ``next_episode``, a
    new episode ``ep-2`` starts with a fixed deploy (1.8×)."""
    rng = random.Random(7)
    out = []
    for i in range(SHADOW + EPISODE + AFTER):
        if i < SHADOW:
            r = _exchange(i, 1.8, 2 + 6 * i / SHADOW, rng)
        elif i < SHADOW + 30:  # the canary before the bad deploy
            r = _exchange(i, 1.8, 5.0, rng)
        elif i < SHADOW + EPISODE or not next_episode:
            r = _exchange(i, 0.2, 9 + 3 * rng.random(), rng)
        else:
            r = _exchange(i, 1.8, 2 + 6 * rng.random(), rng)
        if i >= SHADOW:
            stage = "canary" if i < SHADOW + 60 else "shadow"
            episode = "ep-1"
            if next_episode and i >= SHADOW + EPISODE:
                stage, episode = "canary", "ep-2"
            r["policy"] = {"generation": 2, "rule": "eagle"}
            r["sampling"] = {"sampled": True, "candidates": ["eagle"], "dropped": []}
            r["rollout"] = {"stage": stage, "failover": None, "episode": episode}
        out.append(r)
    return out


def test_a_rolled_back_episodes_legs_make_no_crossover_schedule_or_verdict() -> None:
    recs = _window()
    shadow = analyze(recs[:SHADOW]).candidates["eagle"]
    assert shadow.crossover is None and shadow.schedule == [[1, MAX_BATCH, 3]]
    # Without the rollout, the bad deploy's legs would make a crossover: the test can fail.
    mixed = analyze([{k: v for k, v in r.items() if k != "rollout"} for r in recs])
    assert mixed.candidates["eagle"].crossover is not None
    assert mixed.candidates["eagle"].schedule != shadow.schedule
    a = analyze(recs)
    (rb,) = a.rollbacks
    assert rb.at_unix_ns == T0 + SHADOW + 60 and rb.backends == ("eagle",)
    (ep,) = a.episodes
    assert (ep.episode, ep.start_unix_ns, ep.end_unix_ns) == ("ep-1", T0 + SHADOW, None)
    eagle = a.candidates["eagle"]
    assert eagle.crossover is None and eagle.schedule == shadow.schedule
    assert [p.to_json() for p in eagle.load_points] == [p.to_json() for p in shadow.load_points]
    assert eagle.span is not None and eagle.span.end_unix_ns == T0 + SHADOW
    for v in eagle.verdicts:
        said = next(x for x in shadow.verdicts if x.category == v.category)
        assert v.decision == "rolled_back" and v.without_rollback == said.decision == "adopt"
        assert "the evidence before rule eagle's rollout episode" in v.reasons[2]
    # Records written before the field: the stages alone give the same span.
    old = copy.deepcopy(recs)
    for r in old:
        if r.get("rollout"):
            del r["rollout"]["episode"]
    again = analyze(old)
    assert [(e.start_unix_ns, e.end_unix_ns) for e in again.episodes] == [(T0 + SHADOW, None)]
    assert again.candidates["eagle"].crossover is None
    assert again.candidates["eagle"].schedule == shadow.schedule


def test_after_a_new_episode_the_candidate_is_judged_on_it_alone() -> None:
    recs = _window(next_episode=True)
    a = analyze(recs)
    (ep,) = a.episodes
    assert ep.end_unix_ns == T0 + SHADOW + EPISODE
    eagle = a.candidates["eagle"]
    assert eagle.span is not None and eagle.span.start_unix_ns == T0 + SHADOW + EPISODE
    assert eagle.crossover is None and eagle.schedule == [[1, MAX_BATCH, 3]]
    # Its pairs are exactly the new episode's (the canary's own answers are no shadow pairs).
    overall = eagle.overall
    assert overall is not None and overall.without_rollback is not None
    assert sum(p.n for p in eagle.load_points) <= AFTER
    assert "the evidence since" in overall.reasons[2]


def test_a_pick_lost_to_a_rollback_is_on_the_first_screen_with_why(tmp_path: Path) -> None:
    paths = build_report(_window(), None, tmp_path)
    a = paths.analysis
    (change,) = [c for c in a.pick_changes if c.category == "chat"]
    assert (change.before, change.after) == ("eagle", None)
    assert "rolled back at 2023-11-14 22:13:20 UTC" in change.why
    md = paths.markdown.read_text().split("## Bottom line", 1)[0]
    assert "**Pick changed: chat**" in md and change.why in md
    js = json.loads(paths.json.read_text())
    assert {(c["category"], c["before"], c["after"]) for c in js["pick_changes"]} >= {
        ("chat", "eagle", None)
    }


def test_a_pick_lost_to_thin_strata_says_the_coverage_behind_not_enough_data() -> None:
    """ngram adopts code before eagle's rollout; then production's load moves to a level ngram
    sees only off parity, so its strata cover too little of production's load: the first screen
    says so with the coverage number."""
    recs = several({"ngram": {"speedups": {"chat": 1.1, "code": 1.8}, "method": "ngram"},
                    "eagle": {"speedups": {"chat": 1.6, "code": 1.2}, "method": "eagle3"}},
                   n=60)  # fmt: skip
    late = [r for r in recs if r["started_unix_ns"] - T0 >= 40]
    for r in late:
        for lg in r["legs"]:
            lg["load"] = dict(lg["load"], per_replica_rate_rps=30.0)
            if lg["backend"] == "ngram":
                lg["load"]["per_replica_rate_rps"] = 90.0
                lg["load_parity"] = 3.0
        r["policy"] = {"generation": 2, "rule": "eagle"}
        r["sampling"] = {"sampled": True, "candidates": ["eagle"], "dropped": []}
        i = r["started_unix_ns"] - T0
        r["rollout"] = {"stage": "canary" if i < 50 else "shadow", "episode": "ep-1"}
    a = analyze(recs)
    code = next(v for v in a.candidates["ngram"].verdicts if v.category == "code")
    assert (
        code.decision == "not_enough_data"
        and "of production's load (needs 90%)" in (code.reasons[0])
    )
    (change,) = [c for c in a.pick_changes if c.category == "code"]
    assert (change.before, change.after) == ("ngram", None)
    assert code.reasons[0] in change.why and "not enough data" in change.why
    from report.front import terminal

    assert any(line.startswith("Pick changed: code") and code.reasons[0] in line
               for line in terminal(a))  # fmt: skip
    # … and what to ship says why code has no pick, with the same number.
    (ship,) = [line for line in terminal(a) if line.startswith("Ship: ")]
    assert "not enough data for" in ship and f"code (ngram k=4: {code.reasons[0]})" in ship


def test_a_guard_breach_is_read_by_guard_name_against_a_threshold_or_a_reference() -> None:
    cases = {
        "guard tpot_p99_ratio: 2.41 against 1.5, e-value 1.4e+03": ("tpot_p99_ratio", 2.41, 1.5, None),
        "guard kv_usage: 0.97 sustained at or above 0.95": ("kv_usage", 0.97, 0.95, None),
        "guard acceptance_drop: 1.9 against reference 3.3, e-value 41 (anytime-valid), n=300": (
            "acceptance_drop", 1.9, 3.3, "reference"),
        "guard speculation_off: mean acceptance length 1.0 against reference 2.5 over 50 exchanges": (
            "speculation_off", 1.0, 2.5, "reference"),
        "guard acceptance_drop: observed 1.90 tokens/pass against its reference level 3.30": (
            "acceptance_drop", 1.9, 3.3, "reference"),
    }  # fmt: skip
    for text, (guard, observed, threshold, label) in cases.items():
        m = _BREACH.search(text)
        assert m is not None, text
        got = (m["guard"], float(m["observed"]), float(m["threshold"]), m["label"])
        assert got == (guard, observed, threshold, label), text
    assert _BREACH.search("guard speculation_off: 0 drafts over 50 exchanges") is None


def test_drift_breaches_render_on_the_first_screen_by_guard_name(tmp_path: Path) -> None:
    recs = _window()
    at = (T0 + SHADOW + 60) / 1e9
    rollback = {"rule": "eagle", "from_stage": "live", "to_stage": "shadow", "at_unix": at,
                "by": "guard", "guard": "speculation_off", "exchange_id": None,
                "reason": "guard speculation_off: mean acceptance length 1.0 against reference "
                          "2.5 over 50 exchanges"}  # fmt: skip
    drift = {"rule": "eagle", "from_stage": "live", "to_stage": "canary", "at_unix": at - 1e-7,
             "by": "guard", "guard": None, "exchange_id": None,
             "reason": "guard acceptance_drop: 1.9 against reference 3.3, e-value 41"}  # fmt: skip
    paths = build_report(recs, None, tmp_path, transitions=[rollback, drift])
    a = paths.analysis
    (rb,) = a.rollbacks
    assert (rb.guard, rb.observed, rb.threshold, rb.against) == (
        "speculation_off",
        1.0,
        2.5,
        "reference",
    )
    (br,) = a.breaches
    assert (br.guard, br.observed, br.threshold, br.to_stage) == (
        "acceptance_drop",
        1.9,
        3.3,
        "canary",
    )
    md = paths.markdown.read_text().split("## Bottom line", 1)[0]
    html = paths.html.read_text().split("<h2", 1)[0]
    for screen in (md, html):
        assert "by guard speculation_off: observed 1 against reference 2.5" in screen
        assert "by guard acceptance_drop: observed 1.9 against reference 3.3" in screen
        assert "live → canary" in screen
    js = json.loads(paths.json.read_text())
    assert js["guard_breaches"][0]["guard"] == "acceptance_drop"
    assert js["guard_breaches"][0]["against"] == "reference"
    assert a.candidates["eagle"].overall is not None
    assert a.candidates["eagle"].overall.category == ALL
