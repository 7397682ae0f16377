"""Value objects of one exchange: a client request, its primary leg and any shadow legs.

An :class:`Exchange` is built when every leg has ended (or the exchange deadline passed) and is
handed to the :class:`ExchangeSink` — the single interface that comparison, records and telemetry
plug into. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NewType, Protocol

from gateway.timings import Recording, StreamOutcome
from policies.compiled import CaptureSpec

RequestId = NewType("RequestId", str)
ModelName = NewType("ModelName", str)

Role = Literal["primary", "candidate", "baseline"]
Route = Literal["chat", "completions"]
ROUTE_PATHS: dict[str, Route] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
OPERATION_NAMES: dict[Route, str] = {"chat": "chat", "completions": "text_completion"}


@dataclass(frozen=True, slots=True)
class LegResult:
    """One leg's outcome: which backend, what it answered, and the recorder's output."""

    role: Role
    backend: str  # backend name from the policy ("primary" for the --primary quick flag)
    server_address: str  # host:port of the upstream
    upstream_model: str | None  # the model name sent upstream (after any policy rewrite)
    status: int | None  # upstream HTTP status; None when no response arrived
    outcome: StreamOutcome
    error_type: str | None  # exception class or error code; None when fine
    recording: Recording | None  # None when no response bytes could be recorded
    started_unix_ns: int  # wall clock at t0 (for records and span start times)
    t0_ns: int  # perf_counter_ns at t0
    end_ns: int  # perf_counter_ns when the leg ended
    inflight_at_dispatch: int  # legs of the same role in flight when this one started


@dataclass(frozen=True, slots=True)
class Exchange:
    """A finished client request with every leg's result."""

    exchange_id: str
    request_id: RequestId
    route: Route
    requested_model: ModelName | None
    stream: bool
    started_unix_ns: int
    temperature: float | None
    seed: int | None
    category: str | None
    policy_generation: int | None
    policy_rule: str | None
    sampled: bool
    drop_reason: str | None  # why a sampled request was not mirrored (budget, rate, …)
    primary: LegResult
    shadows: tuple[LegResult, ...]
    request_body: bytes | None  # only when the policy allows capturing text
    # The parsed client payload, for off-hot-path classification and comparison (response_format,
    # tools, messages). In memory only: records keep text from it only as ``capture`` allows.
    request_json: Mapping[str, Any] | None = None
    # The deciding rule's capture setting; None: the record sink's default applies.
    capture: CaptureSpec | None = None
    # W3C traceparent of the request's SERVER span: comparison spans made later (off the event
    # loop, after the request span ended) join the same trace.
    traceparent: str | None = None

    @property
    def legs(self) -> tuple[LegResult, ...]:
        return (self.primary, *self.shadows)


class ExchangeSink(Protocol):
    """Receives finished exchanges. ``submit`` must not block or raise."""

    def submit(self, exchange: Exchange) -> None: ...
