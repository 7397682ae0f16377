"""The compiled policy: plain frozen values the gateway reads on the hot path (no pydantic here).

:meth:`CompiledPolicy.decide` turns a request's :class:`RequestFacts` into a :class:`Decision`.
Everything it needs is precomputed by :mod:`policies.compile`: glob patterns are compiled to one
regex per condition, the rules that can apply to a (route, model) pair are looked up in a bounded
cache, and the possible Decisions of each rule are built once, so a decision allocates nothing.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Literal

from core.exchange import CaptureSpec, Role, Route, SpeculativeSpec
from core.quality import DEFAULT_ALPHA, DEFAULT_MARGINS
from core.wire import WORKFLOW_HEADER
from policies.sample import sample_unit

BackendKind = Literal["vllm", "sglang", "llamacpp", "openai", "sim"]
SkipReason = Literal["kill_switch", "not_sampled", "no_rule", "retry", "body_size", "no_legs"]

# Bound on the (route, model) → candidate-rules cache: model names come from clients.
CANDIDATE_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """An upstream from the policy. ``url`` has no trailing slash and no ``/v1``."""

    name: str
    url: str
    kind: BackendKind
    api_key_env: str | None
    metrics_url: str | None
    connect_s: float
    idle_s: float
    max_connections: int
    server_address: str  # host:port, for spans and LegResult.server_address
    replicas: int = 1  # servers behind url (per-replica load = load / replicas)
    speculative: SpeculativeSpec | None = None  # declared; the gateway also asks the backend
    # The declared engine configuration (evidence.engine_config's field names); None: none.
    engine: Mapping[str, object] | None = None

    def auth_header(self, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """``("authorization", "Bearer <key>")`` from ``api_key_env``, read now; None if unset.

        Read at call time so a rotated secret is used without a reload.
        """
        if self.api_key_env is None:
            return None
        value = (os.environ if environ is None else environ).get(self.api_key_env)
        return ("authorization", f"Bearer {value}") if value else None


@dataclass(frozen=True, slots=True)
class LegPlan:
    """One shadow leg to send: role, backend, the model name to send (None: unchanged), and the
    share of the rule's requests it receives (at the current sweep step)."""

    role: Role  # ``primary`` only for the primary mirrored behind a candidate that serves
    backend: BackendSpec
    model: str | None
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What ``decide`` may look at. Header names must be lower-case."""

    route: Route
    model: str | None
    stream: bool
    headers: Mapping[str, str]
    prompt_bytes: int
    category: str | None
    request_id: str
    retry_count: int
    # Size of the client's body as read, checked against budgets.max_body_bytes;
    # None: prompt_bytes is used instead.
    body_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's answer for one request.

    ``legs`` is non-empty exactly when the request is to be mirrored (``skip_reason`` is None).
    ``sampled`` is the sampling verdict itself (False for ``no_rule``/``no_legs``), so
    ``sampled and skip_reason`` is a sampled request that was still not mirrored (kill switch,
    retry, body size) — count those as drops by reason. ``capture`` is the deciding rule's capture
    setting (or the policy's).
    """

    rule: str | None
    sampled: bool
    legs: tuple[LegPlan, ...]
    skip_reason: SkipReason | None
    capture: CaptureSpec
    sweep_step: int | None = None  # index into the rule's sweep multiples; None: no sweep
    # The rule's candidate backends, mirrored this time or not: records name them, so the report
    # knows a candidate that drew no pair ("not enough data", not silence).
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Patterns:
    """Exact strings and globs (compiled into one regex); ``matches`` is the OR of both."""

    exact: frozenset[str]
    glob: re.Pattern[str] | None

    def matches(self, value: str) -> bool:
        return value in self.exact or (self.glob is not None and self.glob.match(value) is not None)


@dataclass(frozen=True, slots=True)
class Matcher:
    """A rule's conditions; None/empty means "any"."""

    routes: frozenset[str] | None
    models: Patterns | None
    stream: bool | None
    headers: tuple[tuple[str, Patterns], ...]
    min_prompt_bytes: int
    max_prompt_bytes: int | None  # exclusive
    categories: Patterns | None

    def admits(self, route: str, model: str | None) -> bool:
        """The (route, model) part of the match, cacheable per pair."""
        if self.routes is not None and route not in self.routes:
            return False
        return self.models is None or (model is not None and self.models.matches(model))

    def matches_rest(self, facts: RequestFacts) -> bool:
        """Everything but route and model."""
        if self.stream is not None and facts.stream is not self.stream:
            return False
        if facts.prompt_bytes < self.min_prompt_bytes:
            return False
        if self.max_prompt_bytes is not None and facts.prompt_bytes >= self.max_prompt_bytes:
            return False
        for name, patterns in self.headers:
            value = facts.headers.get(name)
            if value is None or not patterns.matches(value):
                return False
        if self.categories is not None:
            return facts.category is not None and self.categories.matches(facts.category)
        return True


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """A live load sweep: multiples of the base shares, each held ``hold_ns`` or ``hold_requests``."""

    multiples: tuple[float, ...]
    hold_ns: int | None
    hold_requests: int | None
    repeat: bool

    def step(self, started_unix_ns: int, now_unix_ns: int, decided: int) -> int:
        """The current step: by time since the policy loaded, or by requests decided so far."""
        if self.hold_requests is not None:
            index = decided // self.hold_requests
        else:
            index = max(0, now_unix_ns - started_unix_ns) // (self.hold_ns or 1)
        n = len(self.multiples)
        return index % n if self.repeat else min(index, n - 1)


