"""Policy file model: the schema SREs write, validated strictly with pydantic v2.

This module is the single place where policy fields are defined and documented; the attribute
docstrings below become the descriptions in ``policies/schema.json`` (what editors show while an
SRE types) and ``policies/examples/`` mirrors them. Pydantic is used at config time only: the
hot path runs on :mod:`policies.compiled`, built from a validated :class:`PolicyModel`.

Conventions, for every model here:

- unknown keys are errors (``extra="forbid"``), values are not coerced (``strict=True``: ``"0.5"``
  is not a number, ``1`` is not ``true``) and infinities/NaN are rejected;
- a field that fails validation fails the whole file: at startup the gateway refuses to start, on
  reload the previous policy keeps serving (see :mod:`policies.watch`);
- cross-field rules (backend references, unique rule names, credential headers) are checked in
  :mod:`policies.parse` after this schema, with the same ``path: message`` errors.

Size: one pydantic model per policy key, each field with its user-facing documentation as an
attribute docstring — the same text becomes ``policies/schema.json`` and the editor hints.
Splitting the file would split the schema a reader reads top to bottom.
"""

from __future__ import annotations

import math
import re
from itertools import pairwise
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from core import jsonx
from core.exchange import Route, ShadowRole, Verification
from core.quality import DEFAULT_ALPHA, DEFAULT_MARGINS
from core.wire import WORKFLOW_HEADER
from policies.compiled import BackendKind

SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_NAME_PATTERN = _NAME_RE.pattern
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# RFC 9110 token characters; names are compared case-insensitively and stored lower-cased.
_HEADER_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_SAMPLING_KEY_PATTERN = r"^(request_id|header:[!#$%&'*+.^_`|~0-9A-Za-z-]+)$"


def _check_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            "must be 1-64 letters, digits, '_', '.', ':' or '-', starting with a letter or "
            f"digit, got {value!r}"
        )
    return value


def _check_header_name(value: str) -> str:
    if not _HEADER_RE.match(value):
        raise ValueError(f"must be an HTTP header name, got {value!r}")
    return value.lower()


def _check_env_name(value: str) -> str:
    if not _ENV_RE.match(value):
        # Never echo the value: someone may have pasted the secret itself here.
        raise ValueError(
            "must be the NAME of an environment variable (letters, digits and '_', not starting "
            f"with a digit) that holds the key, never the key itself (got {len(value)} characters "
            "that are not a variable name)"
        )
    return value


def _check_http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.username is not None or parts.password is not None:
        # Never echo the value: it embeds a credential.
        raise ValueError(
            "must not embed credentials (user:password@); name an environment variable in "
            "api_key_env instead"
        )
    try:
        parts.port  # noqa: B018 - evaluated for its ValueError on a bad port
    except ValueError:
        raise ValueError(f"has an invalid port, got {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must not have a query or fragment, got {value!r}")
    return value


def _check_base_url(value: str) -> str:
    _check_http_url(value)
    base = value.rstrip("/")
    if urlsplit(base).path.endswith("/v1"):
        raise ValueError(
            "must be the base URL without /v1 (the gateway appends /v1/chat/completions), "
            f"got {value!r}"
        )
    return base


def _check_ratio(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be between 0 and 1, got {value}")
    return float(value)


def _check_sampling_key(value: str) -> str:
    if value == "request_id":
        return value
    kind, _, header = value.partition(":")
    if kind != "header" or not _HEADER_RE.match(header):
        raise ValueError(f"must be 'request_id' or 'header:<header-name>', got {value!r}")
    return f"header:{header.lower()}"


Name = Annotated[
    str, AfterValidator(_check_name), Field(json_schema_extra={"pattern": _NAME_PATTERN})
]
HeaderName = Annotated[
    str,
    AfterValidator(_check_header_name),
    Field(json_schema_extra={"pattern": _HEADER_RE.pattern}),
]
Pattern = Annotated[str, Field(min_length=1)]
Ratio = Annotated[
    float, AfterValidator(_check_ratio), Field(json_schema_extra={"minimum": 0, "maximum": 1})
]
PositiveSeconds = Annotated[float, Field(gt=0, le=86_400)]


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )


class BackendTimeouts(_Strict):
    """Per-backend overrides of the top-level ``timeouts``; unset fields inherit them."""

    connect_s: PositiveSeconds | None = None
    """Seconds allowed to open a TCP/TLS connection to this backend. Past it the leg fails with
    ``upstream_timeout``; the primary is never affected."""
    idle_s: PositiveSeconds | None = None
    """Seconds allowed between two reads of this backend's response (SSE idle gap). Past it the
    leg fails with ``upstream_timeout``."""


