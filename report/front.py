"""The report's first screen and its reading aids, shared by HTML and Markdown (pure).

:func:`front` — what a person must see before anything else, in this order: a rollback inside
the window (when, which guard, its reading against the threshold or the reference level), a
guard breach that sent a rule elsewhere than shadow (a drift guard's back-to-canary), a category
whose pick differs between the window before a split and the judged one (and why, with the
number behind it), an engine configuration change
inside the window (the verdicts judge only the exchanges after it), a failing candidate (its
failures by kind and the first error), the one fix of a load-mismatched candidate, then each
candidate's verdict for all traffic with what it rests on, what to ship, and — when any leg's
token count was not its own — how the counts were put on one footing (:mod:`report.counts`).

:data:`GLOSSARY` and :func:`first_use` — a one-line gloss of each term of art, placed right after
the block where the term first appears.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from report.analysis import ALL, DECISION_LABELS, Analysis, CandidateAnalysis, Verdict
from report.workflows_view import first_line

Kind = Literal[
    "rollback",
    "breach",
    "pick",
    "changed",
    "failing",
    "fix",
    "workflow",
    "verdict",
    "ship",
    "counts",
    "window",
]


@dataclass(frozen=True, slots=True)
class Line:
    kind: Kind
    title: str  # a few words, bold where rendered
    text: str


def _at(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _speed(v: Verdict) -> str:
    at = v.at_load.e2e if v.at_load is not None else None
    if at is None:
        return ""
    return f" · {at.estimate:.2f}× at production load [{at.low:.2f}, {at.high:.2f}]"


def rests_on(a: Analysis, c: CandidateAnalysis, v: Verdict) -> str:
    """What ``c``'s verdict ``v`` rests on, in one sentence."""
    parts = []
    if v.decision == "candidate_failing":
        f = c.failures
        parts.append(f"{f.attempted} attempted legs, {f.failed + f.breaker} of them failed")
    else:
        at = v.at_load
        if at is not None:
            parts.append(
                f"{at.matched_pairs} primary/candidate pairs at production's load of "
                f"{at.mirrored_pairs} mirrored"
            )
        else:
            parts.append("no primary/candidate pairs")
        eq = c.equivalence.get(v.category)
        if eq is not None:
            # greedy_n counts the comparable exchanges checked by exact match (sampled ones
            # too), not greedy requests: said as what it is, never added to the sampled count.
            over = f" over {eq.n} sampled exchanges" if eq.n else ""
            exact = f"; {eq.greedy_n} compared by exact match" if eq.greedy_n else ""
            parts.append(f"quality {eq.verdict.replace('_', ' ')}{over}{exact}")
    if v.rollback is not None:
        source = (
            "the records' rollout stages"
            if v.rollback.by is None
            else "the gateway's rollout transition"
        )
        parts.append(f"the rollback ({source})")
    return "; ".join(parts)


def front(a: Analysis) -> list[Line]:
    """The first screen (see the module doc)."""
    out: list[Line] = []
    labels = {b: c.label for b, c in a.candidates.items()}
    for rb in a.rollbacks:
        named = ", ".join(labels.get(b, b) for b in rb.backends) or f"rule {rb.rule}"
        words = f" The guard's words: “{rb.reason}”." if rb.reason and rb.guard else ""
        stale = a.judged_since is not None and rb.at_unix_ns < a.judged_since
        said = (
            "Before the configuration change below: the verdict judges the new configuration."
            if stale
            else "Not recommended for this window; its verdict is rolled back."
        )
        out.append(Line("rollback", f"Rolled back: {named}", f"{rb.text()}. {said}" + words))
    for br in a.breaches:
        named = ", ".join(labels.get(b, b) for b in br.backends) or f"rule {br.rule}"
        words = f" The guard's words: “{br.reason}”." if br.reason else ""
        out.append(Line("breach", f"Guard {br.guard or br.by}: {named}", f"{br.text()}.{words}"))
    for ch in a.pick_changes:
        cat = "all traffic" if ch.category == ALL else ch.category
        was = labels.get(ch.before, ch.before) if ch.before is not None else "none"
        now = labels.get(ch.after, ch.after) if ch.after is not None else "none"
        out.append(
            Line(
                "pick",
                f"Pick changed: {cat}",
                f"{was} on the evidence {ch.split}; {now} over the window judged. Why: {ch.why}.",
            )
        )
    if a.config_changes and a.judged_since is not None:
        moved = "; ".join(ch.text() for ch in a.config_changes)
        out.append(
            Line(
                "changed",
                "Configuration changed",
                f"{moved}. The verdicts judge the latest configuration: the {a.judged} exchanges "
                f"since {_at(a.judged_since)}.",
            )
        )
    out.extend(
        Line("failing", f"Failing: {c.label}", "; ".join(c.failures.reasons()) + ".")
        for c in a.candidates.values()
        if c.failing
    )
    runs = first_line(a.workflows, labels)
    if runs is not None:  # where calls form runs, the run's speed-up leads the verdicts
        out.append(Line("workflow", *runs))
    fixes: dict[str, list[str]] = {}
    for c in a.candidates.values():
        overall = c.overall
        if overall is not None and overall.decision == "not_load_matched" and overall.fix:
            fixes.setdefault(overall.fix, []).append(c.label)
    for fix, who in fixes.items():
        parity = [
            f"{c.label} {c.overall.at_load.parity_p50:.2f}×"
            for c in a.candidates.values()
            if c.label in who
            and c.overall is not None
            and c.overall.at_load is not None
            and c.overall.at_load.parity_p50 is not None
        ]
        ran = f" (load parity {', '.join(parity)})" if parity else ""
        out.append(
            Line(
                "fix",
                "Fix first: not load-matched",
                f"{', '.join(who)} ran off production's per-replica arrival rate{ran}, so no "
                f"verdict at production's load is possible yet. The fix: {fix}.",
            )
        )
    for c in a.candidates.values():
        v = c.overall
        if v is None:
            continue
        lead = v.reasons[0] if v.reasons else ""
        if v.decision == "candidate_failing":
            lead = v.reasons[1] if len(v.reasons) > 1 else "see its failures above"
        if v.decision == "rolled_back" and v.without_rollback is not None:
            said = DECISION_LABELS[v.without_rollback]
            evidence = "this window's evidence" if c.span is None else c.span.text()
            lead = f"without the rollback, {evidence} says: {said}"
        speed = _speed(v).removeprefix(" · ")
        if lead.startswith("e2e speed-up at production load"):  # the lead says it already
            speed = ""
        # Not adopted for all traffic yet shipped for a category: the head says which holds where.
        shipped = [k for k, r in a.recommendations.items() if k != ALL and r.backend == c.backend]
        where = (
            f" for all traffic (shipped for {', '.join(shipped)})"
            if shipped and v.decision != "adopt"
            else ""
        )
        out.append(
            Line(
                "verdict",
                f"{c.label}: {v.label}{where}",
                f"{speed}{'; ' if speed and lead else ''}{lead}. Rests on: {rests_on(a, c, v)}.",
            )
        )
    picks = {
        cat: labels[r.backend]
        for cat, r in a.recommendations.items()
        if r.backend is not None and r.backend in labels
    }
    if a.candidates:
        if picks:
            by: dict[str, list[str]] = {}
            for cat, label in picks.items():
                by.setdefault(label, []).append("all traffic" if cat == ALL else cat)
            text = "; ".join(f"{label} for {', '.join(cats)}" for label, cats in by.items())
        else:
            text = "nothing yet: no candidate passed the verdict for any category"
        thin = _thin(a, picks)
        if thin:
            text += "; not enough data for " + "; ".join(thin)
        out.append(Line("ship", "Ship", text))
    footing = a.counts.sentence() if a.counts is not None else None
    if footing is not None:
        out.append(Line("counts", "Token counts", footing.removeprefix("Token counts: ")))
    if a.window is not None and a.records:
        out.append(
            Line(
                "window",
                "Window",
                f"{a.records} exchanges from {_at(a.window[0])} to {_at(a.window[1])}",
            )
        )
    return out


