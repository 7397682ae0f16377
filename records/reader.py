"""The typed reader of comparison records: the one place outside the writer
(:mod:`records.writer`) that knows a record's field names.

A record is a plain JSON object (``schema specshadow.record/1``, docs/records.md) — stored,
copied and exported as such. Code that *reads* one wraps it in :class:`Record` and gets typed,
lazy views of it: :class:`Leg`, :class:`Comparison`, :class:`Load`, :class:`Acceptance`,
:class:`Speculative`, :class:`LegQuality`, :class:`Sampling`, :class:`Drop`, :class:`Tokens`.
Nothing is copied or parsed ahead of use (a view is one slot holding the dict), so a streamed
fold over millions of records pays only for the fields it reads.

The rules every reader used to repeat by hand live here once:

- a value of the wrong type reads as ``None`` (a record is data, never trusted): numbers are
  finite ``int``/``float`` (never ``bool``), read as ``float``; counts are ``int``;
- a missing category is ``"uncategorized"`` (:data:`core.classify.UNCATEGORIZED`, the name
  telemetry and the counterfactual matrix give it too); a missing backend is ``""`` (as in the
  wide row);
- token ids are lists of ``int`` (any other item: the whole list reads as ``None``);
- ``legs`` holds only objects; :meth:`Record.by_role` is the first leg of each role;
- a leg is :attr:`Leg.ok` when it completed without an error status or error type.

The wide row's typed columns (:mod:`records.wide`) read the same paths; a test holds every
column to this reader's value on real records, so the SQL report and the Python one read the
same fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from core.classify import UNCATEGORIZED
from records.rules import leg_ok

__all__ = [
    "UNCATEGORIZED",
    "Acceptance",
    "Comparison",
    "Drop",
    "Leg",
    "LegQuality",
    "Load",
    "Record",
    "Sampling",
    "Scraped",
    "Speculative",
    "TimingName",
    "Tokens",
    "num",
    "read",
    "read_all",
]

TimingName = Literal["ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s", "chunk_gap_p99_s"]

_EMPTY: Mapping[str, Any] = {}


def num(value: Any) -> float | None:
    """A finite JSON number as ``float``; anything else (``bool``, NaN, text, null) is ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _key(value: Any) -> str:
    """A name as text, ``""`` when absent (the wide row's ``key`` kind)."""
    return "" if value is None else str(value)


def _map(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def _ids(value: Any) -> list[int] | None:
    """A list of token ids as stored; None unless every item is an ``int``."""
    if not isinstance(value, list) or not all(_int(x) is not None for x in value):
        return None
    return value


def _ids_by_name(value: Any) -> dict[str, list[int]]:
    """``{name: ids}``, keeping only the entries whose ids read as :func:`_ids`."""
    block = _map(value) or _EMPTY
    return {str(k): ids for k, v in block.items() if (ids := _ids(v)) is not None}


class _View:
    """One JSON object, read through typed properties."""

    __slots__ = ("raw",)

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.raw!r})"


class Scraped(_View):
    """The backend's own gauges at dispatch (``legs[].load.scraped``: vLLM/SGLang metrics)."""

    __slots__ = ()

    @property
    def num_requests_running(self) -> float | None:
        return num(self.raw.get("num_requests_running"))

    @property
    def num_requests_waiting(self) -> float | None:
        return num(self.raw.get("num_requests_waiting"))

    @property
    def kv_cache_usage_perc(self) -> float | None:
        return num(self.raw.get("kv_cache_usage_perc"))


class Load(_View):
    """A leg's load at dispatch (``legs[].load``); empty when the record has none."""

    __slots__ = ()

    @property
    def present(self) -> bool:
        return bool(self.raw)

    @property
    def per_replica_rate_rps(self) -> float | None:
        return num(self.raw.get("per_replica_rate_rps"))

    @property
    def per_replica_in_flight(self) -> float | None:
        return num(self.raw.get("per_replica_in_flight"))

    @property
    def in_flight(self) -> float | None:
        return num(self.raw.get("in_flight"))

    @property
    def replicas(self) -> int | None:
        return _int(self.raw.get("replicas"))

    @property
    def scraped(self) -> Scraped | None:
        s = _map(self.raw.get("scraped"))
        return None if s is None else Scraped(s)

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


