"""``report.json``: the report's decisions and load-true numbers, machine-readable (pure).

Schema ``specshadow.report/1``, documented in docs/report.md. Top level: ``summary.<backend>``
(each candidate's verdict for all traffic and per category, in one line each), ``rollbacks``
(rollouts rolled back inside the window); with **one** candidate also ``verdict`` (its decision
for all traffic) and that candidate's ``overall`` and ``categories.<name>`` (each ``verdict``,
``e2e_speedup_at_production_load``, ``load``, …), ``speedup_vs_load``, ``crossover_load``,
``speculation_schedule``, ``capacity`` — with several, no top-level verdict: no one candidate's
numbers read as *the* verdict; then ``candidates.<backend>`` with that shape for every candidate,
``recommendation.<category>`` (a backend name or ``null``) with its reasons, rule and policy
fragment, and ``head_to_head``. Unknown values are ``null``.
"""

from __future__ import annotations

from typing import Any

from report.analysis import ALL, Analysis, CandidateAnalysis, Verdict
from report.candidates import RULE
from report.workflows_view import workflows_json

SCHEMA = "specshadow.report/1"


def _verdict(v: Verdict, c: CandidateAnalysis) -> dict[str, Any]:
    at = v.at_load
    return {
        "verdict": v.decision,
        "reasons": list(v.reasons),
        "pairs": v.pairs,
        "pairs_needed": v.pairs_needed,
        "e2e_speedup_at_production_load": at.e2e.to_json() if at is not None and at.e2e else None,
        "tpot_speedup_at_production_load": at.tpot.to_json()
        if at is not None and at.tpot
        else None,
        "raw_e2e_speedup": None
        if v.e2e is None
        else {"estimate": v.e2e.point, "low": v.e2e.ci_low, "high": v.e2e.ci_high, "n": v.e2e.n},
        "load": at.load_json()
        if at is not None
        else {
            "primary_per_replica_p50": None,
            "candidate_per_replica_p50": None,
            "parity_p50": None,
        },
        "coverage": at.coverage if at is not None else None,
        "exclusions": dict(c.exclusions.get(v.category, {})),
        "quality": eq.to_json() if (eq := c.equivalence.get(v.category)) is not None else None,
        # not_load_matched: what would give parity 1 (the same words as the reasons' last)
        "fix": v.fix,
        # rolled_back: the rollback, and the verdict the window's evidence gives without it
        "rollback": v.rollback.to_json() if v.rollback is not None else None,
        "without_rollback": v.without_rollback,
    }


def candidate_json(c: CandidateAnalysis) -> dict[str, Any]:
    verdicts = {v.category: v for v in c.verdicts}
    cap = c.capacity
    return {
        "overall": _verdict(verdicts[ALL], c) if ALL in verdicts else None,
        "categories": {cat: _verdict(v, c) for cat, v in verdicts.items() if cat != ALL},
        "speedup_vs_load": [p.to_json() for p in c.load_points],
        "crossover_load": c.crossover.load if c.crossover is not None else None,
        "crossover_concurrency": c.crossover.concurrency if c.crossover is not None else None,
        "speculation_schedule": c.schedule,
        "num_speculative_tokens": c.depth,
        "label": c.label,
        "failures": c.failures.to_json(),
        "rollback": c.rollback.to_json() if c.rollback is not None else None,
        # a rolled-back candidate: the span of the window it was judged on (report.episodes)
        "judged_span": c.span.to_json() if c.span is not None else None,
        "confound": c.confound.to_json() if c.confound is not None else None,
        "speculative": c.speculation.to_json() if c.speculation is not None else None,
        "lossless": c.lossless.to_json() if c.lossless is not None else None,
        "capacity": {
            "sampled_legs": cap.sampled,
            "dropped": dict(cap.dropped),
            "drop_share": cap.drop_share,
            "failed_legs": cap.failed,
            "concurrency_growth": cap.growth,
            "kv_cache_per_request": cap.kv_per_request,
            "max_concurrency": {b: cap.max_concurrency(b) for b in cap.kv_per_request},
            "production_peak_concurrency": cap.production_peak_concurrency,
            "problems": cap.problems(c.backend),
        },
    }


def summary(a: Analysis) -> dict[str, Any]:
    """Each candidate in a line: its verdict for all traffic (with the first reason) and per
    category."""
    out = {}
    for b, c in a.candidates.items():
        overall = c.overall
        out[b] = {
            "label": c.label,
            "verdict": overall.decision if overall is not None else None,
            "reason": overall.reasons[0] if overall is not None and overall.reasons else None,
            "fix": overall.fix if overall is not None else None,
            "categories": {v.category: v.decision for v in c.verdicts if v.category != ALL},
        }
    return out


def report_json(a: Analysis) -> dict[str, Any]:
    main = a.main
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "records": a.records,
        # null: every section read every exchange; else the detail sections' sample size
        "sample": a.sample,
        "categories_seen": a.categories,
        "summary": summary(a),
        "rollbacks": [rb.to_json() for rb in a.rollbacks],
        # the rollout episodes those rollbacks ended: their legs make no load figure or pick
        "rolled_back_episodes": [e.to_json() for e in a.episodes],
        # guard breaches that sent a rule elsewhere than shadow, read by guard name
        "guard_breaches": [b.to_json() for b in a.breaches],
        # categories whose pick differs between the window before a split and the judged one
        "pick_changes": [ch.to_json() for ch in a.pick_changes],
        # Engine configuration changes in the window; the verdicts judge from the last one on.
        "config_changes": [ch.to_json() for ch in a.config_changes],
        "judged_since_unix_ns": a.judged_since,
        "judged_exchanges": a.judged,
        "notes": a.notes,
        # Per workflow type: the runs' shape, the gate, the projected end-to-end run speed-up.
        "workflows": workflows_json(a.workflows),
        "recommendation": {cat: r.backend for cat, r in a.recommendations.items()},
        "recommendation_reasons": {cat: r.to_json() for cat, r in a.recommendations.items()},
        "recommendation_rule": RULE,
        "recommendation_policy": a.policy_fragment,
        "rollout_timeline": [s.to_json() for s in a.rollout],
        "counterfactual": None
        if a.counterfactual is None
        else a.counterfactual.as_json() | {"rows_file": "counterfactual.json"},
        "head_to_head": [
            {"category": h.category, **h.to_json()} for h in a.head_to_head if h.mirrored
        ],
    }
    if not a.several:
        # One candidate: its verdict is the report's; several: only ``summary`` and
        # ``candidates`` speak, per candidate.
        overall = main.overall if main is not None else None
        out["candidate"] = main.backend if main is not None else None
        out["verdict"] = overall.decision if overall is not None else None
        out.update(
            candidate_json(main)
            if main is not None
            else {
                "overall": None,
                "categories": {},
                "speedup_vs_load": [],
                "crossover_load": None,
                "speculation_schedule": [],
            }
        )
    out["candidates"] = {b: candidate_json(c) for b, c in a.candidates.items()}
    return out
