"""Runs, workflow types and the projected run speed-up on records with known truth.

Each run here is a script — steps of calls launched together, tool time between steps — with
production's and the candidate's time per call known. The truth is computed from the script
(a step lasts as long as its slowest call; the tool time is fixed), a different path from the
report's (calls grouped by trace id, blocks of overlapping intervals on the gateway's clock).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from records.reader import read_all
from report import build_report
from report.front import terminal
from report.workflows import workflows_of

_ids = itertools.count()
T0 = 1_700_000_000_000_000_000


@dataclass(frozen=True)
class C:
    """One call: production's TTFT and decode, the candidate's TPOT speed-up and TTFT ratio."""

    ttft: float
    decode: float
    speedup: float = 2.0
    ttft_ratio: float = 1.0
    tokens: int = 101

    def prod(self) -> float:
        return self.ttft + self.decode

    def cand(self) -> float:
        return self.ttft * self.ttft_ratio + self.decode / self.speedup


def leg(role: str, backend: str, start_ns: int, ttft: float, decode: float, tokens: int) -> Any:
    return {
        "role": role, "backend": backend, "status": 200, "outcome": "completed",
        "started_unix_ns": start_ns, "ttft_s": ttft, "tpot_s": decode / (tokens - 1),
        "e2e_s": ttft + decode, "output_tokens": tokens,
    }  # fmt: skip


def record(
    start: float,
    c: C,
    *,
    trace: str | None,
    kind: str | None = None,
    session: str | None = None,
    mirrored: bool = True,
    served_by: str = "primary",
    category: str = "chat",
) -> dict[str, Any]:
    ns = T0 + round(start * 1e9)
    legs = [leg("primary", "prod", ns, c.ttft, c.decode, c.tokens)]
    if mirrored:
        cand = leg("candidate", "spec", ns, c.ttft * c.ttft_ratio, c.decode / c.speedup, c.tokens)
        legs.append(cand)
    workflow = None
    if trace or kind or session:
        workflow = {"trace_id": trace, "session": session, "workflow_type": kind}
    return {
        "schema": "specshadow.record/1", "exchange_id": f"ex-{next(_ids)}",
        "started_unix_ns": ns, "route": "chat", "category": category, "served_by": served_by,
        "workflow": workflow, "legs": legs,
    }  # fmt: skip


def script(
    steps: list[tuple[list[C], float]], *, trace: str, start: float = 0.0, **kw: Any
) -> tuple[list[dict[str, Any]], float, float]:
    """A run's records and its true production and candidate wall times: each step's calls at
    once, then its tool gap (the last step's gap ends the script, not the run)."""
    recs, t, prod, cand = [], start, 0.0, 0.0
    for i, (calls, gap) in enumerate(steps):
        recs += [record(t, c, trace=trace, **kw) for c in calls]
        step = max(c.prod() for c in calls)
        t += step + gap
        last = i == len(steps) - 1
        prod += step + (0 if last else gap)
        cand += max(c.cand() for c in calls) + (0 if last else gap)
    return recs, prod, cand


def test_sequential_calls_with_tool_gaps_project_as_the_script_says() -> None:
    steps = [([C(0.1, 0.9)], 1.0), ([C(0.1, 0.9)], 1.0), ([C(0.1, 0.9)], 0.0)]
    recs, prod, cand = script(steps, trace="a" * 32, kind="agent")
    w = workflows_of(read_all(recs))
    assert w is not None
    t = w.types["agent"]
    assert (t.runs, t.calls_per_run) == (1, 3)
    assert t.wall_s == pytest.approx(5.0)
    assert t.between_s == pytest.approx(2.0)
    assert t.generation_share == pytest.approx(2.7 / 5.0)
    p = t.projections["spec"]
    assert p.estimate == pytest.approx(prod / cand) and prod / cand == pytest.approx(5.0 / 3.65)
    assert p.per_call_speedup == pytest.approx(2.0)
    assert (p.low, p.high) == (None, None)  # one run: no interval
    # sequential calls and TTFT unchanged: the closed form agrees
    assert t.amdahl(2.0) == pytest.approx(p.estimate)


def test_a_fan_out_counts_once_and_is_as_slow_as_its_slowest_call() -> None:
    runs = [
        script(
            [([C(0.05, 0.5)], 0.2), ([C(0.05, 0.5), C(0.05, 1.5, speedup=3.0)], 0.2),
             ([C(0.05, 0.3, ttft_ratio=2.0)], 0.0)],
            trace=f"{i:032x}", start=10.0 * i, kind="fan",
        )
        for i in range(1, 4)
    ]  # fmt: skip
    w = workflows_of(read_all([r for recs, _, _ in runs for r in recs]))
    assert w is not None
    t = w.types["fan"]
    assert (t.runs, t.calls_per_run) == (3, 4)
    prod = sum(p for _, p, _ in runs)
    cand = sum(c for _, _, c in runs)
    p = t.projections["spec"]
    assert p.estimate == pytest.approx(prod / cand)
    assert p.low == pytest.approx(p.estimate) and p.high == pytest.approx(p.estimate)
    # the sum of the calls' times would count the fan-out twice
    calls = 4 * 0.05 + 0.5 + 0.5 + 1.5 + 0.3
    assert t.llm_share == pytest.approx((prod - 3 * 0.4) / prod)
    assert t.llm_share < calls / (prod / 3)


def test_calls_not_mirrored_take_the_types_pooled_ratios() -> None:
    steps = [([C(0.1, 0.9)], 0.5), ([C(0.1, 0.9)], 0.5), ([C(0.1, 0.9)], 0.0)]
    recs, prod, cand = script(steps, trace="b" * 32, kind="agent")
    recs[1]["legs"] = recs[1]["legs"][:1]  # the second call was not mirrored
    w = workflows_of(read_all(recs))
    assert w is not None
    p = w.types["agent"].projections["spec"]
    assert (p.mirrored, p.calls) == (2, 3)
    assert p.estimate == pytest.approx(prod / cand)


def test_runs_group_by_session_over_trace_and_type_by_route_and_category() -> None:
    # one session spanning two traces (two user turns); a second run typed by route/category
    a, _, _ = script([([C(0.1, 0.4)], 0.3), ([C(0.1, 0.4)], 0.0)], trace="1" * 32, session="s1")
    b, _, _ = script(
        [([C(0.1, 0.4)], 0.3), ([C(0.1, 0.4)], 0.0)], trace="2" * 32, session="s1", start=5.0
    )
    c, _, _ = script(
        [([C(0.1, 0.4)], 0.3), ([C(0.1, 0.4)], 0.0)], trace="3" * 32, start=9.0, category="code"
    )
    single = [record(20.0, C(0.1, 0.4), trace="4" * 32)]
    canary = script([([C(0.1, 0.4)], 0.3), ([C(0.1, 0.4)], 0.0)], trace="5" * 32, start=30.0)[0]
    canary[1]["served_by"] = "candidate"
    w = workflows_of(read_all(a + b + c + single + canary))
    assert w is not None
    assert {n: (t.runs, t.calls_per_run) for n, t in w.types.items()} == {
        "chat/chat": (1, 4.0),  # the session: both turns
        "chat/code": (1, 2.0),
    }
    assert w.types["chat/chat"].wall_s == pytest.approx(5.0 + 0.5 + 0.3 + 0.5)
    assert w.left_out == {"a single call": 1, "served by a candidate": 1}
    assert not w.types["chat/code"].named


def test_no_runs_no_workflows() -> None:
    assert workflows_of(read_all([record(0.0, C(0.1, 0.4), trace=None)])) is None


def test_the_gate_is_stated_per_type_and_the_report_leads_with_runs(tmp_path: Path) -> None:
    tools = [
        script([([C(0.05, 0.3)], 2.0), ([C(0.05, 0.3)], 2.0), ([C(0.05, 0.3)], 0)],
               trace=f"{i:032x}", start=20.0 * i, kind="tool-heavy")
        for i in range(1, 5)
    ]  # fmt: skip
    gens = [
        script([([C(0.05, 1.5)], 0.05), ([C(0.05, 1.5)], 0.0)],
               trace=f"{i + 100:032x}", start=20.0 * i + 10, kind="generation-heavy")
        for i in range(1, 5)
    ]  # fmt: skip
    recs = [r for recs, _, _ in tools + gens for r in recs]
    truth = {
        name: sum(p for _, p, _ in runs) / sum(c for _, _, c in runs)
        for name, runs in (("tool-heavy", tools), ("generation-heavy", gens))
    }
    paths = build_report(recs, None, tmp_path)
    report = json.loads(paths.json.read_text())
    for name, t in truth.items():
        got = report["workflows"][name]["projected_e2e_speedup"]
        assert got["estimate"] == pytest.approx(t)
        assert got["low"] <= got["estimate"] <= got["high"]
        assert got["candidate"] == "spec"
    assert report["workflows"]["tool-heavy"]["below_gate"] is True
    assert report["workflows"]["generation-heavy"]["below_gate"] is False
    assert "rarely the first optimization" in report["workflows"]["tool-heavy"]["gate"]
    md = paths.markdown.read_text()
    assert "## Workflows: the whole run" in md
    glance = md.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    assert "Whole runs" in glance and "rarely the first optimization" in glance
    assert md.index("## Workflows: the whole run") < md.index("## Bottom line")
    assert any(line.startswith("Whole runs: ") for line in terminal(paths.analysis))
    html = paths.html.read_text()
    assert "Whole runs" in html.split("<h2", 1)[0]
    assert "Workflows: the whole run" in html
