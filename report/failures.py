"""Whether a candidate failed, as its legs and drops tell it (pure).

A candidate whose legs mostly fail is not slow, and not short of capacity: it is failing, and the
report says so before any load or speed analysis (``candidate_failing``). Per candidate, the
legs the gateway sent are counted by how they ended — could not connect, an HTTP error status,
a timeout, another error — beside the legs it never sent: dropped with the candidate's breaker
open (which only failures open), or for the shadow budget (in flight, requests per second:
shared by every shadow leg, so no fault of this one's).

**Failing** (:attr:`Failures.failing`): at least :data:`MIN_FAILED` legs, and more than half
(:data:`FAILING_SHARE`) of the attempted ones — sent, or dropped with the breaker open — failed
or were breaker-dropped. Legs the client's disconnect or the policy cancelled count neither way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from records.reader import Leg, Record

MIN_FAILED = 5
FAILING_SHARE = 0.5
BREAKER = "breaker_open"
BUDGET = frozenset({"budget", "rate"})  # the shadow budget's drops: in flight, requests/s
CONNECT = "UpstreamConnectError"
_NEUTRAL = frozenset({"client_disconnected", "cancelled"})
_TIMEOUT = frozenset({"upstream_timeout", "deadline"})


@dataclass(frozen=True, slots=True)
class FirstError:
    kind: str  # the error class (``UpstreamConnectError``), ``HTTP 503``, or the outcome
    started_unix_ns: int
    exchange_id: str

    def at(self) -> str:
        return datetime.fromtimestamp(self.started_unix_ns / 1e9, UTC).strftime(
            "%Y-%m-%d %H:%M:%S UTC"
        )

    def to_json(self) -> dict[str, Any]:
        return {"error": self.kind, "at": self.at(), "started_unix_ns": self.started_unix_ns,
                "exchange_id": self.exchange_id}  # fmt: skip


@dataclass(slots=True)
class Failures:
    """One candidate's legs and drops, counted apart by how they failed."""

    sent: int = 0  # legs the gateway sent (whatever their end)
    connect: int = 0  # could not connect (refused, unreachable)
    http: Counter[int] = field(default_factory=Counter)  # error status → legs
    timeout: int = 0  # connect or read timeout, or still running at the exchange deadline
    other: Counter[str] = field(default_factory=Counter)  # other errors by class
    breaker: int = 0  # not sent: the candidate's breaker was open
    budget: int = 0  # not sent: the shadow budget (in flight, requests per second)
    first: FirstError | None = None

    @property
    def failed(self) -> int:
        """Legs sent that failed."""
        return self.connect + sum(self.http.values()) + self.timeout + sum(self.other.values())

    @property
    def attempted(self) -> int:
        """Legs sent, plus those the breaker kept back (they would have been sent)."""
        return self.sent + self.breaker

    @property
    def failing(self) -> bool:
        bad = self.failed + self.breaker
        return bad >= MIN_FAILED and bad > FAILING_SHARE * self.attempted

    def counts(self) -> str:
        """``12 could not connect, 0 HTTP errors, …`` — every kind, zeros included."""
        http = sum(self.http.values())
        statuses = ", ".join(f"{n}× {s}" for s, n in sorted(self.http.items()))
        parts = [
            f"{self.connect} could not connect",
            f"{http} HTTP error{'s' if http != 1 else ''}" + (f" ({statuses})" if statuses else ""),
            f"{self.timeout} timed out",
        ]
        other = sum(self.other.values())
        if other:
            kinds = ", ".join(f"{n}× {k}" for k, n in self.other.most_common())
            parts.append(f"{other} other error{'s' if other != 1 else ''} ({kinds})")
        parts.append(f"{self.breaker} dropped with its breaker open")
        return ", ".join(parts)

    def reasons(self) -> list[str]:
        """The ``candidate_failing`` verdict's reasons: the counts and the first error."""
        bad = self.failed + self.breaker
        out = [
            f"{bad} of its {self.attempted} attempted legs failed or were dropped with its breaker "
            f"open (more than {FAILING_SHARE:.0%}): {self.counts()}"
        ]
        if self.first is not None:
            out.append(
                f"first error: {self.first.kind} at {self.first.at()} (exchange "
                f"{self.first.exchange_id})"
            )
        if self.budget:
            out.append(
                f"{self.budget} more legs dropped for the shared shadow budget, not counted "
                "against it"
            )
        out.append("fix the candidate's endpoint (URL, port, health) before judging its speed")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "attempted": self.attempted,
            "sent": self.sent,
            "failed": self.failed,
            "could_not_connect": self.connect,
            "http_errors": {str(s): n for s, n in sorted(self.http.items())},
            "timeouts": self.timeout,
            "other_errors": dict(self.other),
            "breaker_open_drops": self.breaker,
            "budget_drops": self.budget,
            "failing": self.failing,
            "first_error": self.first.to_json() if self.first is not None else None,
        }


def _kind(leg: Leg) -> str | None:
    """How ``leg`` failed (None: it did not, or not by the backend's doing)."""
    if leg.ok or leg.outcome in _NEUTRAL:
        return None
    if leg.error_type == CONNECT:
        return "connect"
    if leg.outcome in _TIMEOUT or leg.error_type == "UpstreamTimeout":
        return "timeout"
    status = leg.status
    if leg.outcome == "upstream_status" or (status is not None and status >= 400):
        return "http"
    return "other"


def failures(records: Sequence[Record], backend: str) -> Failures:
    """``backend``'s candidate legs and drops over ``records``, counted apart."""
    f = Failures()
    for r in sorted(records, key=lambda r: r.order_key):
        leg = r.candidate_leg(backend)
        if leg is not None and leg.outcome not in _NEUTRAL:
            f.sent += 1
            kind = _kind(leg)
            if kind == "connect":
                f.connect += 1
            elif kind == "timeout":
                f.timeout += 1
            elif kind == "http":
                f.http[leg.status or 0] += 1
            elif kind == "other":
                f.other[leg.error_type or leg.outcome or "unknown"] += 1
            if kind is not None and f.first is None:
                what = leg.error_type or (f"HTTP {leg.status}" if leg.status else leg.outcome)
                f.first = FirstError(str(what), r.started_unix_ns, r.exchange_id)
        for drop in r.sampling.dropped:
            if drop.backend != backend:
                continue
            if drop.reason == BREAKER:
                f.breaker += 1
            elif drop.reason in BUDGET:
                f.budget += 1
    return f