class Speculative(_Strict):
    """What a backend's speculative decoding is, as the operator knows it. Every field is
    optional: the gateway also asks vLLM (``GET /server_info``, served with
    ``VLLM_SERVER_DEV_MODE=1``) and SGLang (``GET /get_server_info``), and records carry both;
    where they disagree the backend's own answer wins and the disagreement is logged and
    reported."""

    method: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    """The proposer: ``ngram``, ``draft_model``, ``eagle``, ``eagle3``, ``mtp``, ``medusa``,
    ``suffix``, … (free text, as the engine names it)."""
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=64)
    """Draft depth k: tokens proposed per step (0: speculation off)."""
    label: Annotated[str, StringConstraints(min_length=1, max_length=80)] | None = None
    """How the report names this candidate, e.g. ``n-gram k=4``. Default: the backend name."""
    verification: Verification | None = None
    """``lossless`` (standard rejection sampling: the output distribution is the target's) or
    ``lossy`` (drafts may be accepted that the target would not have produced: relaxed or
    synthetic acceptance). Declare ``lossy`` for modes no endpoint reveals (SGLang's
    ``SGLANG_SIMULATE_ACC_LEN``, TensorRT-LLM's relaxed acceptance). A report never calls a
    candidate lossless when the policy or the backend says lossy."""
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=64)
    """n-gram proposers: the shortest n-gram matched (vLLM's ``prompt_lookup_min``)."""
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=64)
    """n-gram proposers: the longest n-gram matched (vLLM's ``prompt_lookup_max``)."""
    cross_vocabulary: bool | None = None
    """The drafter has its own tokenizer and vocabulary (vLLM's ``use_heterogeneous_vocab``,
    Hugging Face's Universal Assisted Generation). vLLM reports it; declare it for engines that
    do not. The report's release checklist then carries the cross-vocabulary gate."""


class Engine(_Strict):
    """What a backend's engine runs, as the operator knows it: the fields that change speed or
    output. Every field is optional; the gateway also asks the engine (vLLM's ``/server_info``,
    ``/version`` and ``/metrics``, SGLang's ``/server_info``) and what it reports wins. A field only
    declared here is labelled ``declared`` in records and in the report's confound gate
    (docs/confounds.md). Declare what no endpoint says: an OpenAI-compatible backend's version,
    a vLLM without dev mode's quantization."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    """The engine: ``vllm``, ``sglang``, ``trtllm``, … (the record's ``engine`` field)."""
    version: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    """The engine's release, e.g. ``0.32.0``."""
    model: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    """The served weights (a path or a hub id)."""
    revision: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    """The weights' revision (a commit or tag)."""
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=32)] | None = None
    """The weights' dtype: ``bfloat16``, ``float16``, …"""
    quantization: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    """The quantization method: ``fp8``, ``awq``, ``gptq``, … (unset: none)."""
    kv_cache_dtype: Annotated[str, StringConstraints(min_length=1, max_length=32)] | None = None
    """The KV cache's dtype: ``auto`` (the weights'), ``fp8``, …"""
    enable_prefix_caching: bool | None = None
    """Whether prefix caching is on."""
    enable_chunked_prefill: bool | None = None
    """Whether chunked prefill is on."""
    max_num_seqs: int | None = Field(default=None, ge=1, le=1_000_000)
    """The scheduler's limit on sequences in a batch."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1, le=100_000_000)
    """The scheduler's limit on tokens in a batch."""
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=4096)
    """GPUs a layer is split across."""
    pipeline_parallel_size: int | None = Field(default=None, ge=1, le=4096)
    """Pipeline stages the layers are split into."""
    data_parallel_size: int | None = Field(default=None, ge=1, le=4096)
    """Engine replicas behind one server."""
    max_model_len: int | None = Field(default=None, ge=1, le=100_000_000)
    """The longest context served."""


