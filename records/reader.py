"""The typed reader of comparison records: every field of a record declared once.

A record is a plain JSON object (``schema specshadow.record/1``, docs/records.md) — stored,
copied and exported as such. Code that *reads* one wraps it in :class:`Record` and gets typed,
lazy views of it: :class:`Leg`, :class:`Comparison`, :class:`Load`, :class:`Acceptance`,
:class:`Speculative`, :class:`LegQuality`, :class:`Sampling`, :class:`Drop`, :class:`Tokens`, ….
Every attribute that reads the record is a declared field (:mod:`records.fields`: its path and
kind), so the declarations below are the record's vocabulary: the wide row's columns are derived
from them (:mod:`records.wide`), a test holds the writer (:mod:`records.writer`) to writing
exactly the declared paths, and another fails on a record field spelled as a string outside this
package. Nothing is copied or parsed ahead of use (a view is one slot holding the dict), so a
streamed fold over millions of records pays only for the fields it reads.

The rules every reader used to repeat by hand live here once:

- a value of the wrong type reads as ``None`` (a record is data, never trusted): numbers are
  finite ``int``/``float`` (never ``bool``), read as ``float``; counts are ``int``;
- a missing category is ``"uncategorized"`` (:data:`core.classify.UNCATEGORIZED`, the name
  telemetry and the counterfactual matrix give it too); a missing backend is ``""`` (as in the
  wide row);
- token ids are lists of ``int`` (any other item: the whole list reads as ``None``);
- ``legs`` holds only objects; :meth:`Record.by_role` is the first leg of each role;
- a leg is :attr:`Leg.ok` when it completed without an error status or error type
  (:func:`records.rules.leg_ok`, whose SQL form the engine report uses).

Size: one class per record object, each field one line; it stays whole because it *is* the
record's declaration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from core.classify import UNCATEGORIZED
from records.fields import (
    EMPTY,
    View,
    as_ids,
    as_number,
    boolean,
    flag,
    ids,
    integer,
    items,
    key,
    mapping,
    name,
    number,
    strings,
    text,
    view,
    views,
)
from records.rules import leg_ok

__all__ = [
    "UNCATEGORIZED",
    "Acceptance",
    "BackendWindow",
    "Comparison",
    "Drop",
    "Engine",
    "Leg",
    "LegQuality",
    "Load",
    "Record",
    "Sampling",
    "Scraped",
    "Speculative",
    "TimingName",
    "Tokens",
    "Workflow",
    "num",
    "read",
    "read_all",
]

TimingName = Literal["ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s", "chunk_gap_p99_s"]

num = as_number  # a finite JSON number as float, else None (for values readers get elsewhere)


class Scraped(View):
    """The backend's own gauges at dispatch (``legs[].load.scraped``: vLLM/SGLang metrics)."""

    __slots__ = ()

    num_requests_running = number()
    num_requests_waiting = number()
    kv_cache_usage_perc = number()
    age_s = number(doc="the scrape's time minus the leg's start (s)")


class Load(View):
    """A leg's load at dispatch (``legs[].load``); empty when the record has none."""

    __slots__ = ()

    in_flight = number()
    rate_rps = number()
    window_s = number()
    replicas = integer()
    per_replica_rate_rps = number()
    per_replica_in_flight = number()
    decode_in_flight = number(
        doc="this gateway's legs in flight to the backend, averaged over the leg's decode "
        "interval (first to last output event; this leg included)"
    )
    scraped = view(Scraped)

    @property
    def present(self) -> bool:
        return bool(self.raw)

    @property
    def per_replica_decode_in_flight(self) -> float | None:
        """:attr:`decode_in_flight` per replica: the batch the leg decoded in, as this gateway
        saw it."""
        d = self.decode_in_flight
        return None if d is None else d / (self.replicas or 1)

    @property
    def per_replica_concurrency(self) -> float | None:
        """The backend's own running + waiting count when scraped, else this gateway's
        in-flight count per replica."""
        s = self.scraped
        if s is not None:
            running = s.num_requests_running
            if running is not None:
                return running + (s.num_requests_waiting or 0.0)
        return self.per_replica_in_flight