class Acceptance(_View):
    """A leg's acceptance (``legs[].acceptance``): the engine's per-request counters, or the
    metrics window's estimate."""

    __slots__ = ()

    @property
    def mean_acceptance_length(self) -> float | None:
        return num(self.raw.get("mean_acceptance_length"))

    @property
    def draft_acceptance_rate(self) -> float | None:
        return num(self.raw.get("draft_acceptance_rate"))

    @property
    def coverage(self) -> float | None:
        return num(self.raw.get("coverage"))

    @property
    def tokens_per_pass(self) -> float | None:
        return num(self.raw.get("tokens_per_pass"))

    @property
    def num_drafts(self) -> float | None:
        return num(self.raw.get("num_drafts"))

    @property
    def num_draft_tokens(self) -> float | None:
        return num(self.raw.get("num_draft_tokens"))

    @property
    def num_accepted_tokens(self) -> float | None:
        return num(self.raw.get("num_accepted_tokens"))

    @property
    def window_kv_cache_usage_perc(self) -> float | None:
        """KV-cache usage over the scraper's window around the leg (``backend_window``)."""
        return num((_map(self.raw.get("backend_window")) or _EMPTY).get("kv_cache_usage_perc"))


class Speculative(_View):
    """What a candidate leg's backend says of its speculation (``legs[].speculative``)."""

    __slots__ = ()

    @property
    def label(self) -> str | None:
        return _str(self.raw.get("label")) or None

    @property
    def method(self) -> str | None:
        return _str(self.raw.get("method")) or None

    @property
    def num_speculative_tokens(self) -> int | None:
        return _int(self.raw.get("num_speculative_tokens"))

    @property
    def prompt_lookup_min(self) -> int | None:
        """n-gram proposers: the shortest n-gram the lookup matches."""
        return _int(self.raw.get("prompt_lookup_min"))

    @property
    def prompt_lookup_max(self) -> int | None:
        """n-gram proposers: the longest n-gram the lookup matches."""
        return _int(self.raw.get("prompt_lookup_max"))

    @property
    def verification(self) -> str | None:
        return _str(self.raw.get("verification"))

    @property
    def verification_source(self) -> str | None:
        return _str(self.raw.get("verification_source"))

    @property
    def verification_detail(self) -> str | None:
        return _str(self.raw.get("verification_detail"))

    @property
    def mismatches(self) -> tuple[str, ...]:
        items = self.raw.get("mismatches")
        return tuple(str(x) for x in items) if isinstance(items, list) else ()

    @property
    def reported(self) -> Mapping[str, Any] | None:
        """The engine's own report (server info), as it came."""
        return _map(self.raw.get("reported"))


class LegQuality(_View):
    """A completed leg's output scalars (``legs[].quality``; :mod:`evidence.quality`)."""

    __slots__ = ()

    @property
    def units(self) -> float | None:
        return num(self.raw.get("units"))

    @property
    def finish_length(self) -> bool | None:
        return _bool(self.raw.get("finish_length"))

    @property
    def distinct_2(self) -> float | None:
        return num(self.raw.get("distinct_2"))

    @property
    def repetition(self) -> float | None:
        return num(self.raw.get("repetition"))

    @property
    def longest_repeat(self) -> float | None:
        return num(self.raw.get("longest_repeat"))

    @property
    def refusal(self) -> bool | None:
        return _bool(self.raw.get("refusal"))

    @property
    def json_valid(self) -> bool | None:
        return _bool(self.raw.get("json_valid"))

    @property
    def tool_calls(self) -> int:
        return _int(self.raw.get("tool_calls")) or 0

    @property
    def tool_valid(self) -> bool | None:
        return _bool(self.raw.get("tool_valid"))

    @property
    def citations(self) -> int:
        return _int(self.raw.get("citations")) or 0

    @property
    def similarity(self) -> float | None:
        return num(self.raw.get("similarity"))

    @property
    def sketch(self) -> list[float] | None:
        s = self.raw.get("sketch")
        return s if isinstance(s, list) else None