class Backend(_Strict):
    """An upstream the gateway may send requests to. Upstreams come only from here (or the
    ``--primary``/``--shadow``/``--baseline`` flags): no client header or URL can pick one."""

    url: Annotated[str, AfterValidator(_check_base_url)]
    """Base URL, http:// or https://, without ``/v1`` (the gateway appends ``/v1/...``), e.g.
    ``http://127.0.0.1:8000``. A trailing slash is dropped. Credentials in the URL are rejected."""
    kind: BackendKind
    """What speaks at ``url``: ``vllm`` (a vLLM server: shadow requests get vLLM-only fields such as
    ``include_metrics`` and ``stream_options.continuous_usage_stats``; its ``/metrics`` are read
    with vLLM's names), ``sglang`` (an SGLang server: its ``/metrics`` are read with SGLang's names,
    ``sglang:num_running_reqs`` …; only standard request fields are sent), ``llamacpp`` (llama.cpp's
    server: per-request acceptance from its ``timings``, ``/metrics`` with ``llamacpp:`` names, its
    configuration from ``/props`` and ``/slots``; only standard request fields are sent), ``sim``
    (the specshadow simulator: vLLM's fields and names) or ``openai`` (any other OpenAI-compatible
    API: only standard fields, and no ``/metrics``)."""
    replicas: int = Field(default=1, ge=1, le=100_000)
    """How many servers stand behind ``url`` (a load balancer or a Kubernetes Service). A shadow
    sees only the mirrored share of traffic; what must match production is the per-replica arrival
    rate, so ``ratio: load_matched`` mirrors ``candidate replicas / primary replicas`` of the
    requests and the report divides load by this number. The scraped ``/metrics`` are taken as one
    replica's."""
    api_key_env: Annotated[str, AfterValidator(_check_env_name)] | None = None
    """NAME of the environment variable that holds this backend's API key, read at request time
    and sent as ``Authorization: Bearer <value>``. Unset or empty variable: no Authorization header
    is sent. The key itself never appears in a policy file; a value that is not a variable name
    is rejected (and not echoed in the error)."""
    metrics_url: Annotated[str, AfterValidator(_check_http_url)] | None = None
    """Prometheus endpoint scraped for speculative-decoding counters. Default: ``url + /metrics``
    for ``vllm``, ``sglang``, ``llamacpp`` and ``sim``; none for ``openai``."""
    timeout: BackendTimeouts = BackendTimeouts()
    """Connect/idle timeouts for this backend; unset fields inherit the top-level ``timeouts``."""
    max_connections: int = Field(default=64, ge=1, le=10_000)
    """Size of this backend's connection pool. Shadow legs beyond it wait for a connection
    inside their own deadline; they never borrow the primary's pool."""
    speculative: Speculative | None = None
    """This backend's speculative decoding (method, depth, label, verification); see
    ``Speculative``. Records carry it per leg; the report names candidates by its label."""
    engine: Engine | None = None
    """What this backend's engine runs beyond speculation (version, dtype, quantization, …); see
    ``Engine``. Fills what the engine does not report; the report's confound gate reads it."""


class PromptBytes(_Strict):
    """A prompt-size bucket, half-open: ``min <= prompt_bytes < max`` (so buckets can share a
    boundary without overlapping)."""

    min: int = Field(default=0, ge=0)
    """Smallest prompt size in bytes that matches (inclusive)."""
    max: int | None = Field(default=None, ge=1)
    """Prompt size in bytes from which the bucket no longer matches (exclusive); unset: no upper
    bound. Must be greater than ``min``."""

    @model_validator(mode="after")
    def _max_above_min(self) -> PromptBytes:
        if self.max is not None and self.max <= self.min:
            raise ValueError(f"max must be greater than min, got min={self.min}, max={self.max}")
        return self


class Match(_Strict):
    """Conditions a request must meet for a rule to apply; all given conditions must hold (AND),
    any value in a list may match (OR). An empty ``match`` matches every request. Patterns are
    exact strings or shell-style globs (``*``, ``?``, ``[...]``), case-sensitive."""

    routes: list[Route] | None = Field(default=None, min_length=1)
    """Routes: ``chat`` (/v1/chat/completions), ``completions`` (/v1/completions), ``responses``
    (/v1/responses, the Responses API)."""
    models: list[Pattern] | None = Field(default=None, min_length=1)
    """Requested model names (the client's ``model``), exact or glob, e.g. ``llama-3-*``. A request
    without a model never matches a rule that lists models."""
    stream: bool | None = None
    """Match only streaming (``true``) or only non-streaming (``false``) requests."""
    headers: dict[HeaderName, Annotated[list[Pattern], Field(min_length=1)]] | None = None
    """Request header name → accepted values (exact or glob), e.g. ``x-tenant: [acme, "beta-*"]``.
    Names are case-insensitive. A missing header never matches."""
    prompt_bytes: PromptBytes | None = None
    """Prompt-size bucket in bytes of prompt text (see ``PromptBytes``)."""
    categories: list[Pattern] | None = Field(default=None, min_length=1)
    """Request categories (exact or glob), as classified by the gateway. A request without a
    category never matches a rule that lists categories."""


class Leg(_Strict):
    """One shadow leg: where a sampled request is mirrored, in which role."""

    backend: Name
    """Name of a backend in ``backends``. It must not be the primary: shadow traffic never lands
    on the production backend."""
    role: ShadowRole = "candidate"
    """``candidate``: the speculative configuration under evaluation. ``baseline``: a copy of the
    primary's configuration, measured to know the run-to-run noise floor."""
    model: Annotated[str, Field(min_length=1)] | None = None
    """Model name sent to this leg instead of the client's (``upstream_model``); unset: unchanged."""