class BackendWindow(View):
    """The metrics scraper's window of the leg's backend (``legs[].acceptance.backend_window``)."""

    __slots__ = ()

    source = text()
    window_s = number()
    draft_acceptance_rate = number()
    mean_acceptance_length = number()
    per_position = items()
    kv_cache_usage_perc = number()
    num_requests_running = number()


class Acceptance(View):
    """A leg's acceptance (``legs[].acceptance``): the engine's per-request counters, or the
    metrics window's estimate."""

    __slots__ = ()

    mean_acceptance_length = number()
    draft_acceptance_rate = number()
    source = text()
    num_drafts = number()
    num_draft_tokens = number()
    num_accepted_tokens = number()
    tokens_per_pass = number()
    tokens_per_pass_source = text()
    coverage = number()
    backend_window = view(BackendWindow)

    @property
    def window_kv_cache_usage_perc(self) -> float | None:
        """KV-cache usage over the scraper's window around the leg (``backend_window``)."""
        w = self.backend_window
        return None if w is None else w.kv_cache_usage_perc


class Speculative(View):
    """What a candidate leg's backend says of its speculation (``legs[].speculative``)."""

    __slots__ = ()

    method = name()
    num_speculative_tokens = integer()
    prompt_lookup_min = integer(doc="n-gram proposers: the shortest n-gram the lookup matches")
    prompt_lookup_max = integer(doc="n-gram proposers: the longest n-gram the lookup matches")
    label = name()
    verification = text(doc="lossless, lossy or unknown (a mode specshadow does not know)")
    verification_source = text()
    verification_detail = text()
    adaptive_verification = flag(doc="each step verifies a per-request budget: k is a cap")
    draft_sample_method = name(doc="vLLM's draft_sample_method: greedy or probabilistic")
    cross_vocabulary = flag(doc="the drafter has its own vocabulary (reported or declared)")
    declared = mapping(doc="the policy's declaration, as it came")
    reported = mapping(doc="the engine's own report (server info), as it came")
    mismatches = strings()


class Engine(View):
    """A leg's backend's engine configuration, reduced to what changes speed or output
    (``legs[].engine``; :mod:`evidence.engine_config`)."""

    __slots__ = ()

    config_fingerprint = name(doc="hash of the reduced configuration, speculative block included")
    base_fingerprint = name(doc="the same without the speculative block")
    settings = mapping(doc="field → value: engine, version, model, dtype, quantization, …")
    sources = mapping(doc="field → where it was read (an endpoint) or 'declared'")
    declared = strings(doc="the fields only the policy's declaration gave")


class LegQuality(View):
    """A completed leg's output scalars (``legs[].quality``; :mod:`evidence.quality`)."""

    __slots__ = ()

    units = number()
    finish_length = flag()
    distinct_2 = number()
    repetition = number()
    longest_repeat = number()
    refusal = flag()
    json_valid = flag()
    _tool_calls = integer("tool_calls")
    tool_valid = flag()
    _citations = integer("citations")
    similarity = number()
    _sketch = items("sketch")

    @property
    def tool_calls(self) -> int:
        return self._tool_calls or 0

    @property
    def citations(self) -> int:
        return self._citations or 0

    @property
    def sketch(self) -> list[float] | None:
        return self._sketch


class Captured(View):
    """Text as the capture setting kept it (``request``, ``legs[].output``): its hash and length
    always, the text itself only under ``full`` or ``redacted``."""

    __slots__ = ()

    sha256 = text()
    chars = integer()
    text = text()


class TokensReported(View):
    """The count a leg itself reported, when the worker counted it on another footing."""

    __slots__ = ()

    count = integer()
    source = text()