# One rung per distinct share: (share, the decision holding every leg whose share >= it),
# highest share first. A request whose sampling unit u falls below a rung's share gets the legs
# of the lowest such rung: exactly the legs whose share exceeds u (nested, so the legs of a
# smaller share are always a subset — pairs between legs are kept as often as possible).
Ladder = tuple[tuple[float, "Decision"], ...]


Stage = Literal["shadow", "canary", "live"]
STAGES: tuple[Stage, ...] = ("shadow", "canary", "live")


@dataclass(frozen=True, slots=True)
class GuardSpec:
    """The rollout guards of one rule (``None``: that guard is off); see ``policies.model.Guards``."""

    min_samples: int = 20
    window: int = 200
    confidence: float = 0.99
    e2e_p99_ratio_max: float | None = 1.5
    tpot_p99_ratio_max: float | None = 1.5
    error_rate_delta_max: float | None = 0.02
    divergence_rate_max: float | None = 0.05
    tokens_per_event_min: float | None = 1.2
    kv_usage_max: float | None = 0.95
    sampled_divergence_max: float | None = 0.0
    acceptance_drop_max: float | None = 0.2


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """A rule's rollout as the policy states it. ``fingerprint`` identifies the block: a rollback
    stays until an operator promotes or a policy arrives whose block for the rule differs."""

    stage: Stage
    serve_ratio: float
    steps: tuple[float, ...] | None
    hold_requests: int
    hold_s: float
    reference_ratio: float
    candidate: LegPlan  # the leg that serves
    guards: GuardSpec
    fingerprint: str
    on_config_change: Literal["restart", "hold"] = "restart"
    on_drift: Literal["canary", "shadow", "alert"] = "canary"

    def ratio_at(self, step: int | None) -> float:
        """The canary serve ratio at promotion step ``step`` (None: ``serve_ratio``)."""
        if step is None or not self.steps:
            return self.serve_ratio
        return self.steps[min(step, len(self.steps) - 1)]


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """A compiled rule with its prebuilt decisions: one ladder per sweep step, and the skips."""

    name: str  # also the sampling salt
    matcher: Matcher
    legs: tuple[LegPlan, ...]  # with their base shares
    capture: CaptureSpec
    ladders: tuple[Ladder, ...]  # one per sweep step (one when there is no sweep)
    skipped: Mapping[SkipReason, Decision]
    load_matched: bool = False
    sweep: SweepSpec | None = None
    rollout: RolloutSpec | None = None
    # Requests this rule has decided (for sweeps held per request count); shared, never compared.
    decided: Iterator[int] = field(default_factory=count, compare=False, repr=False)

    @property
    def mirrored(self) -> Decision:
        """The decision that sends every leg (at the first sweep step)."""
        return self.ladders[0][-1][1]

    def ladder(self, loaded_unix_ns: int) -> Ladder:
        if self.sweep is None:
            return self.ladders[0]
        decided = next(self.decided)
        return self.ladders[self.sweep.step(loaded_unix_ns, time.time_ns(), decided)]


@dataclass(frozen=True, slots=True)
class BreakerSpec:
    failures: int
    window_s: float
    cooldown_s: float


@dataclass(frozen=True, slots=True)
class Budgets:
    max_in_flight: int
    max_rps: float | None  # None: unlimited
    rps_burst: int  # token-bucket capacity: max(1, ceil(max_rps))
    max_body_bytes: int
    breaker: BreakerSpec


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Shadow-leg defaults; each BackendSpec carries its resolved connect_s/idle_s."""

    connect_s: float
    idle_s: float
    total_s: float  # exchange deadline


@dataclass(frozen=True, slots=True)
class MirrorSpec:
    timing: Literal["with_primary", "after_primary"]
    on_client_disconnect: Literal["finish", "cancel"]
    mirror_retries: bool


@dataclass(frozen=True, slots=True)
class Shaping:
    force_stream: bool
    include_metrics: bool
    override_seed: int | None
    override_temperature: float | None
    # vLLM's return_token_ids on shadow legs: on while the policy scores counterfactuals or
    # likelihoods, so the records and the scorer get the ids the engine generated instead of a
    # re-tokenization of the text.
    token_ids: bool = False


@dataclass(frozen=True, slots=True)
class CounterfactualSpec:
    """The policy's ``counterfactual`` section, its backends resolved."""

    tokenizer: BackendSpec
    share: float
    drafters: tuple[BackendSpec, ...]
    max_in_flight: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class LikelihoodSpec:
    """The policy's ``quality.likelihood`` section, its scorer resolved (None: each exchange's
    baseline leg)."""

    scorer: BackendSpec | None
    share: float
    max_in_flight: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class QualitySpec:
    """The policy's ``quality`` section: every metric's margin (defaults filled in) and the
    tests' size."""

    margins: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MARGINS))
    alpha: float = DEFAULT_ALPHA
    likelihood: LikelihoodSpec | None = None  # target-likelihood scoring; None: off