class Capture(_Strict):
    """What request/response text may be kept in comparison records and spans."""

    text: Literal[False, "hashes", "redacted", "full"] = False
    """``false`` (default): no text leaves the process — records keep timings, scores, and the
    SHA-256 and length of prompts and outputs. ``hashes``: the same, stated explicitly. ``redacted``: text with the
    ``redact`` classes masked. ``full``: text as is — only where data handling allows it."""
    redact: list[Literal["emails", "secrets"]] = ["emails", "secrets"]
    """What ``redacted`` masks: ``emails`` (addresses) and ``secrets`` (API-key/token-like strings).
    Ignored for other ``text`` values."""


class TelemetryPolicy(_Strict):
    """Per-chunk detail on spans; bounded so a long stream never becomes a span per token."""

    chunk_events: int = Field(default=0, ge=0, le=256)
    """Span events per leg, one per output-bearing chunk (receive time, tokens), for the first
    ``chunk_events`` chunks; 0 (default) adds none. Timing summaries are always on the span."""


class Sweep(_Strict):
    """A live load sweep: the rule's share steps through multiples of its base share (the matched
    share for ``ratio: load_matched``), so one shadow run maps the candidate's speed-up over loads
    around production's. Each step is held for ``hold_s`` seconds (from the policy generation's
    load) or ``hold_requests`` requests the rule decided; after the last step the last multiple
    holds, unless ``repeat``."""

    multiples: Annotated[list[Annotated[float, Field(gt=0, le=100)]], Field(min_length=1)]
    """Multiples of the base share, in order, e.g. ``[0.25, 0.5, 1, 1.5]``. A share above 1 is
    capped at 1 (every request)."""
    hold_s: PositiveSeconds | None = None
    """Seconds each step is held (default 60 when ``hold_requests`` is unset)."""
    hold_requests: int | None = Field(default=None, ge=1)
    """Requests decided by the rule per step, instead of a duration."""
    repeat: bool = False
    """Start over after the last step (a long shadow run maps load again and again)."""

    @model_validator(mode="after")
    def _one_hold(self) -> Sweep:
        if self.hold_s is not None and self.hold_requests is not None:
            raise ValueError("give hold_s or hold_requests, not both")
        return self


Fraction = Annotated[float, Field(ge=0, le=1)]


class Guards(_Strict):
    """What rolls a canary back, evaluated live in the gateway after every exchange of the rule
    that has a candidate leg (served or shadow). Each statistical guard is an anytime-valid
    sequential test (a betting e-process, Ville's inequality): however long the rollout runs and
    however often it is looked at, a candidate within every threshold is rolled back with
    probability at most ``1 − confidence`` (docs/rollout.md says which test, what it assumes and
    how fast each one fires). ``null`` turns a guard off."""

    min_samples: int = Field(default=20, ge=5, le=100_000)
    """Observations a guard must have tested before it may fire."""
    window: int = Field(default=200, ge=10, le=100_000)
    """Forgetting horizon, in a guard's observations: once its test is N old, evidence against
    the candidate that has stopped growing over the last N/2 is dropped (the test restarts);
    evidence that keeps growing is kept. Also the span of the ``value`` shown and of the primary
    p99 the latency guards compare with."""
    confidence: float = Field(default=0.99, ge=0.8, le=0.9999)
    """1 − the probability that a candidate within every threshold is ever rolled back by a
    guard, over the whole rollout (split evenly over the enabled guards, spent over the restarts
    of each)."""
    e2e_p99_ratio_max: Annotated[float, Field(ge=1)] | None = 1.5
    """Fires when the candidate's p99 e2e exceeds this multiple of the primary's p99 e2e: tested
    on pairs of the two legs, as "the candidate exceeds this multiple of the primary's recent p99
    more often than the primary exceeds its p99"."""
    tpot_p99_ratio_max: Annotated[float, Field(ge=1)] | None = 1.5
    """The same for p99 time per output token."""
    error_rate_delta_max: Fraction | None = 0.02
    """Fires when the candidate's error rate exceeds the primary's by more than this (tested on
    pairs of the two legs). A failover to the primary counts as a candidate error."""
    divergence_rate_max: Fraction | None = 0.05
    """Fires when the candidate's greedy divergence from the primary exceeds the noise floor by
    more than this — the floor is the baseline leg's divergence on the same exchange, 0 on an
    exchange without one."""
    tokens_per_event_min: Annotated[float, Field(ge=1)] | None = 1.2
    """Fires when the candidate's mean tokens per event falls below this (each request counted up
    to twice this value): acceptance collapsed, speculation is no longer buying anything."""
    kv_usage_max: Annotated[float, Field(gt=0, le=1)] | None = 0.95
    """Fires when the candidate's scraped KV-cache usage stays at or above this for its last
    three scrapes (needs a metrics URL). A sustained gauge, not a statistical test."""
    sampled_divergence_max: Annotated[float, Field(ge=0, le=4)] | None = 0.0
    """Sampled traffic (temperature > 0): fires when the candidate's outputs come from a different
    distribution than a baseline leg's (a plain copy of production) on the same requests — by a
    string-kernel MMD² above this, pooled with how close each is to production's answer to the
    same request, and with the outputs' lengths and repetition. ``0`` (the
    default) tests that the two outputs are exchangeable, what a lossless candidate promises; a
    margin tolerates a difference but makes the test much slower. The reference is a baseline
    leg's output where the exchange has one, else the primary's own answer to the same request —
    mirrored behind a canary answer (at the rule's ``ratio``) and, at ``live``, at
    ``reference_ratio``: for a lossless candidate both are independent draws from the same
    distribution. Without either the guard is ``unavailable``, and an unavailable quality guard
    blocks promotion."""
    acceptance_drop_max: Fraction | None = 0.2
    """Fires when the candidate's mean acceptance length (tokens per verification pass: the
    engine's own per-request counts where it reports them, else the stream's shape) falls by more
    than this fraction below its reference level — the level it held over the first readings of
    its rollout episode, kept across restarts and shared by a fleet. Tested overall and per
    category (decay in the field is prompt-type specific), anytime-valid, in ``canary`` and
    ``live``; what a breach does is ``rollout.on_drift``. The same switch turns on
    ``speculation_off``: a candidate whose engine reports no drafts, or no accepted draft token,
    on 32 requests in a row has stopped speculating (a rule, not a statistical test)."""