class Leg(View):
    """One leg of an exchange (``legs[i]``): the primary, a candidate or the baseline."""

    __slots__ = ()

    role = text()
    backend = key()
    server_address = name(doc="host:port of the server the leg went to (never a URL)")
    upstream_model = text()
    response_model = text()
    status = integer()
    outcome = text()
    error_type = text()
    started_unix_ns = integer()
    ttft_s = number()
    tpot_s = number()
    e2e_s = number()
    chunk_gap_p50_s = number()
    chunk_gap_p99_s = number()
    output_tokens = number()
    tokens_source = text(doc="where output_tokens came from (core.timings.TokensSource)")
    tokens_reported = view(TokensReported)
    prompt_tokens = number()
    events = integer(doc="output-bearing events")
    tokens_per_event = number()
    streaming = flag()
    finish_reason = text()
    inflight_at_dispatch = integer()
    concurrency_bucket = text()
    share = number()
    _load = view(Load, "load")
    load_parity = number(doc="this shadow leg's per-replica arrival rate over the primary's")
    output_length_bucket = text()
    speculative = view(Speculative)
    engine = view(Engine)
    _acceptance = view(Acceptance, "acceptance")
    output = view(Captured)
    parse_error = text()
    quality = view(LegQuality)

    @property
    def ok(self) -> bool:
        """Completed, with no error status and no error type."""
        return leg_ok(self.outcome, self.status, self.error_type)

    def timing(self, name: TimingName) -> float | None:
        return getattr(self, name)  # type: ignore[no-any-return]  # one of the timing fields

    @property
    def tokens_reported_source(self) -> str | None:
        """The source of the leg's own count when the worker counted it on another footing
        (evidence.counts); None when ``output_tokens`` is the leg's own."""
        r = self.tokens_reported
        return None if r is None else r.source

    @property
    def load(self) -> Load:
        return self._load or Load(EMPTY)

    @property
    def acceptance(self) -> Acceptance:
        return self._acceptance or Acceptance(EMPTY)

    @property
    def text(self) -> str | None:
        """The output text, where the capture setting kept it."""
        o = self.output
        return None if o is None else o.text

    @property
    def output_sha256(self) -> str | None:
        o = self.output
        return None if o is None else o.sha256


class Latency(View):
    """One paired latency of a comparison (``comparisons[].latency.<timing>``)."""

    __slots__ = ()

    a = number()
    b = number()
    delta = number()
    ratio = number()


class Comparison(View):
    """Role ``b``'s output and timings against role ``a``'s (``comparisons[i]``)."""

    __slots__ = ()

    a = text()
    b = text()
    a_backend = text()
    b_backend = text()
    _comparable = flag("comparable")
    greedy = flag()
    exact_match = flag()
    first_divergence = integer()
    divergence_unit = text()
    divergence_fraction = number()
    similarity = number()
    similarity_capped = flag()
    finish_reason_equal = flag()
    length_ratio = number()
    json_expected = boolean()
    json_valid_a = flag()
    json_valid_b = boolean()
    json_equal = flag()
    tool_names_equal = flag()
    tool_arguments_equal = flag()
    refusal_a = flag()
    refusal_b = flag()
    one_sided_refusal = boolean()
    citations_a = items()
    citations_b = items()
    citations_equal = flag()
    latency = mapping(doc="timing name → {a, b, delta, ratio} (read through latency_of)")
    flag = boolean(doc="a greedy request that did not match exactly")  # last: names the factory

    @property
    def comparable(self) -> bool:
        """False only when the comparison says so (unknown counts as comparable)."""
        return self._comparable is not False

    def latency_of(self, timing: str) -> Latency | None:
        entry = (self.latency or EMPTY).get(timing)
        return Latency(entry) if isinstance(entry, Mapping) else None


class Drop(View):
    """A shadow leg the gateway did not send (``sampling.dropped[i]``): budget, breaker, …"""

    __slots__ = ()

    backend = key()
    role = text()
    _reason = key("reason")

    @property
    def reason(self) -> str:
        return self._reason or "None"


class Sampling(View):
    """Why the exchange was or was not mirrored (``sampling``)."""

    __slots__ = ()

    sampled = boolean()
    drop_reason = text()
    sweep_step = integer()
    dropped = views(Drop)
    candidates = strings(doc="the candidates the matched rule names, mirrored or not")


class Policy(View):
    """The policy that decided the exchange (``policy``)."""

    __slots__ = ()

    generation = integer()
    rule = text()