class Leg(_View):
    """One leg of an exchange (``legs[i]``): the primary, a candidate or the baseline."""

    __slots__ = ()

    @property
    def role(self) -> str | None:
        return _str(self.raw.get("role"))

    @property
    def backend(self) -> str:
        return _key(self.raw.get("backend"))

    @property
    def server_address(self) -> str | None:
        """``host:port`` of the server the leg went to (records name servers, not URLs)."""
        return _str(self.raw.get("server_address")) or None

    @property
    def outcome(self) -> str | None:
        return _str(self.raw.get("outcome"))

    @property
    def status(self) -> int | None:
        return _int(self.raw.get("status"))

    @property
    def error_type(self) -> str | None:
        return _str(self.raw.get("error_type"))

    @property
    def ok(self) -> bool:
        """Completed, with no error status and no error type."""
        return leg_ok(self.raw.get("outcome"), self.status, self.raw.get("error_type"))

    def timing(self, name: TimingName) -> float | None:
        return num(self.raw.get(name))

    @property
    def ttft_s(self) -> float | None:
        return num(self.raw.get("ttft_s"))

    @property
    def tpot_s(self) -> float | None:
        return num(self.raw.get("tpot_s"))

    @property
    def e2e_s(self) -> float | None:
        return num(self.raw.get("e2e_s"))

    @property
    def output_tokens(self) -> float | None:
        return num(self.raw.get("output_tokens"))

    @property
    def tokens_source(self) -> str | None:
        """Where ``output_tokens`` came from (core.timings.TokensSource)."""
        return _str(self.raw.get("tokens_source"))

    @property
    def tokens_reported_source(self) -> str | None:
        """The source of the leg's own count when the worker counted it on another footing
        (evidence.counts); None when ``output_tokens`` is the leg's own."""
        reported = self.raw.get("tokens_reported")
        return _str(reported.get("source")) if isinstance(reported, Mapping) else None

    @property
    def tokens_per_event(self) -> float | None:
        return num(self.raw.get("tokens_per_event"))

    @property
    def share(self) -> float | None:
        return num(self.raw.get("share"))

    @property
    def load_parity(self) -> float | None:
        """This shadow leg's per-replica arrival rate over the primary's at dispatch."""
        return num(self.raw.get("load_parity"))

    @property
    def output_length_bucket(self) -> str | None:
        return _str(self.raw.get("output_length_bucket"))

    @property
    def concurrency_bucket(self) -> str | None:
        return _str(self.raw.get("concurrency_bucket"))

    @property
    def load(self) -> Load:
        return Load(_map(self.raw.get("load")) or _EMPTY)

    @property
    def acceptance(self) -> Acceptance:
        return Acceptance(_map(self.raw.get("acceptance")) or _EMPTY)

    @property
    def speculative(self) -> Speculative | None:
        s = _map(self.raw.get("speculative"))
        return None if s is None else Speculative(s)

    @property
    def quality(self) -> LegQuality | None:
        q = _map(self.raw.get("quality"))
        return None if q is None else LegQuality(q)

    @property
    def text(self) -> str | None:
        """The output text, where the capture setting kept it."""
        return _str((_map(self.raw.get("output")) or _EMPTY).get("text"))

    @property
    def output_sha256(self) -> str | None:
        return _str((_map(self.raw.get("output")) or _EMPTY).get("sha256"))


