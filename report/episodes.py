"""The window split at rollbacks: a rolled-back rollout episode's legs describe a deploy the
guards rejected, so they never make a load figure, a verdict or a pick (pure).

A rollout episode is what the guards judge (:mod:`rollout.controller`): a changed rollout block,
an operator's promotion or a re-qualification starts a new one; a rollback does **not** — the
rule stays rolled back, sticky, in the same episode, until one of those starts the next. Each
exchange of a rolling-out rule carries the episode it was dispatched in (``rollout.episode``),
so the report can split the window as the guards do.

For every rollback inside the window (:mod:`report.rollbacks`), :func:`rolled_back_episodes`
finds the episode it ended: from the first exchange dispatched in it (the rule's last ``canary``
or ``live`` exchange before the rollback names it) to the first exchange of the rule's next
episode, or the end of the window. Records written before the field, without episodes, give the
same span from the stages alone: the run of ``canary``/``live`` exchanges before the rollback
starts it, the rule's next ``canary``/``live`` exchange after it ends it.

The split is per candidate: a rolled-back candidate's legs inside such a span — every one of
them, whichever rule mirrored it, since the same deploy answered them all — are left out, and
its crossover, speculation schedule and verdicts come from its **latest span outside the
rolled-back episodes** (:func:`judged_span`): before the episode when the rule is still rolled
back at the end of the window (what its shadow evidence said before the rollout), the episode
after it when a new one started. A candidate no rollback touched is judged on the whole window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from records.reader import Record
from report.rollbacks import Rollback

__all__ = ["Episode", "Span", "judged_span", "rolled_back_episodes"]

_ACTIVE = frozenset({"canary", "live"})


def _at(unix_ns: int) -> str:
    return datetime.fromtimestamp(unix_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True, slots=True)
class Episode:
    """One rollout episode that ended in a rollback: ``[start, end)`` in exchange start times
    (``end`` None: it lasts to the end of the window)."""

    rollback: Rollback
    episode: str | None  # the records' episode id; None: records without the field
    start_unix_ns: int
    end_unix_ns: int | None

    @property
    def backends(self) -> tuple[str, ...]:
        return self.rollback.backends

    def holds(self, unix_ns: int) -> bool:
        return self.start_unix_ns <= unix_ns and (
            self.end_unix_ns is None or unix_ns < self.end_unix_ns
        )

    def text(self) -> str:
        until = "" if self.end_unix_ns is None else f", ended {_at(self.end_unix_ns)}"
        return (
            f"rule {self.rollback.rule}'s rollout episode (from {_at(self.start_unix_ns)}, "
            f"rolled back at {self.rollback.at()}{until})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rollback.rule,
            "backends": list(self.backends),
            "episode": self.episode,
            "start_unix_ns": self.start_unix_ns,
            "end_unix_ns": self.end_unix_ns,
            "rolled_back_at_unix_ns": self.rollback.at_unix_ns,
        }


@dataclass(frozen=True, slots=True)
class Span:
    """The part of the window a rolled-back candidate is judged on: ``[start, end)`` (None: the
    window's own bound), and the episodes left out."""

    start_unix_ns: int | None
    end_unix_ns: int | None
    left_out: tuple[Episode, ...]

    def holds(self, unix_ns: int) -> bool:
        return (self.start_unix_ns is None or self.start_unix_ns <= unix_ns) and (
            self.end_unix_ns is None or unix_ns < self.end_unix_ns
        )

    def text(self) -> str:
        """``the evidence before rule X's rollout episode …`` — what the verdict rests on."""
        last = self.left_out[-1]
        if self.end_unix_ns is not None and self.start_unix_ns is None:
            return f"the evidence before {last.text()}"
        if self.end_unix_ns is None and self.start_unix_ns is not None:
            return f"the evidence since {_at(self.start_unix_ns)}, after {last.text()}"
        return f"the evidence between the rolled-back episodes ({last.text()})"

    def to_json(self) -> dict[str, Any]:
        return {
            "start_unix_ns": self.start_unix_ns,
            "end_unix_ns": self.end_unix_ns,
            "left_out": [e.to_json() for e in self.left_out],
            "text": self.text(),
        }


def _episode(rule_records: Sequence[Record], rb: Rollback) -> Episode:
    before = [r for r in rule_records if r.started_unix_ns < rb.at_unix_ns]
    after = [r for r in rule_records if r.started_unix_ns >= rb.at_unix_ns]
    last = next((r for r in reversed(before) if r.rollout_stage in _ACTIVE), None)
    if last is None:  # only the transition tells it: nothing of the episode is in the records
        return Episode(rb, None, rb.at_unix_ns, _next_active(after, None))
    episode = last.rollout_episode
    if episode is not None:
        start = next(r.started_unix_ns for r in before if r.rollout_episode == episode)
    else:
        start = last.started_unix_ns
        for r in reversed(before):
            if r.started_unix_ns > last.started_unix_ns:
                continue
            if r.rollout_stage not in _ACTIVE:
                break
            start = r.started_unix_ns
    return Episode(rb, episode, start, _next_active(after, episode))


def _next_active(after: Sequence[Record], episode: str | None) -> int | None:
    """The start of the rule's next episode: its first exchange of another episode (or, without
    episodes, its next ``canary``/``live`` exchange)."""
    for r in after:
        if episode is not None and r.rollout_episode is not None:
            if r.rollout_episode != episode:
                return r.started_unix_ns
        elif r.rollout_stage in _ACTIVE:
            return r.started_unix_ns
    return None


def rolled_back_episodes(records: Sequence[Record], found: Sequence[Rollback]) -> list[Episode]:
    """The episode each rollback in ``found`` ended (see the module doc), in time order."""
    by_rule: dict[str, list[Record]] = {}
    for r in records:
        if r.policy_rule is not None and r.rollout_stage is not None:
            by_rule.setdefault(r.policy_rule, []).append(r)
    for rs in by_rule.values():
        rs.sort(key=lambda r: r.order_key)
    out = [_episode(by_rule.get(rb.rule, []), rb) for rb in found]
    return sorted(out, key=lambda e: e.start_unix_ns)


def judged_span(
    records: Sequence[Record], backend: str, episodes: Sequence[Episode]
) -> tuple[list[Record], Span | None]:
    """The records ``backend`` is judged on: its latest span outside the rolled-back episodes of
    its rollouts (the module doc), and that span; ``records`` and None when none touches it."""
    mine = sorted((e for e in episodes if backend in e.backends), key=lambda e: e.start_unix_ns)
    if not mine:
        return list(records), None
    # The gaps between the episodes, latest first; the first one that holds an exchange.
    bounds: list[tuple[int | None, int | None]] = []
    cursor: int | None = None
    for e in mine:
        bounds.append((cursor, e.start_unix_ns))
        if e.end_unix_ns is None:
            cursor = None
            break
        cursor = max(cursor or e.end_unix_ns, e.end_unix_ns)
    else:
        bounds.append((cursor, None))
    for start, end in reversed(bounds):
        span = Span(start, end, tuple(mine))
        kept = [r for r in records if span.holds(r.started_unix_ns)]
        if kept and not any(e.holds(r.started_unix_ns) for r in kept for e in mine):
            return kept, span
    first = bounds[0]
    return [], Span(first[0], first[1], tuple(mine))