class Rollout(View):
    """The rollout stage the exchange ran under (``rollout``; absent outside a rollout)."""

    __slots__ = ()

    stage = text()
    failover = text(doc="why a candidate that should have answered did not (it failed first)")
    episode = name(
        doc="the rule's rollout episode when the exchange was dispatched (the guards judge an "
        "episode on its own exchanges; a policy change, a promotion or a re-qualification "
        "starts a new one, a rollback does not)"
    )


class Workflow(View):
    """The application run a call belongs to (``workflow``; absent when the request named none):
    the client's W3C trace id, the policy's session header value, the workflow type header's."""

    __slots__ = ()

    trace_id = name(doc="the trace id of the client's traceparent (32 hex digits)")
    session = name(doc="the value of the policy's workflows.session_header")
    type = name(
        "workflow_type",
        doc="the value of the policy's workflows.type_header (x-specshadow-workflow)",
    )


class Tokens(View):
    """The exchange's token ids for counterfactual scoring (``tokens``): the token tap's, or
    ``specshadow counterfactual``'s re-tokenized text (``output_source`` says which)."""

    __slots__ = ()

    source = text(doc="who tokenized the prompt (tokenize:<backend>)")
    leg = text(doc="the role of the leg whose output `output` is (production's: primary)")
    prompt = ids()
    output = ids()
    output_source = text(doc="where the output ids came from: engine, leg:<backend>, a tokenizer")
    output_tokens_reported = integer(doc="the leg's own output token count, beside the ids'")
    _drafters = mapping("drafters")
    _legs = mapping("legs")
    _drafter_confidence = mapping("drafter_confidence")

    @property
    def drafters(self) -> dict[str, list[int]]:
        """Per drafter backend, its greedy prediction of each output token."""
        return _ids_by_name(self._drafters)

    @property
    def legs(self) -> dict[str, list[int]]:
        """Per backend, the ids its leg generated (the live candidates' engine check)."""
        return _ids_by_name(self._legs)

    @property
    def drafter_confidence(self) -> dict[str, list[float]]:
        """Per drafter backend, the probability it gave its own prediction of each output token
        (entries that are not lists of numbers in [0, 1] are left out)."""
        out: dict[str, list[float]] = {}
        for drafter, raw in (self._drafter_confidence or EMPTY).items():
            if isinstance(raw, list) and all(
                isinstance(p, float | int) and not isinstance(p, bool) and 0 <= p <= 1 for p in raw
            ):
                out[str(drafter)] = [float(p) for p in raw]
        return out


def _ids_by_name(block: Mapping[str, Any] | None) -> dict[str, list[int]]:
    """``{name: ids}``, keeping only the entries whose ids read as token ids."""
    return {str(k): v for k, raw in (block or EMPTY).items() if (v := as_ids(raw)) is not None}


class LikelihoodLeg(View):
    """One shadow leg's output scored under the target (``likelihood.legs.<backend>``)."""

    __slots__ = ()

    mean_logprob = number()
    tokens = integer()
    source = text()


class Likelihood(View):
    """The shadow legs' outputs scored under the target (``likelihood``)."""

    __slots__ = ()

    scorer = text()
    legs = mapping(doc="backend → LikelihoodLeg (read through Record.mean_logprob)")


