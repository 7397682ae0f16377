"""What a rollout did, as the comparison records tell it (pure): each rule's stages in time order,
with how many answers came from the candidate and how many failed over to the primary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from records.reader import Record


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive exchanges of one rule in one rollout stage."""

    rule: str
    stage: str
    first_unix_ns: int
    last_unix_ns: int
    exchanges: int
    served_by_candidate: int
    failovers: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def timeline(records: Sequence[Record]) -> list[Segment]:
    """Each rule's stages in time order, from the records' ``rollout`` blocks: a canary that
    ends in ``shadow`` is a rollback (the transition itself is in ``/admin/rollout``)."""
    by_rule: dict[str, list[Record]] = {}
    for r in records:
        rule = r.policy_rule
        if r.rollout_stage is not None and rule is not None:
            by_rule.setdefault(rule, []).append(r)
    out: list[Segment] = []
    for rule, rs in by_rule.items():
        rs.sort(key=lambda r: r.started_unix_ns)
        runs: list[list[Record]] = []
        for r in rs:
            if runs and runs[-1][0].rollout_stage == r.rollout_stage:
                runs[-1].append(r)
            else:
                runs.append([r])
        out += [
            Segment(
                rule=rule,
                stage=str(run[0].rollout_stage),
                first_unix_ns=run[0].started_unix_ns,
                last_unix_ns=run[-1].started_unix_ns,
                exchanges=len(run),
                served_by_candidate=sum(1 for x in run if x.served_by == "candidate"),
                failovers=sum(1 for x in run if x.rollout_failover),
            )
            for run in runs
        ]
    return out