@dataclass(frozen=True, slots=True)
class WorkflowSpec:
    """Which client headers group calls into runs (``session_header``; None: the trace id only)
    and name their workflow type (``type_header``)."""

    session_header: str | None = None
    type_header: str = WORKFLOW_HEADER


@dataclass(frozen=True, slots=True)
class CompiledPolicy:
    """An immutable, validated policy. Replace it whole (see PolicyStore); never mutate it."""

    source: str
    sha256: str  # of the file's bytes (or of the flags' canonical form)
    loaded_unix_ns: int
    backends: Mapping[str, BackendSpec]
    primary: BackendSpec | None
    sampling_header: str | None  # None: key is the request id
    rules: tuple[RuleSpec, ...]
    default_rule: RuleSpec | None
    budgets: Budgets
    timeouts: Timeouts
    mirror: MirrorSpec
    shaping: Shaping
    header_allow: frozenset[str]  # lower-case client header names copied to shadows
    allow_credentials: bool  # headers.allow_credentials_to_shadows
    capture: CaptureSpec
    kill_switch: bool
    chunk_events: int = 0  # span events per leg (telemetry.chunk_events)
    counterfactual: CounterfactualSpec | None = None  # token ids for counterfactual scoring
    quality: QualitySpec = field(default_factory=QualitySpec)  # equivalence margins and alpha
    workflows: WorkflowSpec = field(default_factory=WorkflowSpec)  # run and type headers
    generation: int = 0  # set by PolicyStore.replace; 0 until stored
    _no_rule: Decision = field(init=False, repr=False, compare=False)
    _candidates: dict[tuple[str, str | None], tuple[RuleSpec, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    # Some rule matches on categories: the request path must classify requests (read per request,
    # so computed once here).
    uses_categories: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_no_rule", Decision(None, False, (), "no_rule", self.capture))
        object.__setattr__(
            self, "uses_categories", any(r.matcher.categories is not None for r in self.rules)
        )

    @property
    def all_rules(self) -> tuple[RuleSpec, ...]:
        return (*self.rules, *((self.default_rule,) if self.default_rule is not None else ()))

    def rule(self, name: str | None) -> RuleSpec | None:
        return next((r for r in self.all_rules if r.name == name), None)

    def sampling_key(self, facts: RequestFacts) -> str:
        """What sampling is sticky by: the ``sampling.key`` header's value, else the request id."""
        if self.sampling_header is not None:
            return facts.headers.get(self.sampling_header) or facts.request_id
        return facts.request_id

    def decide(self, facts: RequestFacts) -> Decision:
        """First matching rule (else ``default``) → sampling → kill switch, retry, body size."""
        rule = self._match(facts)
        if rule is None:
            return self._no_rule
        if not rule.legs:
            return rule.skipped["no_legs"]
        ladder = rule.ladder(self.loaded_unix_ns)
        decision = ladder[-1][1]  # every leg: shares of 1 need no hash
        if ladder[-1][0] < 1.0:
            unit = sample_unit(rule.name, self.sampling_key(facts))
            if unit >= ladder[0][0]:
                return rule.skipped["not_sampled"]
            for share, rung in ladder:  # highest share first: the last rung above unit wins
                if unit < share:
                    decision = rung
        if not decision.legs:
            return rule.skipped["not_sampled"]
        if self.kill_switch:
            return rule.skipped["kill_switch"]
        if facts.retry_count > 0 and not self.mirror.mirror_retries:
            return rule.skipped["retry"]
        size = facts.prompt_bytes if facts.body_bytes is None else facts.body_bytes
        if size > self.budgets.max_body_bytes:
            return rule.skipped["body_size"]
        return decision

    def _match(self, facts: RequestFacts) -> RuleSpec | None:
        pair = (facts.route, facts.model)
        candidates = self._candidates.get(pair)
        if candidates is None:
            candidates = tuple(r for r in self.rules if r.matcher.admits(*pair))
            if len(self._candidates) < CANDIDATE_CACHE_SIZE:
                self._candidates[pair] = candidates
        for rule in candidates:
            if rule.matcher.matches_rest(facts):
                return rule
        return self.default_rule
