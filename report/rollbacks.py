"""Which candidates a rollout rolled back inside the report's window, and why (pure).

Two sources, merged per rule:

- **The records.** Each exchange of a rolling-out rule carries its stage (``rollout.stage``); a
  rule whose records go from ``canary`` or ``live`` to ``shadow`` was rolled back, at about the
  first ``shadow`` exchange. The records name the rule's candidates (``sampling.candidates``,
  its candidate legs) but not who rolled it back or why.
- **The rollout transitions** (the gateway's state file, ``--state``, whose ``rules.<name>.last``
  is each rule's last transition; or ``GET /admin/rollout``'s ``last_transition``): the exact
  time, the actor (``guard``, ``operator``, ``policy``), the guard's name and its reading —
  ``guard tpot_p99_ratio: 2.41 against 1.5, e-value …`` — from which the observed value and the
  threshold are read back. A transition counts when its exchange is one of the window's, or its
  time lies inside the window (up to :data:`SLACK_S` after its last exchange started: a guard
  judges an exchange when it has ended).

A candidate rolled back in the window is not adopted for that window: the report's verdict for
it is ``rolled_back`` (:mod:`report.analysis`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core import jsonx
from records.reader import Record

SLACK_S = 120.0
_ACTIVE = frozenset({"canary", "live"})
# rollout.controller's breach text, read by guard name and nothing else guard-specific:
# "guard <name>: <value> against <threshold>, …", "guard kv_usage: <value> sustained at or above
# <threshold>", and a guard that compares with a reference level rather than a threshold
# ("guard acceptance_drop: 1.9 against reference 3.3, …", "guard speculation_off: mean
# acceptance length 1.0 against reference 2.5 …"): words may name the value before it, a unit
# may follow it, and "reference" (or "threshold") may name what it is held against.
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_BREACH = re.compile(
    rf"guard (?P<guard>[\w.]+): (?:[A-Za-z_/]+\s+)*?(?P<observed>{_NUM}|\?)"
    r"(?:\s+[^\s,;()]+){0,3}?\s+(?:against|sustained at or above)\s+(?:(?:its|the)\s+)?"
    rf"(?:(?P<label>reference|threshold)(?:\s+level)?:?\s+)?(?P<threshold>{_NUM})"
)
_GUARD = re.compile(r"guard (?P<guard>[\w.]+)")


@dataclass(frozen=True, slots=True)
class Rollback:
    rule: str
    backends: tuple[str, ...]  # the candidates the rule rolled out
    at_unix_ns: int
    from_stage: str
    by: str | None = None  # guard, operator, policy; None: only the records tell it
    guard: str | None = None
    observed: float | None = None
    threshold: float | None = None
    reason: str | None = None  # the transition's own words
    exchange_id: str | None = None
    against: str = "threshold"  # what ``threshold`` is: a ``threshold`` or a ``reference`` level
    to_stage: str = "shadow"  # a rollback goes to shadow; a guard breach may go elsewhere

    @property
    def rollback(self) -> bool:
        return self.to_stage == "shadow"

    def at(self) -> str:
        return datetime.fromtimestamp(self.at_unix_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    def text(self) -> str:
        """``rolled back at <time> by guard <name>: observed <v> against threshold <t>`` (or
        ``against reference <t>``; a breach that did not go to shadow: ``breached at …``)."""
        head = f"rolled back at {self.at()}" if self.rollback else f"breached at {self.at()}"
        move = f"{self.from_stage} → {self.to_stage}"
        if self.by is None:
            return (
                f"{head} (rule {self.rule}: its exchanges went from {self.from_stage} to shadow; "
                "which guard or operator did it is in the gateway's rollout state, "
                "GET /admin/rollout)"
            )
        if self.guard is not None and self.observed is not None and self.threshold is not None:
            return (
                f"{head} by guard {self.guard}: observed {self.observed:g} against "
                f"{self.against} {self.threshold:g} (rule {self.rule}, {move})"
            )
        who = f"guard {self.guard}" if self.guard else str(self.by)
        why = f": {self.reason}" if self.reason else ""
        return f"{head} by {who}{why} (rule {self.rule}, {move})"

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "backends": list(self.backends),
            "at": self.at(),
            "at_unix_ns": self.at_unix_ns,
            "from_stage": self.from_stage,
            "by": self.by,
            "guard": self.guard,
            "observed": self.observed,
            "threshold": self.threshold,
            "against": self.against,
            "to_stage": self.to_stage,
            "reason": self.reason,
            "exchange_id": self.exchange_id,
            "text": self.text(),
        }


def load_transitions(path: str | Path) -> list[dict[str, Any]]:
    """The transitions a gateway's rollout state file holds (each rule's last one); a missing or
    unreadable file holds none."""
    try:
        data = jsonx.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return []
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, dict):
        return []
    return [
        s["last"] for s in rules.values() if isinstance(s, dict) and isinstance(s.get("last"), dict)
    ]


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _rule_backends(records: Iterable[Record]) -> tuple[str, ...]:
    """The candidate a rule rolled out: the one that answered its canary exchanges; else the
    candidates the rule names (``sampling.candidates``); else every candidate leg it mirrored."""
    answered: dict[str, None] = {}
    named: dict[str, None] = {}
    mirrored: dict[str, None] = {}
    for r in records:
        if r.served_by == "candidate" and (leg := r.candidate_leg(None)) is not None:
            answered[leg.backend] = None
        named.update(dict.fromkeys(r.sampling.candidates))
        mirrored.update(dict.fromkeys(r.named_candidates()))
    return tuple(answered or named or mirrored)


def _from_records(records: Sequence[Record]) -> list[Rollback]:
    by_rule: dict[str, list[Record]] = {}
    for r in records:
        if r.rollout_stage is not None and r.policy_rule is not None:
            by_rule.setdefault(r.policy_rule, []).append(r)
    out = []
    for rule, rs in by_rule.items():
        rs.sort(key=lambda r: r.order_key)
        for before, after in itertools.pairwise(rs):
            if before.rollout_stage in _ACTIVE and after.rollout_stage == "shadow":
                out.append(
                    Rollback(rule, _rule_backends(rs), after.started_unix_ns,
                             str(before.rollout_stage))
                )  # fmt: skip
    return out


def rollbacks(
    records: Sequence[Record], transitions: Iterable[Mapping[str, Any]] = ()
) -> list[Rollback]:
    """Every rollback inside the window of ``records`` (see the module doc), in time order."""
    if not records:
        return []
    found = _from_records(records)
    first = min(r.started_unix_ns for r in records)
    last = max(r.started_unix_ns for r in records) + int(SLACK_S * 1e9)
    ids = {r.exchange_id for r in records}
    for t in transitions:
        if t.get("to_stage") != "shadow" or t.get("from_stage") not in _ACTIVE:
            continue
        at = _float(str(t.get("at_unix")))
        rule = str(t.get("rule") or "")
        if at is None or not rule:
            continue
        at_ns = int(at * 1e9)
        if t.get("exchange_id") not in ids and not first <= at_ns <= last:
            continue
        same = [x for x in found if x.rule == rule]
        nearest = min(same, key=lambda x: abs(x.at_unix_ns - at_ns), default=None)
        if nearest is not None:
            # The transition replaces the records' approximation of the same rollback.
            found.remove(nearest)
        if t.get("by") == "policy":  # a policy edit put the rule back in shadow: no rollback
            continue
        rule_records = [r for r in records if r.policy_rule == rule]
        backends = nearest.backends if nearest is not None else _rule_backends(rule_records)
        found.append(_read(t, rule, backends, at_ns))
    return sorted(found, key=lambda x: x.at_unix_ns)


def _read(t: Mapping[str, Any], rule: str, backends: tuple[str, ...], at_ns: int) -> Rollback:
    """One transition, its guard's reading parsed from its words by guard name."""
    reason = t.get("reason")
    m = _BREACH.search(reason) if isinstance(reason, str) else None
    named = _GUARD.search(reason) if isinstance(reason, str) else None
    match = m or named
    guard = t.get("guard") or (match.group("guard") if match is not None else None)
    return Rollback(
        rule=rule,
        backends=backends,
        at_unix_ns=at_ns,
        from_stage=str(t.get("from_stage")),
        by=str(t.get("by")) if t.get("by") else None,
        guard=str(guard) if guard else None,
        observed=_float(m.group("observed")) if m else None,
        threshold=_float(m.group("threshold")) if m else None,
        reason=reason if isinstance(reason, str) else None,
        exchange_id=str(t["exchange_id"]) if t.get("exchange_id") else None,
        against=(m.group("label") or "threshold") if m else "threshold",
        to_stage=str(t.get("to_stage") or "shadow"),
    )