def _thin(a: Analysis, picks: Mapping[str, str]) -> list[str]:
    """Each category without a pick that a candidate could still win with more data: the
    number behind its "not enough data" (its verdict's first reason), e.g. the load strata's
    coverage against the 90 % it needs."""
    out = []
    for cat in a.categories:
        if cat in picks:
            continue
        v = next(
            (
                v
                for c in a.candidates.values()
                for v in c.verdicts
                if v.category == cat and v.decision == "not_enough_data" and v.reasons
            ),
            None,
        )
        if v is not None:
            who = next(c.label for c in a.candidates.values() if v in c.verdicts)
            out.append(f"{cat} ({who}: {v.reasons[0]})")
    return out


def terminal(a: Analysis) -> list[str]:
    """The first screen as terminal lines (the same words as report.md's): rollbacks, failing
    candidates and the fix first."""
    return [f"{line.title}: {line.text}" for line in front(a) if line.kind != "window"]


# -- glosses ------------------------------------------------------------------------------------

# (pattern, term, gloss): the first block whose text matches gets the gloss after it.
GLOSSARY: tuple[tuple[str, str, str], ...] = (
    (
        r"(?i:\bload parity\b)",
        "load parity",
        "the candidate's per-replica arrival rate over production's at dispatch; 1 means it ran "
        "at production's load, and only pairs within ±25 % count.",
    ),
    (
        r"\bMAL\b|(?i:\bmean acceptance length\b)",
        "MAL (mean acceptance length)",
        "tokens one target pass emits when the proposer drafted — accepted drafts plus the one "
        "the target adds; 1 means no draft was accepted.",
    ),
    (
        r"\be-value\b",
        "e-value",
        "a guard's running evidence that its threshold is breached (1 = none); it rolls back "
        "once the e-value passes 1/α, valid however often it is checked (anytime-valid).",
    ),
    (
        r"\bschedule\b",
        "schedule",
        "the speculation schedule: num_speculative_tokens per batch size — how deep to draft at "
        "each load, 0 where speculation stops paying.",
    ),
    (
        r"\bMMD\b",
        "MMD",
        "maximum mean discrepancy: a kernel two-sample test of whether two sets of outputs come "
        "from the same distribution.",
    ),
    (
        r"\bTOST\b",
        "TOST",
        "two one-sided tests: equivalence is shown when a difference's 90 % interval lies inside "
        "its margin.",
    ),
    (
        r"\bHolm\b",
        "Holm",
        "Holm's correction: the p-values of several tests adjusted so that the chance of any "
        "false rejection stays at α.",
    ),
)


def first_use(
    blocks: Sequence[str],
    text_of: Callable[[str], str],
    gloss: Callable[[str, str], str],
    *,
    skip: Callable[[str], bool] = lambda _: False,
) -> list[str]:
    """``blocks`` with, after the first block whose text (``text_of``) names a glossary term, the
    ``gloss(term, meaning)`` block; blocks for which ``skip`` holds are never glossed."""
    first: dict[int, list[str]] = {}
    for pattern, term, meaning in GLOSSARY:
        rx = re.compile(pattern)
        for i, block in enumerate(blocks):
            if not skip(block) and rx.search(text_of(block)):
                first.setdefault(i, []).append(gloss(term, meaning))
                break
    out: list[str] = []
    for i, block in enumerate(blocks):
        out.append(block)
        out.extend(first.get(i, ()))
    return out
