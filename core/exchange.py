"""The exchange vocabulary: a client request, its primary leg and any shadow legs, as values.

An :class:`Exchange` is built when every leg has ended (or the exchange deadline passed) and is
handed to an :class:`ExchangeSink` — the one interface that evidence, records and telemetry plug
into. :class:`ExchangeDraft` is what is known of an exchange while its legs are still running.
The role and route literals, and what text may be captured (:class:`CaptureSpec`), are defined
here once for every package. Nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, Protocol

from core import jsonx
from core.ids import new_id
from core.timings import Recording, StreamOutcome
from core.wire import CATEGORY_HEADER, TRACEPARENT_HEADER, trace_id_of

RequestId = NewType("RequestId", str)
ModelName = NewType("ModelName", str)

Role = Literal["primary", "candidate", "baseline"]
ShadowRole = Literal["candidate", "baseline"]
Route = Literal["chat", "completions", "responses"]
ROUTE_PATHS: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
# gen_ai.operation.name per route; the Responses API generates a chat turn.
OPERATION_NAMES: dict[Route, str] = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
}

# What request/response text may leave the process: ``off`` (hashes and lengths only, the
# default), ``hashes`` (the same, said explicitly), ``redacted`` (masked) or ``full``.
CaptureText = Literal["off", "hashes", "redacted", "full"]


@dataclass(frozen=True, slots=True)
class CaptureSpec:
    """What text may be captured; ``redact`` names the classes ``redacted`` masks."""

    text: CaptureText
    redact: frozenset[str]


CAPTURE_OFF = CaptureSpec(text="off", redact=frozenset({"emails", "secrets"}))

RUN_KEY_CHARS = 200
"""The longest session id or workflow type a record keeps (a header value is client input)."""


# How a speculative engine verifies drafts: ``lossless`` (the output distribution is the target
# model's: standard rejection sampling, block verification, greedy exact match) or ``lossy``
# (drafts may be accepted that the target would not have produced: vLLM's synthetic acceptance,
# SGLang's relaxed thresholds, typical acceptance, TensorRT-LLM's relaxed thinking acceptance).
Verification = Literal["lossless", "lossy"]


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """A backend's speculative decoding, as the policy declares it (any field may be unknown).

    ``method``: the proposer (``ngram``, ``draft_model``, ``eagle3``, ``mtp``, …);
    ``num_speculative_tokens``: the draft depth k (0: speculation off); ``label``: how reports
    name this candidate; ``verification``: see :data:`Verification`; ``prompt_lookup_min`` /
    ``prompt_lookup_max``: an n-gram proposer's lookup window; ``cross_vocabulary``: the drafter
    has its own tokenizer (vLLM's ``use_heterogeneous_vocab``).
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    label: str | None = None
    verification: Verification | None = None
    prompt_lookup_min: int | None = None  # n-gram proposers: the lookup window
    prompt_lookup_max: int | None = None
    cross_vocabulary: bool | None = None


@dataclass(frozen=True, slots=True)
class LegLoad:
    """The load a leg's backend was under when the leg was dispatched, as the gateway saw it.

    ``in_flight``: this gateway's legs in flight to the backend, this one included;
    ``rate_rps``: this gateway's dispatches to it per second over the last ``window_s``;
    ``replicas``: servers behind its URL (the policy's declaration), so per-replica values are
    these divided by it.
    """

    in_flight: int
    rate_rps: float
    window_s: float
    replicas: int = 1

    @property
    def per_replica_rate_rps(self) -> float:
        return self.rate_rps / self.replicas

    @property
    def per_replica_in_flight(self) -> float:
        return self.in_flight / self.replicas


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
    inflight_at_dispatch: int  # legs in flight to this backend when this one started (one book)
    load: LegLoad | None = None  # the backend's load at dispatch; None: never dispatched
    share: float | None = None  # shadow legs: the share of the rule's requests this leg gets
    speculative: SpeculativeSpec | None = None  # the backend's declared speculation, if any
    # Legs in flight to this backend, time-averaged over this leg's decode interval (first to
    # last output event; this leg included): the batch it decoded in, as the gateway's book saw
    # it (gateway.load). None: no decode interval, or it predates the book's history.
    decode_in_flight: float | None = None


@dataclass(frozen=True, slots=True)
class Recount:
    """Output token counts of one exchange's legs from one tokenizer, fetched after it ended
    (evidence.counts): ``counts`` lines up with ``Exchange.legs`` (None: that leg had no output
    to count); ``source`` names the backend whose ``/tokenize`` counted them."""

    source: str
    counts: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Token ids of one exchange for counterfactual scoring, fetched after it ended.

    ``prompt``: the prompt as the target's tokenizer and chat template make it; ``output``: the
    output of the leg in role ``leg`` (production's: the primary); ``drafters``: per drafter
    backend, its greedy (teacher-forced) prediction of each output token; ``source``: who
    tokenized the prompt (``tokenize:<backend>``); ``output_source``: where the output ids came
    from — ``engine`` (the leg's own generated ids), ``leg:<backend>`` (the generated ids of a
    shadow leg that answered the same text), or ``source`` (re-tokenized text); ``legs``: the
    generated ids of every leg that sent them, by backend (the engine check of live candidates);
    ``drafter_confidence``: per drafter backend, the probability it gave its own prediction of
    each output token (the rank-1 logprob, exponentiated: confidence-threshold rules).
    """

    source: str
    leg: Role
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    drafters: Mapping[str, tuple[int, ...]]
    output_source: str = ""
    legs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    drafter_confidence: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LegLikelihood:
    """One leg's output scored under the target: the mean log-probability of its output tokens
    (nats per token), how many, and where its ids came from — ``engine`` (the leg's own
    generated ids) or ``tokenize`` (its text re-tokenized by the scorer)."""

    mean_logprob: float
    tokens: int
    source: Literal["engine", "tokenize"]


@dataclass(frozen=True, slots=True)
class Likelihood:
    """Target-likelihood scores of an exchange's shadow legs, fetched after it ended:
    ``scorer`` (the backend that scored them), ``legs`` by backend."""

    scorer: str
    legs: Mapping[str, LegLikelihood]


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
    # The parsed client payload, for off-hot-path classification, comparison and (where the
    # capture setting allows) prompt text. In memory only: records and spans keep text from it
    # only as ``capture`` allows.
    request_json: Mapping[str, Any] | None = None
    # The deciding rule's capture setting; None: the consumer's default applies.
    capture: CaptureSpec | None = None
    # W3C traceparent of the request's SERVER span: spans made later (off the event loop, after
    # the request span ended) join the same trace.
    traceparent: str | None = None
    sweep_step: int | None = None  # the deciding rule's sweep step; None: no sweep
    # Shadow legs the policy chose but admission refused: (backend, role, reason) each.
    dropped: tuple[tuple[str, str, str], ...] = ()
    # The deciding rule's candidate backends, mirrored this time or not.
    candidates: tuple[str, ...] = ()
    # Rollouts: the role of the leg that answered the client (``primary`` is the leg in
    # ``primary``, which is the *served* leg — a candidate in canary or live); the rule's
    # rollout stage when it was decided; and why a candidate that should have answered did not
    # (it failed before its first byte, so the primary answered).
    served_by: Role = "primary"
    rollout_stage: str | None = None
    failover: str | None = None
    # The rule's rollout episode when the request was dispatched: the guards judge an episode on
    # exchanges dispatched within it, never on legs of an earlier one that land after a change.
    rollout_episode: str | None = None
    # Counterfactual scoring: token ids added off the request path (evidence.tokens), or None.
    tokens: TokenIds | None = None
    # Target-likelihood scores of the shadow legs, added off the request path
    # (evidence.likelihood), or None.
    likelihood: Likelihood | None = None
    # Output token counts by the engine's tokenizer, added off the request path when a leg's
    # response carried no usage (evidence.counts), or None.
    recount: Recount | None = None
    # The application run this call belongs to: the trace id of the client's own ``traceparent``
    # (never one the gateway minted), the value of the policy's session header, and the
    # workflow type header's value (the report groups calls into runs and runs into types).
    trace_id: str | None = None
    session: str | None = None
    workflow: str | None = None

    @property
    def legs(self) -> tuple[LegResult, ...]:
        return (self.primary, *self.shadows)


class ExchangeSink(Protocol):
    """Receives finished exchanges. ``submit`` runs on the event loop: it must not block or raise."""

    def submit(self, exchange: Exchange) -> None: ...


class ManagedSink(ExchangeSink, Protocol):
    """A sink with a lifecycle: started before the first request, stopped after the last one."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def managed(sink: ExchangeSink) -> ManagedSink | None:
    """``sink`` as a :class:`ManagedSink` when it has ``start`` and ``stop``, else None."""
    start, stop = getattr(sink, "start", None), getattr(sink, "stop", None)
    return sink if callable(start) and callable(stop) else None  # type: ignore[return-value]


class ExchangeDraft:
    """What is known about an exchange before its legs end; :meth:`build` makes the Exchange."""

    __slots__ = (
        "candidates",
        "capture",
        "category",
        "drop_reason",
        "dropped",
        "exchange_id",
        "failover",
        "policy_generation",
        "policy_rule",
        "request_id",
        "request_json",
        "requested_model",
        "rollout_episode",
        "rollout_stage",
        "route",
        "sampled",
        "seed",
        "served_by",
        "session",
        "started_unix_ns",
        "stream",
        "sweep_step",
        "temperature",
        "trace_id",
        "traceparent",
        "workflow",
    )

    def __init__(
        self,
        *,
        request_id: RequestId,
        route: Route,
        requested_model: ModelName | None,
        stream: bool,
        temperature: float | None,
        seed: int | None,
        category: str | None,
        request_json: Mapping[str, Any] | None = None,
    ) -> None:
        self.exchange_id = new_id()
        self.request_id = request_id
        self.route = route
        self.requested_model = requested_model
        self.stream = stream
        self.started_unix_ns = time.time_ns()
        self.temperature = temperature
        self.seed = seed
        self.category = category
        self.request_json = request_json
        self.policy_generation: int | None = None
        self.policy_rule: str | None = None
        self.sampled = False
        self.drop_reason: str | None = None
        self.dropped: tuple[tuple[str, str, str], ...] = ()
        self.candidates: tuple[str, ...] = ()
        self.capture: CaptureSpec | None = None
        self.traceparent: str | None = None
        self.sweep_step: int | None = None
        self.served_by: Role = "primary"
        self.rollout_stage: str | None = None
        self.rollout_episode: str | None = None
        self.failover: str | None = None
        self.trace_id: str | None = None
        self.session: str | None = None
        self.workflow: str | None = None

    @classmethod
    def from_payload(
        cls,
        payload: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        route: Route,
        request_id: str,
    ) -> ExchangeDraft:
        """The draft of a client request: its JSON ``payload`` and (case-insensitive) ``headers``."""
        model = payload.get("model")
        seed = payload.get("seed")
        return cls(
            request_id=RequestId(request_id),
            route=route,
            requested_model=ModelName(model) if isinstance(model, str) else None,
            stream=payload.get("stream") is True,
            temperature=jsonx.as_number(payload.get("temperature")),
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
            category=headers.get(CATEGORY_HEADER),
            request_json=payload,
        )

    def joined(
        self, headers: Mapping[str, str], *, session_header: str | None, type_header: str
    ) -> None:
        """Note which application run the request belongs to, from its (case-insensitive)
        ``headers``: the client's ``traceparent`` trace id, the ``session_header``'s value and the
        ``type_header``'s (each cut to :data:`RUN_KEY_CHARS`; absent or empty: None)."""
        self.trace_id = trace_id_of(headers.get(TRACEPARENT_HEADER))
        if session_header is not None:
            self.session = headers.get(session_header, "")[:RUN_KEY_CHARS] or None
        self.workflow = headers.get(type_header, "")[:RUN_KEY_CHARS] or None

    def decided(
        self,
        generation: int,
        *,
        rule: str | None,
        sampled: bool,
        capture: CaptureSpec,
        skip_reason: str | None,
        sweep_step: int | None = None,
        candidates: tuple[str, ...] = (),
    ) -> None:
        """Note the policy's decision (a sampled request skipped for a reason is a drop)."""
        self.policy_generation = generation
        self.policy_rule = rule
        self.candidates = candidates
        self.sampled = sampled
        self.capture = capture
        self.sweep_step = sweep_step
        if sampled and skip_reason is not None:
            self.drop_reason = skip_reason

    def build(self, primary: LegResult, shadows: tuple[LegResult, ...]) -> Exchange:
        return Exchange(
            exchange_id=self.exchange_id,
            request_id=self.request_id,
            route=self.route,
            requested_model=self.requested_model,
            stream=self.stream,
            started_unix_ns=self.started_unix_ns,
            temperature=self.temperature,
            seed=self.seed,
            category=self.category,
            policy_generation=self.policy_generation,
            policy_rule=self.policy_rule,
            sampled=self.sampled,
            drop_reason=self.drop_reason,
            primary=primary,
            shadows=shadows,
            request_json=self.request_json,
            capture=self.capture,
            traceparent=self.traceparent,
            sweep_step=self.sweep_step,
            dropped=self.dropped,
            candidates=self.candidates,
            served_by=self.served_by,
            rollout_stage=self.rollout_stage,
            rollout_episode=self.rollout_episode,
            failover=self.failover,
            trace_id=self.trace_id,
            session=self.session,
            workflow=self.workflow,
        )