class Hold(_Strict):
    """How long a promotion step must hold, all guards green, before the next."""

    min_requests: int = Field(default=100, ge=1, le=10_000_000)
    """Requests answered by the candidate at this step."""
    min_s: PositiveSeconds = 60.0
    """Seconds at this step."""


class Rollout(_Strict):
    """Progressive delivery of the rule's candidate: ``shadow`` (the primary answers; the
    candidate is mirrored at ``ratio``), ``canary`` (a sticky share ``serve_ratio`` of the rule's
    requests is answered by the candidate, with the primary as their shadow at ``ratio``) or
    ``live`` (the candidate answers all of them; the primary is mirrored at ``reference_ratio``
    as the guards' reference). A guard breach rolls the rule back to ``shadow`` at once; the
    rollback persists (``specshadow serve --state``) until an operator promotes again or the
    policy's ``rollout`` block for this rule changes."""

    stage: Literal["shadow", "canary", "live"] = "shadow"
    """Where the rollout starts (or stands, without ``steps``)."""
    serve_ratio: Fraction = 0.05
    """Canary: the share of the rule's requests answered by the candidate, sticky by the
    sampling key (``sampling.key``: the same user keeps the same backend)."""
    steps: Annotated[list[Annotated[float, Field(gt=0, le=1)]], Field(min_length=1)] | None = None
    """Automatic promotion: canary serve ratios in order, e.g. ``[0.05, 0.25, 1.0]``; each is
    held (``hold``) with every guard green, then the next; after the last, ``live``."""
    hold: Hold = Hold()
    """How long each step holds."""
    reference_ratio: Annotated[float, Field(gt=0, le=1)] = 0.05
    """Live: the share of requests also sent to the primary, as the guards' reference."""
    candidate: Name | None = None
    """The backend that serves: one of the rule's candidate legs. Default: its only one."""
    guards: Guards = Guards()
    """What rolls it back (see ``Guards``)."""
    on_drift: Literal["canary", "shadow", "alert"] = "canary"
    """What a breach of ``acceptance_drop`` or ``speculation_off`` does (the candidate still
    answers correctly; it has lost its speed): ``canary`` (default) goes back to the first canary
    step so the candidate re-qualifies, with a new reference level; ``shadow`` rolls back like any
    other guard; ``alert`` only logs, counts and shows the breach, and the guard watches on."""
    on_config_change: Literal["restart", "hold"] = "restart"
    """When the candidate's engine configuration changes (its fingerprint: docs/confounds.md) in
    ``canary`` or ``live``: ``restart`` goes back to the first canary step (the promotion was
    earned by another build); ``hold`` stays where it is but promotes no further until an
    operator does. Either way a guard's rollback is lifted by a change (a new build may try
    again)."""

    @model_validator(mode="after")
    def _increasing(self) -> Rollout:
        steps = self.steps or []
        if any(b <= a for a, b in pairwise(steps)):
            raise ValueError(f"steps must increase, got {steps}")
        return self


def _sweep_shorthand(value: object) -> object:
    """``sweep: [0.25, 0.5, 1]`` is ``sweep: {multiples: [0.25, 0.5, 1]}``."""
    return {"multiples": value} if isinstance(value, list) else value


SweepField = Annotated["Sweep", BeforeValidator(_sweep_shorthand)]

LOAD_MATCHED = "load_matched"


