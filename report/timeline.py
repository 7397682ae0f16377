"""What a rollout did, as the comparison records tell it (pure): each rule's stages in time order,
with how many answers came from the candidate and how many failed over to the primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from report.records import Record


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
        block, policy = r.get("rollout"), r.get("policy") or {}
        if isinstance(block, Mapping) and isinstance(policy.get("rule"), str):
            by_rule.setdefault(policy["rule"], []).append(r)
    out: list[Segment] = []
    for rule, rs in by_rule.items():
        rs.sort(key=lambda r: int(r.get("started_unix_ns") or 0))
        runs: list[list[Record]] = []
        for r in rs:
            if runs and runs[-1][0]["rollout"]["stage"] == r["rollout"]["stage"]:
                runs[-1].append(r)
            else:
                runs.append([r])
        out += [
            Segment(
                rule=rule,
                stage=str(run[0]["rollout"]["stage"]),
                first_unix_ns=int(run[0].get("started_unix_ns") or 0),
                last_unix_ns=int(run[-1].get("started_unix_ns") or 0),
                exchanges=len(run),
                served_by_candidate=sum(1 for x in run if x.get("served_by") == "candidate"),
                failovers=sum(1 for x in run if x["rollout"].get("failover")),
            )
            for run in runs
        ]
    return out
