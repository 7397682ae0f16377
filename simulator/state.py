"""Ground truth: what the simulator answered to each request, and when it wrote each event.

Keyed by the request's ``x-request-id`` header (or a generated id), bounded to the last
``SimConfig.max_records`` requests. Tests read :attr:`SimState.requests` in process, or
``GET /sim/requests?id=…`` out of process (same fields, via :meth:`RequestRecord.to_json`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from simulator.plan import Plan

# "other": a Responses API event that carries no output (created, item and part boundaries).
EventKindSent = Literal["role", "output", "usage", "done", "malformed", "other"]
RecordOutcome = Literal[
    "running", "completed", "client_disconnected", "error_status", "hung", "dropped", "rejected"
]


@dataclass(frozen=True, slots=True)
class SentEvent:
    """One SSE event as written: its kind, the tokens it carried, ``perf_counter_ns`` just before
    the write (the same value as its ``: sent_ns=`` comment line)."""

    kind: EventKindSent
    sent_ns: int
    tokens: int


@dataclass(slots=True)
class RequestRecord:
    """One request's ground truth. Plan fields are fixed at arrival; timings fill in as it runs."""

    request_id: str
    route: str
    model: str
    stream: bool
    category: str
    mode: str
    kind: str  # "text" | "json" | "tool_call"
    tokens: tuple[str, ...]
    finish_reason: str
    prompt_tokens: int
    prompt_hash: str
    per_step_drafted: tuple[int, ...]  # step 0 is the prefill (never drafts)
    per_step_accepted: tuple[int, ...]
    faults: str  # the effective fault spec ("" when none)
    arrival_ns: int
    status: int = 200
    outcome: RecordOutcome = "running"
    started_ns: int | None = None  # left the queue
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    finished_ns: int | None = None
    step_ns: list[int] = field(default_factory=list)  # when each step's tokens were emitted
    # What the cost model charged each of those steps (seconds): the engine step's duration,
    # prefill included; the wall gaps between ``step_ns`` follow it on an idle host.
    step_cost_s: list[float] = field(default_factory=list)
    events: list[SentEvent] = field(default_factory=list)
    sampling: dict[str, Any] | None = None  # a sampled answer's parameters (SampledWith)

    @classmethod
    def from_plan(
        cls,
        *,
        request_id: str,
        route: str,
        model: str,
        stream: bool,
        plan: Plan,
        faults: str,
        arrival_ns: int,
    ) -> RequestRecord:
        return cls(
            request_id=request_id,
            route=route,
            model=model,
            stream=stream,
            category=plan.category,
            mode=plan.mode,
            kind=plan.kind,
            tokens=plan.tokens,
            finish_reason=plan.finish_reason,
            prompt_tokens=plan.prompt_tokens,
            prompt_hash=plan.prompt_hash,
            per_step_drafted=tuple(s.drafted for s in plan.steps),
            per_step_accepted=tuple(s.accepted for s in plan.steps),
            faults=faults,
            arrival_ns=arrival_ns,
            sampling=plan.sampling.to_json() if plan.sampling is not None else None,
        )

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return sum(1 for d in self.per_step_drafted if d)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.per_step_drafted)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.per_step_accepted)

    @property
    def sent_ns(self) -> list[int]:
        return [e.sent_ns for e in self.events]

    def to_json(self) -> dict[str, Any]:
        out = {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "category": self.category,
            "mode": self.mode,
            "kind": self.kind,
            "tokens": list(self.tokens),
            "text": self.text,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "prompt_hash": self.prompt_hash,
            "per_step_drafted": list(self.per_step_drafted),
            "per_step_accepted": list(self.per_step_accepted),
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "faults": self.faults,
            "status": self.status,
            "outcome": self.outcome,
            "arrival_ns": self.arrival_ns,
            "started_ns": self.started_ns,
            "first_token_ns": self.first_token_ns,
            "last_token_ns": self.last_token_ns,
            "finished_ns": self.finished_ns,
            "step_ns": list(self.step_ns),
            "step_cost_s": list(self.step_cost_s),
            "events": [
                {"kind": e.kind, "sent_ns": e.sent_ns, "tokens": e.tokens} for e in self.events
            ],
        }
        if self.sampling is not None:  # only on a sampling server: other records are unchanged
            out["sampling"] = self.sampling
        return out


class SimState:
    """Everything a simulated server remembers; one per app."""

    def __init__(self, max_records: int, max_num_seqs: int) -> None:
        self.requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self.max_records = max_records
        self.slots = asyncio.Semaphore(max_num_seqs)
        self.closing = asyncio.Event()  # set at shutdown: hung handlers return
        self.received = 0  # requests that reached a completions handler, valid or not

    def add(self, record: RequestRecord) -> None:
        self.requests.pop(record.request_id, None)
        self.requests[record.request_id] = record
        while len(self.requests) > self.max_records:
            self.requests.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self.requests.get(request_id)