def guard_breaches(
    records: Sequence[Record], transitions: Iterable[Mapping[str, Any]] = ()
) -> list[Rollback]:
    """The guard breaches inside the window that did **not** roll back to shadow — a drift guard
    (``acceptance_drop``, ``speculation_off``) sending a live rule back to its first canary step
    (``rollout.on_drift: canary``) — with the guard's reading, parsed by guard name as for a
    rollback. Rollbacks to shadow are :func:`rollbacks`'."""
    if not records:
        return []
    first = min(r.started_unix_ns for r in records)
    last = max(r.started_unix_ns for r in records) + int(SLACK_S * 1e9)
    ids = {r.exchange_id for r in records}
    out = []
    for t in transitions:
        if t.get("by") != "guard" or t.get("to_stage") in (None, "shadow"):
            continue
        at = _float(str(t.get("at_unix")))
        rule = str(t.get("rule") or "")
        if at is None or not rule:
            continue
        at_ns = int(at * 1e9)
        if t.get("exchange_id") not in ids and not first <= at_ns <= last:
            continue
        out.append(
            _read(t, rule, _rule_backends(r for r in records if r.policy_rule == rule), at_ns)
        )
    return sorted(out, key=lambda x: x.at_unix_ns)


def by_backend(found: Sequence[Rollback]) -> dict[str, Rollback]:
    """Each rolled-back candidate's last rollback in the window."""
    out: dict[str, Rollback] = {}
    for rb in found:
        for b in rb.backends:
            out[b] = rb
    return out