class Record(View):
    """One exchange's comparison record, read through typed properties (see the module doc).

    ``raw`` is the record as stored; the legs are wrapped once, on first use."""

    __slots__ = ("_legs", "_roles")

    schema = key()
    exchange_id = key()
    request_id = text()
    time = text(doc="the start as ISO 8601 (UTC)")
    _started_unix_ns = integer("started_unix_ns")
    route = text()
    requested_model = text()
    stream = flag()
    _category = text("category")
    category_source = text()
    greedy = boolean()
    temperature = number()
    seed = integer()
    policy = view(Policy)
    _sampling = view(Sampling, "sampling")
    capture = text()
    _served_by = text("served_by")
    workflow = view(Workflow, doc="the application run and its type; None when unnamed")
    rollout = view(Rollout)
    output_length_bucket = text()
    concurrency = integer()
    concurrency_bucket = text()
    request = view(Captured)
    _leg_list = views(Leg, "legs")
    speculation_skip = name(doc="why a speculative engine decodes this request plainly")
    load_parity = number()
    comparisons = views(Comparison)
    tokens = view(Tokens, doc="the token ids block; None when the record has none")
    likelihood = view(Likelihood)

    def __init__(self, raw: Mapping[str, Any]) -> None:
        super().__init__(raw)
        self._legs: tuple[Leg, ...] | None = None
        self._roles: dict[str, Leg] | None = None

    def __repr__(self) -> str:
        return f"Record({self.exchange_id!r})"

    @property
    def started_unix_ns(self) -> int:
        return self._started_unix_ns or 0

    @property
    def order_key(self) -> tuple[int, str]:
        """(start, exchange id): the order every reader lists records in."""
        return self.started_unix_ns, self.exchange_id

    @property
    def category(self) -> str:
        return self._category or UNCATEGORIZED

    @property
    def served_by(self) -> str:
        """Which role answered the client: ``primary``, or ``candidate`` during a canary."""
        return self._served_by or "primary"

    @property
    def rollout_stage(self) -> str | None:
        """The rollout stage the exchange ran under; None outside a rollout."""
        r = self.rollout
        return None if r is None else str(r.stage)

    @property
    def rollout_episode(self) -> str | None:
        """The rule's rollout episode the exchange was dispatched in; None outside a rollout (or
        in records written before the field)."""
        r = self.rollout
        return None if r is None else r.episode

    @property
    def rollout_failover(self) -> bool:
        r = self.rollout
        return r is not None and bool(r.failover)

    @property
    def policy_rule(self) -> str | None:
        p = self.policy
        return None if p is None else p.rule

    @property
    def sampling(self) -> Sampling:
        return self._sampling or Sampling(EMPTY)

    @property
    def request_text(self) -> str | None:
        """The prompt's text (messages' contents joined), where the capture setting kept it."""
        r = self.request
        return None if r is None else r.text

    @property
    def legs(self) -> tuple[Leg, ...]:
        if self._legs is None:
            self._legs = self._leg_list
        return self._legs

    def by_role(self) -> Mapping[str, Leg]:
        """The first leg of each role."""
        if self._roles is None:
            roles: dict[str, Leg] = {}
            for leg in self.legs:
                role = leg.role
                if role is not None and role not in roles:
                    roles[role] = leg
            self._roles = roles
        return self._roles

    @property
    def primary(self) -> Leg | None:
        return self.by_role().get("primary")

    @property
    def baseline(self) -> Leg | None:
        return self.by_role().get("baseline")

    def candidate_leg(self, backend: str | None) -> Leg | None:
        """The candidate leg served by ``backend`` (``None``: the first candidate leg)."""
        for leg in self.legs:
            if leg.role == "candidate" and (backend is None or leg.backend == backend):
                return leg
        return None

    def comparison(self, a: str, b: str, *, b_backend: str | None = None) -> Comparison | None:
        """The comparison of role ``b`` (served by ``b_backend``, when given) against ``a``."""
        for c in self.comparisons:
            if b_backend is not None and c.b_backend not in (None, b_backend):
                continue
            if (c.a, c.b) in ((a, b), (b, a)):
                return c
        return None

    def named_candidates(self) -> list[str]:
        """Every candidate backend this exchange names, in order: its candidate legs, the
        candidate legs it dropped, the rule's candidate list (duplicates kept)."""
        sampling = self.sampling
        out = [leg.backend for leg in self.legs if leg.role == "candidate"]
        out += [d.backend for d in sampling.dropped if d.role == "candidate"]
        out += list(sampling.candidates)
        return out

    def mean_logprob(self, backend: str) -> float | None:
        """The target's mean log-probability of ``backend``'s output (``likelihood``)."""
        lk = self.likelihood
        entry = (lk.legs or EMPTY).get(backend) if lk is not None else None
        return LikelihoodLeg(entry).mean_logprob if isinstance(entry, Mapping) else None


def read(record: Mapping[str, Any] | Record) -> Record:
    """``record`` as a :class:`Record` (one already read is returned as is)."""
    return record if isinstance(record, Record) else Record(record)


def read_all(records: Iterable[Mapping[str, Any] | Record]) -> list[Record]:
    return [read(r) for r in records]