def _check_share(value: object) -> float | str:
    """A rule's ``ratio``: a number in [0, 1], or ``load_matched``."""
    if isinstance(value, str) and value == LOAD_MATCHED:
        return LOAD_MATCHED
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = repr(value) if not isinstance(value, bool) else str(value).lower()
        raise ValueError(f"must be a number between 0 and 1 or 'load_matched', got {shown}")
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value}")
    return _check_ratio(float(value))


ShareRatio = Annotated[
    float | Literal["load_matched"],
    PlainValidator(_check_share),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": 1},
                {"const": "load_matched"},
            ]
        }
    ),
]


class Rule(_Strict):
    """A mirroring rule. Rules are tried in order; the first whose ``match`` holds decides, and a
    request no rule matches falls to ``default``."""

    name: Name
    """Unique rule id. It is the sampling salt: keeping the name keeps every request's sampling
    decision across reloads and replicas; renaming a rule reshuffles which requests it samples."""
    match: Match = Match()
    """Conditions for this rule (see ``Match``); omitted: matches every request."""
    ratio: ShareRatio
    """Fraction of matching requests mirrored, 0..1. A request is mirrored to a leg when
    ``sample_unit(name, key) < share`` (see ``sampling.key``): deterministic, the same on every
    replica and reload. ``0`` never mirrors (a way to exclude traffic); ``1`` mirrors all.
    ``load_matched``: each leg's share is its backend's ``replicas`` ÷ the primary's (capped at 1),
    so every shadow replica sees the arrival rate of a production replica — the only share at
    which its latency is what production would see. Budgets still cap it (drops are counted)."""
    sweep: SweepField | None = None
    """Optional live load sweep (see ``Sweep``); a bare list is the multiples, each held 60 s."""
    legs: list[Leg]
    """Shadow legs each sampled request is sent to. Empty: matching requests are never mirrored
    (and are not passed on to later rules)."""
    capture: Capture | None = None
    """Overrides the top-level ``capture`` for requests this rule decides."""
    rollout: Rollout | None = None
    """Serve the candidate progressively: canary, live, with guards (see ``Rollout``)."""


class DefaultRule(_Strict):
    """The rule for requests no rule matched. Omitted: such requests are never mirrored."""

    ratio: ShareRatio
    """Fraction mirrored, 0..1, or ``load_matched`` (see ``Rule.ratio``); sampled with the salt
    ``default``."""
    sweep: SweepField | None = None
    """Optional live load sweep (see ``Sweep``); a bare list is the multiples, each held 60 s."""
    legs: list[Leg]
    """Shadow legs for sampled requests (see ``Rule.legs``)."""
    capture: Capture | None = None
    """Overrides the top-level ``capture`` for requests this rule decides."""
    rollout: Rollout | None = None
    """Serve the candidate progressively (see ``Rollout``)."""


class Sampling(_Strict):
    """How a request is turned into a sampling key."""

    key: Annotated[
        str,
        AfterValidator(_check_sampling_key),
        Field(json_schema_extra={"pattern": _SAMPLING_KEY_PATTERN}),
    ] = "request_id"
    """``request_id`` (default): each request is sampled independently. ``header:<name>``, e.g.
    ``header:x-user-id``: sticky sampling — every request with the same header value gets the same
    answer. A request without that header (or with it empty) falls back to its request id."""


class Breaker(_Strict):
    """Circuit breaker per shadow backend: stops sending to a failing shadow, probes it later."""

    failures: int = Field(default=5, ge=1)
    """Failed or timed-out legs within ``window_s`` that open the breaker (drop reason ``breaker``)."""
    window_s: PositiveSeconds = 30.0
    """Sliding window, in seconds, over which failures are counted."""
    cooldown_s: PositiveSeconds = 30.0
    """Seconds the breaker stays open before one probe request is let through."""


class Budgets(_Strict):
    """Per-replica limits on shadow work. Over a limit, the shadow is dropped and counted by
    reason — never queued, never allowed to slow the primary."""

    max_in_flight: int = Field(default=64, ge=1)
    """Shadow legs in flight at once; a leg over it is dropped (reason ``budget``)."""
    max_rps: float | None = Field(default=None, gt=0)
    """Shadow requests started per second (token bucket, burst ``max(1, max_rps)``); over it the
    request is dropped (reason ``rate``). Unset: no rate limit."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    """Largest client body mirrored, in bytes; larger sampled requests are not mirrored (reason
    ``body_size``)."""
    breaker: Breaker = Breaker()
    """Circuit breaker settings (see ``Breaker``)."""


class Timeouts(_Strict):
    """Default timeouts for every shadow leg; a backend's ``timeout`` may override connect/idle."""

    connect_s: PositiveSeconds = 2.0
    """Seconds to open a connection to a shadow backend."""
    idle_s: PositiveSeconds = 60.0
    """Seconds allowed between two reads of a shadow response (covers a slow prefill)."""
    total_s: PositiveSeconds = 300.0
    """Deadline for the whole exchange, from the client request to the last leg's end. Legs still
    running then are cancelled and recorded with outcome ``deadline``."""