class Comparison(_View):
    """Role ``b``'s output and timings against role ``a``'s (``comparisons[i]``)."""

    __slots__ = ()

    @property
    def a(self) -> str | None:
        return _str(self.raw.get("a"))

    @property
    def b(self) -> str | None:
        return _str(self.raw.get("b"))

    @property
    def b_backend(self) -> str | None:
        return _str(self.raw.get("b_backend"))

    @property
    def comparable(self) -> bool:
        """False only when the comparison says so (unknown counts as comparable)."""
        return self.raw.get("comparable") is not False

    @property
    def exact_match(self) -> bool | None:
        return _bool(self.raw.get("exact_match"))

    @property
    def flag(self) -> bool:
        return bool(self.raw.get("flag"))

    @property
    def one_sided_refusal(self) -> bool:
        return bool(self.raw.get("one_sided_refusal"))

    @property
    def json_expected(self) -> bool:
        return bool(self.raw.get("json_expected"))

    @property
    def json_valid_b(self) -> bool:
        return bool(self.raw.get("json_valid_b"))

    @property
    def json_equal(self) -> bool | None:
        return _bool(self.raw.get("json_equal"))

    @property
    def tool_names_equal(self) -> bool | None:
        return _bool(self.raw.get("tool_names_equal"))

    @property
    def tool_arguments_equal(self) -> bool | None:
        return _bool(self.raw.get("tool_arguments_equal"))

    @property
    def similarity(self) -> float | None:
        return num(self.raw.get("similarity"))

    @property
    def first_divergence(self) -> int | None:
        return _int(self.raw.get("first_divergence"))

    @property
    def divergence_unit(self) -> str | None:
        return _str(self.raw.get("divergence_unit"))


class Drop(_View):
    """A shadow leg the gateway did not send (``sampling.dropped[i]``): budget, breaker, …"""

    __slots__ = ()

    @property
    def role(self) -> str | None:
        return _str(self.raw.get("role"))

    @property
    def backend(self) -> str:
        return _key(self.raw.get("backend"))

    @property
    def reason(self) -> str:
        return str(self.raw.get("reason"))


class Sampling(_View):
    """Why the exchange was or was not mirrored (``sampling``)."""

    __slots__ = ()

    @property
    def sampled(self) -> bool:
        return bool(self.raw.get("sampled"))

    @property
    def candidates(self) -> tuple[str, ...]:
        """The candidates the matched rule names, mirrored or not."""
        items = self.raw.get("candidates")
        return tuple(str(x) for x in items) if isinstance(items, list) else ()

    @property
    def dropped(self) -> tuple[Drop, ...]:
        items = self.raw.get("dropped")
        if not isinstance(items, list):
            return ()
        return tuple(Drop(d) for d in items if isinstance(d, Mapping))

    @property
    def sweep_step(self) -> int | None:
        return _int(self.raw.get("sweep_step"))


class Tokens(_View):
    """The exchange's token ids for counterfactual scoring (``tokens``): the token tap's, or
    ``specshadow counterfactual``'s re-tokenized text (``output_source`` says which)."""

    __slots__ = ()

    @property
    def source(self) -> str | None:
        """Who tokenized the prompt (``tokenize:<backend>``)."""
        return _str(self.raw.get("source"))

    @property
    def leg(self) -> str | None:
        """The role of the leg whose output ``output`` is (production's: ``primary``)."""
        return _str(self.raw.get("leg"))

    @property
    def prompt(self) -> list[int] | None:
        return _ids(self.raw.get("prompt"))

    @property
    def output(self) -> list[int] | None:
        return _ids(self.raw.get("output"))

    @property
    def output_source(self) -> str | None:
        """Where the output ids came from: ``engine``, ``leg:<backend>`` or a tokenizer."""
        return _str(self.raw.get("output_source"))

    @property
    def output_tokens_reported(self) -> int | None:
        """The leg's own output token count, beside the ids' length."""
        return _int(self.raw.get("output_tokens_reported"))

    @property
    def drafters(self) -> dict[str, list[int]]:
        """Per drafter backend, its greedy prediction of each output token."""
        return _ids_by_name(self.raw.get("drafters"))

    @property
    def legs(self) -> dict[str, list[int]]:
        """Per backend, the ids its leg generated (the live candidates' engine check)."""
        return _ids_by_name(self.raw.get("legs"))