class Mirror(_Strict):
    """When shadow legs start and what happens to them when the client goes away."""

    timing: Literal["with_primary", "after_primary"] = "with_primary"
    """``with_primary`` (default): legs start together with the primary, under the same
    conditions. ``after_primary``: legs start once the primary's response has ended — for shadow
    backends that share hardware with production."""
    on_client_disconnect: Literal["finish", "cancel"] = "finish"
    """``finish`` (default): in-flight shadow legs run to completion so the measurement is kept.
    ``cancel``: they are cancelled (outcome ``cancelled``) to save backend capacity."""
    mirror_retries: bool = False
    """Mirror requests the client is retrying (``x-stainless-retry-count`` > 0). Default ``false``:
    a retry would double-count the same prompt (skip reason ``retry``)."""


class Shaping(_Strict):
    """How a shadow leg's request body is derived from the client's. The primary's request is
    never touched."""

    force_stream: bool = True
    """Send every shadow leg as a stream with ``stream_options.include_usage`` (and, for ``vllm``
    and ``sim`` backends, ``continuous_usage_stats``), so every leg is timed the same way."""
    include_metrics: bool = True
    """For ``vllm`` and ``sim`` backends, add ``include_metrics: true`` to the body so vLLM returns
    its per-request speculative-decoding metrics (needs ``--enable-per-request-metrics``)."""
    override_seed: int | None = None
    """Seed sent to shadow legs instead of the client's; unset (default): the client's value, if
    any, is kept."""
    override_temperature: float | None = Field(default=None, ge=0, le=2)
    """Temperature sent to shadow legs instead of the client's; unset (default): kept. Setting it
    makes shadows incomparable with the primary's sampled outputs; use with care."""


class Headers(_Strict):
    """Which client headers reach shadow legs. By default none do, except the ones the gateway sets
    itself (content-type, x-request-id, traceparent, the x-specshadow-shadow marker) and the
    backend's own Authorization."""

    allow: list[HeaderName] = []
    """Client header names copied to shadow legs (case-insensitive), e.g. ``x-tenant``.
    Credential-bearing names (authorization, cookie, *api-key*, *token*, ...) are rejected unless
    ``allow_credentials_to_shadows`` is true; names the gateway sets itself or that are
    connection-level (host, content-length, ...) are always rejected."""
    allow_credentials_to_shadows: bool = False
    """Permit credential-bearing names in ``allow``. Even then, a backend with ``api_key_env``
    always sends its own key in Authorization, never the client's."""


class Counterfactual(_Strict):
    """Token ids for counterfactual scoring (``specshadow counterfactual``, docs/counterfactual.md):
    for a sampled share of exchanges, after they ended and off the request path, the gateway asks
    a tokenizer backend (never the primary) for the prompt's and the primary's output's token
    ids, and each drafter for its teacher-forced prediction at every output position, and keeps
    them in the record. Token ids are the text in another encoding: turning this on lets the
    records hold the sampled share's prompts and outputs, whatever ``capture`` says."""

    tokenizer: Name
    """Backend whose ``POST /tokenize`` (vLLM, SGLang, the simulator) tokenizes with the target's
    tokenizer and chat template; usually the candidate or the baseline. Never the primary."""
    share: Fraction = 0.1
    """Share of exchanges whose tokens are kept (by exchange id; mirrored or not)."""
    drafters: list[Name] = []
    """Backends serving a draft model plainly: one ``prompt_logprobs`` pass each over prompt +
    output scores every draft depth of that drafter."""
    max_in_flight: int = Field(default=4, ge=1, le=256)
    """Exchanges being tokenized at once; past it an exchange is recorded without tokens (counted),
    never queued."""
    timeout_s: PositiveSeconds = 10.0
    """Per call to the tokenizer or a drafter."""


class Likelihood(_Strict):
    """Target-likelihood scoring (docs/quality.md): for a sampled share of sampled (not greedy)
    exchanges with a baseline leg and at least one candidate leg, after they ended and off the
    request path, each of those shadow legs' outputs is scored under the target model on a
    scorer backend — one ``/v1/completions`` pass with ``prompt_logprobs`` over the prompt's ids
    and the output's — and its mean log-probability per token is kept in the record, for the
    report's ``loglik`` metric. The sharpest detector of temperature drift, greedy collapse and
    a different model; it costs one prompt-processing pass per scored leg on the scorer."""

    scorer: Name | None = None
    """Backend serving the target model plainly, with vLLM's ``POST /tokenize`` (the target's
    tokenizer and chat template) and ``prompt_logprobs``. Never the primary. Omitted: each
    exchange's own baseline leg scores it — when that backend is of kind ``vllm`` or ``sim``
    (other kinds cannot score, and their exchanges go unscored)."""
    share: Fraction = 0.5
    """Share of eligible exchanges scored (by exchange id, so replicas agree)."""
    max_in_flight: int = Field(default=4, ge=1, le=256)
    """Exchanges being scored at once; past it an exchange is recorded without a likelihood
    (counted as ``specshadow_telemetry_dropped_total{signal="likelihood", reason="budget"}``),
    never queued."""
    timeout_s: PositiveSeconds = 10.0
    """Per call to the scorer; a call that fails or times out records the exchange without a
    likelihood (``reason="error"``)."""


def _default_margins() -> dict[str, float]:
    return dict(DEFAULT_MARGINS)


class Quality(_Strict):
    """How the report and the rollout judge quality equivalence on sampled traffic
    (docs/quality.md): paired two-sample tests of the candidate's outputs against the baseline's,
    exchange by exchange, and a two-one-sided-tests decision against these margins."""

    margins: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=_default_margins
    )
    """Equivalence margin per metric (``refusal_rate``, ``json_valid_rate``, ``length_ratio``,
    ``similarity``, ...; docs/quality.md lists them with their defaults). Keys given here
    replace that metric's default; the others keep theirs."""
    alpha: float = Field(default=DEFAULT_ALPHA, gt=0, le=0.2)
    """Size of each test: the chance of calling an identical candidate ``not_equivalent`` (per
    candidate × category, after the correction across metrics)."""
    likelihood: Likelihood | None = Field(default_factory=Likelihood)
    """Target-likelihood scoring of shadow legs for the ``loglik`` metric (see ``Likelihood``).
    On by default, scored by each exchange's baseline leg, for half of the eligible exchanges;
    ``null`` turns it off."""


class Workflows(_Strict):
    """How the report groups calls into application runs and runs into workflow types
    (docs/workflows.md). Calls that share the client's W3C ``traceparent`` trace id are one run;
    a session header, when named, groups them instead (an agent's session may span traces)."""

    session_header: HeaderName | None = None
    """Client header whose value names the run a call belongs to (e.g. ``x-session-id``); it
    takes precedence over the trace id. Unset (default): runs are grouped by trace id only."""
    type_header: HeaderName = WORKFLOW_HEADER
    """Client header whose value names the run's workflow type (``triage-agent``, ``rag``);
    a run without it is typed by its first call's route and category."""


class PolicyModel(_Strict):
    """A specshadow policy file (``version: 1``)."""

    model_config = ConfigDict(title="specshadow policy")

    version: Literal[1]
    """Schema version of this file; must be 1."""
    backends: dict[Name, Backend] = {}
    """Upstreams by name (see ``Backend``)."""
    primary: Name | None = None
    """Name of the backend that answers clients. The ``--primary URL`` flag overrides its URL (or
    creates a backend named ``primary`` when this is unset)."""
    sampling: Sampling = Sampling()
    """How the sampling key is chosen (see ``Sampling``)."""
    rules: list[Rule] = []
    """Mirroring rules, first match wins (see ``Rule``)."""
    default: DefaultRule | None = None
    """Rule for requests no rule matched; omitted: they are never mirrored."""
    budgets: Budgets = Budgets()
    """Limits on shadow work (see ``Budgets``)."""
    timeouts: Timeouts = Timeouts()
    """Default timeouts for shadow legs (see ``Timeouts``)."""
    mirror: Mirror = Mirror()
    """Timing and cancellation of shadow legs (see ``Mirror``)."""
    shaping: Shaping = Shaping()
    """Shadow request shaping (see ``Shaping``)."""
    headers: Headers = Headers()
    """Client headers forwarded to shadows (see ``Headers``)."""
    capture: Capture = Capture()
    """What text may be captured (see ``Capture``); rules may override it."""
    telemetry: TelemetryPolicy = TelemetryPolicy()
    """Per-chunk span detail (see ``TelemetryPolicy``)."""
    counterfactual: Counterfactual | None = None
    """Token ids for counterfactual scoring of every proposer and depth (see ``Counterfactual``);
    omitted: off."""
    quality: Quality = Quality()
    """Quality equivalence on sampled traffic: margins and test size (see ``Quality``)."""
    workflows: Workflows = Workflows()
    """Which headers group calls into runs and name their workflow type (see ``Workflows``)."""
    kill_switch: bool = False
    """``true`` stops all mirroring at once (skip reason ``kill_switch``); rules stay validated and
    evaluated so dashboards show what would have been mirrored."""


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file, as committed in ``policies/schema.json``."""
    return {"$schema": SCHEMA_DRAFT, **PolicyModel.model_json_schema()}


def render_json_schema() -> bytes:
    """``policy_json_schema()`` as the exact bytes of ``policies/schema.json``."""
    return jsonx.dumps(policy_json_schema(), indent=True) + b"\n"