class Record:
    """One exchange's comparison record, read through typed properties (see the module doc).

    ``raw`` is the record as stored; the legs are wrapped once, on first use."""

    __slots__ = ("_legs", "_roles", "raw")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self._legs: tuple[Leg, ...] | None = None
        self._roles: dict[str, Leg] | None = None

    def __repr__(self) -> str:
        return f"Record({self.exchange_id!r})"

    @property
    def schema(self) -> str:
        return str(self.raw.get("schema") or "")

    @property
    def exchange_id(self) -> str:
        return str(self.raw.get("exchange_id", ""))

    @property
    def started_unix_ns(self) -> int:
        return _int(self.raw.get("started_unix_ns")) or 0

    @property
    def order_key(self) -> tuple[int, str]:
        """(start, exchange id): the order every reader lists records in."""
        return self.started_unix_ns, self.exchange_id

    @property
    def category(self) -> str:
        c = self.raw.get("category")
        return str(c) if c else UNCATEGORIZED

    @property
    def served_by(self) -> str:
        """Which role answered the client: ``primary``, or ``candidate`` during a canary."""
        s = self.raw.get("served_by")
        return "primary" if s is None else str(s)

    @property
    def greedy(self) -> bool:
        return bool(self.raw.get("greedy"))

    @property
    def speculation_skip(self) -> str | None:
        """Why a speculative engine decodes this request plainly (penalties, ``min_p``)."""
        return _str(self.raw.get("speculation_skip")) or None

    @property
    def output_length_bucket(self) -> str | None:
        return _str(self.raw.get("output_length_bucket"))

    @property
    def concurrency_bucket(self) -> str | None:
        return _str(self.raw.get("concurrency_bucket"))

    @property
    def rollout_stage(self) -> str | None:
        """The rollout stage the exchange ran under; None outside a rollout."""
        block = _map(self.raw.get("rollout"))
        return None if block is None else str(block.get("stage"))

    @property
    def rollout_failover(self) -> bool:
        return bool((_map(self.raw.get("rollout")) or _EMPTY).get("failover"))

    @property
    def policy_rule(self) -> str | None:
        return _str((_map(self.raw.get("policy")) or _EMPTY).get("rule"))

    @property
    def sampling(self) -> Sampling:
        return Sampling(_map(self.raw.get("sampling")) or _EMPTY)

    @property
    def request_text(self) -> str | None:
        """The prompt's text (messages' contents joined), where the capture setting kept it."""
        return _str((_map(self.raw.get("request")) or _EMPTY).get("text"))

    @property
    def tokens(self) -> Tokens | None:
        """The token ids block; None when the record has none (or an empty one)."""
        t = _map(self.raw.get("tokens"))
        return Tokens(t) if t else None

    @property
    def legs(self) -> tuple[Leg, ...]:
        if self._legs is None:
            items = self.raw.get("legs")
            self._legs = (
                tuple(Leg(x) for x in items if isinstance(x, Mapping))
                if isinstance(items, list | tuple)
                else ()
            )
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

    @property
    def comparisons(self) -> tuple[Comparison, ...]:
        items = self.raw.get("comparisons")
        if not isinstance(items, list | tuple):
            return ()
        return tuple(Comparison(c) for c in items if isinstance(c, Mapping))

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
        lk = _map(self.raw.get("likelihood"))
        entry = _map((_map(lk.get("legs")) or _EMPTY).get(backend)) if lk is not None else None
        return None if entry is None else num(entry.get("mean_logprob"))


def read(record: Mapping[str, Any] | Record) -> Record:
    """``record`` as a :class:`Record` (one already read is returned as is)."""
    return record if isinstance(record, Record) else Record(record)


def read_all(records: Iterable[Mapping[str, Any] | Record]) -> list[Record]:
    return [read(r) for r in records]
