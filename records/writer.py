"""Comparison records: one versioned JSON object per exchange (pure). Documented in docs/records.md.

:func:`build_record` turns an :class:`~core.exchange.Exchange` and its comparisons into a plain
dict with schema :data:`SCHEMA`. Unknown values are ``None`` (JSON ``null``), never invented.
Text leaves only as the capture setting allows (:func:`captured_text`):

- ``off`` — SHA-256 and length only (no text);
- ``hashes`` — the same: SHA-256 and length;
- ``redacted`` — text with the ``redact`` classes masked (``emails``, ``secrets``), plus hash;
- ``full`` — text as is, plus hash.

The hash is over the UTF-8 of the original text, so equal outputs have equal hashes whatever the
mode. Schema changes that remove or retype a field bump the version; adding fields does not.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from core.classify import prompt_text
from core.evidence import Comparison, Evidence, LegAcceptance, LegQuality
from core.exchange import CaptureSpec, Exchange, LegResult
from records.rules import concurrency_bucket, output_length_bucket

SCHEMA = "specshadow.record/1"

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
_SECRETS = re.compile(
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}"  # OpenAI-style keys
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # JWTs
    r"|(?i:\bbearer\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|(?i:\b(?:api[_-]?key|secret|token|password|passwd)\b\s*[:=]\s*)\S{6,}"
)
REDACTIONS: Mapping[str, tuple[re.Pattern[str], str]] = {
    "emails": (_EMAIL, "[REDACTED_EMAIL]"),
    "secrets": (_SECRETS, "[REDACTED_SECRET]"),
}


def redact(text: str, classes: frozenset[str]) -> str:
    for name in sorted(classes):
        entry = REDACTIONS.get(name)
        if entry is not None:
            text = entry[0].sub(entry[1], text)
    return text


def captured_text(text: str | None, capture: CaptureSpec) -> dict[str, Any] | None:
    """``{sha256, chars, text?}`` for ``text`` under ``capture``; None when there is no text."""
    if text is None:
        return None
    out: dict[str, Any] = {
        "sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
        "chars": len(text),
    }
    if capture.text == "full":
        out["text"] = text
    elif capture.text == "redacted":
        out["text"] = redact(text, capture.redact)
    return out


def _iso(unix_ns: int) -> str:
    return datetime.fromtimestamp(unix_ns / 1e9, tz=UTC).isoformat(timespec="microseconds")


def _output_text(leg: LegResult) -> str | None:
    rec = leg.recording
    if rec is None or not rec.choices:
        return None
    parts: list[str] = []
    for c in rec.choices:
        parts.append(c.text)
        parts.extend(f"{t.name or ''}({t.arguments})" for t in c.tool_calls)
        if c.refusal:
            parts.append(c.refusal)
    return "".join(parts)


def _request_text(exchange: Exchange) -> str | None:
    if exchange.request_json is None:
        return None
    return prompt_text(exchange.request_json)


class Gauges(Protocol):
    """A backend's own gauges from one scrape (what ``evidence.scrape.MetricsSample`` holds)."""

    @property
    def num_requests_running(self) -> float | None: ...
    @property
    def num_requests_waiting(self) -> float | None: ...
    @property
    def kv_cache_usage_perc(self) -> float | None: ...
    @property
    def unix_ns(self) -> int: ...


Nearest = Callable[[str, int], Gauges | None]


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """What the gateway's pollers know about the backends as a record is built, already in the
    record's shape (the evidence side computes it: ``evidence.worker.backend_facts``): the
    metrics scraper's window of a backend (``legs[].acceptance.backend_window``) and its sample
    nearest in time to a leg (``legs[].load.scraped``), and a leg's speculation as declared and
    as its backend reports it (``legs[].speculative``), and its backend's reduced engine
    configuration with its fingerprints (``legs[].engine``)."""

    window: Callable[[str], Mapping[str, Any] | None] | None = None
    nearest: Nearest | None = None
    speculative: Callable[[LegResult], Mapping[str, Any] | None] | None = None
    engine: Callable[[LegResult], Mapping[str, Any] | None] | None = None


def leg_load(leg: LegResult, nearest: Nearest | None) -> dict[str, Any] | None:
    """The backend's load when the leg was dispatched: the gateway's view, and the backend's own
    gauges from the scrape nearest in time (one replica's), when it has any."""
    load = leg.load
    if load is None:
        return None
    sample = nearest(leg.backend, leg.started_unix_ns) if nearest is not None else None
    return {
        "in_flight": load.in_flight,
        "rate_rps": load.rate_rps,
        "window_s": load.window_s,
        "replicas": load.replicas,
        "per_replica_rate_rps": load.per_replica_rate_rps,
        "per_replica_in_flight": load.per_replica_in_flight,
        "decode_in_flight": leg.decode_in_flight,
        "scraped": None
        if sample is None
        else {
            "num_requests_running": sample.num_requests_running,
            "num_requests_waiting": sample.num_requests_waiting,
            "kv_cache_usage_perc": sample.kv_cache_usage_perc,
            "age_s": (sample.unix_ns - leg.started_unix_ns) / 1e9,
        },
    }


def load_parity(shadow: LegResult, primary: LegResult) -> float | None:
    """Per-replica arrival rate of ``shadow``'s backend over the primary's, at dispatch."""
    if shadow.load is None or primary.load is None or primary.load.per_replica_rate_rps <= 0:
        return None
    return shadow.load.per_replica_rate_rps / primary.load.per_replica_rate_rps


def leg_record(
    leg: LegResult,
    acc: LegAcceptance,
    capture: CaptureSpec,
    facts: BackendFacts = BackendFacts(),
    primary: LegResult | None = None,
    quality: LegQuality | None = None,
) -> dict[str, Any]:
    nearest = facts.nearest
    rec = leg.recording
    t = rec.timings if rec is not None else None
    choice = rec.choices[0] if rec is not None and rec.choices else None
    return {
        "role": leg.role,
        "backend": leg.backend,
        "server_address": leg.server_address,
        "upstream_model": leg.upstream_model,
        "response_model": rec.response_model if rec else None,
        "status": leg.status,
        "outcome": leg.outcome,
        "error_type": leg.error_type,
        "started_unix_ns": leg.started_unix_ns,
        "ttft_s": t.ttft_s if t else None,
        "tpot_s": t.tpot_s if t else None,
        "e2e_s": t.e2e_s if t else None,
        "chunk_gap_p50_s": t.chunk_gap_p50_s if t else None,
        "chunk_gap_p99_s": t.chunk_gap_p99_s if t else None,
        "output_tokens": rec.output_tokens if rec else None,
        "tokens_source": rec.tokens_source if rec else None,
        # What the leg itself reported, when the worker counted it on another footing.
        "tokens_reported": {"count": rec.reported_tokens, "source": rec.reported_source}
        if rec is not None and rec.reported_source is not None
        else None,
        "prompt_tokens": rec.prompt_tokens if rec else None,
        "events": rec.output_events if rec else None,
        "tokens_per_event": t.tokens_per_event if t else None,
        "streaming": rec.streaming if rec else None,
        "finish_reason": choice.finish_reason if choice else None,
        "inflight_at_dispatch": leg.inflight_at_dispatch,
        "concurrency_bucket": concurrency_bucket(leg.inflight_at_dispatch),
        "share": leg.share,
        "load": leg_load(leg, nearest),
        "load_parity": load_parity(leg, primary)
        if primary is not None and leg is not primary
        else None,
        "output_length_bucket": output_length_bucket(rec.output_tokens if rec else None),
        "speculative": facts.speculative(leg) if facts.speculative is not None else None,
        "engine": facts.engine(leg) if facts.engine is not None else None,
        "acceptance": {
            "mean_acceptance_length": acc.mean_acceptance_length,
            "draft_acceptance_rate": acc.draft_acceptance_rate,
            "source": acc.source,
            "num_drafts": acc.num_drafts,
            "num_draft_tokens": acc.num_draft_tokens,
            "num_accepted_tokens": acc.num_accepted_tokens,
            "tokens_per_pass": acc.tokens_per_pass,
            "tokens_per_pass_source": acc.tokens_per_pass_source,
            "coverage": acc.coverage,
            "backend_window": facts.window(leg.backend) if facts.window is not None else None,
        },
        "output": captured_text(_output_text(leg), capture),
        "parse_error": rec.parse_error if rec else None,
        "quality": quality_json(quality),
    }


def quality_json(q: LegQuality | None) -> dict[str, Any] | None:
    """The record's ``legs[].quality`` object."""
    if q is None:
        return None
    return {
        "units": q.units,
        "finish_length": q.finish_length,
        "distinct_2": None if q.distinct_2 is None else round(q.distinct_2, 4),
        "repetition": None if q.repetition is None else round(q.repetition, 4),
        "longest_repeat": q.longest_repeat,
        "refusal": q.refusal,
        "json_valid": q.json_valid,
        "tool_calls": q.tool_calls,
        "tool_valid": q.tool_valid,
        "citations": q.citations,
        "similarity": None if q.similarity is None else round(q.similarity, 4),
        "sketch": None if q.sketch is None else list(q.sketch),
    }


def comparison_record(c: Comparison) -> dict[str, Any]:
    return {
        "a": c.a,
        "b": c.b,
        "a_backend": c.a_backend,
        "b_backend": c.b_backend,
        "comparable": c.comparable,
        "greedy": c.greedy,
        "flag": c.flag,
        "exact_match": c.exact_match,
        "first_divergence": c.first_divergence,
        "divergence_unit": c.divergence_unit,
        "divergence_fraction": c.divergence_fraction,
        "similarity": c.similarity,
        "similarity_capped": c.similarity_capped,
        "finish_reason_equal": c.finish_reason_equal,
        "length_ratio": c.length_ratio,
        "json_expected": c.json_expected,
        "json_valid_a": c.json_valid_a,
        "json_valid_b": c.json_valid_b,
        "json_equal": c.json_equal,
        "tool_names_equal": c.tool_names_equal,
        "tool_arguments_equal": c.tool_arguments_equal,
        "refusal_a": c.refusal_a,
        "refusal_b": c.refusal_b,
        "one_sided_refusal": c.one_sided_refusal,
        "citations_a": list(c.citations_a) if c.citations_a is not None else None,
        "citations_b": list(c.citations_b) if c.citations_b is not None else None,
        "citations_equal": c.citations_equal,
        "latency": {
            d.name: {"a": d.a, "b": d.b, "delta": d.delta, "ratio": d.ratio} for d in c.latency
        },
    }


def build_record(
    evidence: Evidence,
    *,
    capture: CaptureSpec,
    facts: BackendFacts = BackendFacts(),
) -> dict[str, Any]:
    """The record of one exchange's evidence (schema :data:`SCHEMA`)."""
    exchange = evidence.exchange
    primary = exchange.primary.recording
    candidate = next((s for s in exchange.shadows if s.role == "candidate"), None)
    return {
        "schema": SCHEMA,
        "exchange_id": exchange.exchange_id,
        "request_id": exchange.request_id,
        "time": _iso(exchange.started_unix_ns),
        "started_unix_ns": exchange.started_unix_ns,
        "route": exchange.route,
        "requested_model": exchange.requested_model,
        "stream": exchange.stream,
        "category": evidence.category,
        "category_source": evidence.category_source,
        "greedy": evidence.greedy,
        "temperature": exchange.temperature,
        "seed": exchange.seed,
        "policy": {"generation": exchange.policy_generation, "rule": exchange.policy_rule},
        "sampling": {
            "sampled": exchange.sampled,
            "drop_reason": exchange.drop_reason,
            "sweep_step": exchange.sweep_step,
            "dropped": [
                {"backend": backend, "role": role, "reason": reason}
                for backend, role, reason in exchange.dropped
            ],
            "candidates": list(exchange.candidates),
        },
        "capture": capture.text,
        "served_by": exchange.served_by,
        "workflow": workflow_record(exchange),
        "rollout": None
        if exchange.rollout_stage is None
        else {
            "stage": exchange.rollout_stage,
            "failover": exchange.failover,
            "episode": exchange.rollout_episode,
        },
        "output_length_bucket": output_length_bucket(primary.output_tokens if primary else None),
        "concurrency": exchange.primary.inflight_at_dispatch,
        "concurrency_bucket": concurrency_bucket(exchange.primary.inflight_at_dispatch),
        "request": captured_text(_request_text(exchange), capture),
        "legs": [
            leg_record(leg, acc, capture, facts, exchange.primary, q)
            for leg, acc, q in zip(
                exchange.legs,
                evidence.acceptance,
                evidence.quality or (None,) * len(exchange.legs),
                strict=True,
            )
        ],
        "speculation_skip": evidence.speculation_skip,
        "load_parity": load_parity(candidate, exchange.primary) if candidate is not None else None,
        "comparisons": [comparison_record(c) for c in evidence.comparisons],
        "tokens": tokens_record(exchange),
        "likelihood": likelihood_record(exchange),
    }


def workflow_record(exchange: Exchange) -> dict[str, Any] | None:
    """The record's ``workflow``: the application run this call belongs to (the client's trace
    id, the policy's session header value) and its workflow type; None when the request named
    none of them."""
    if exchange.trace_id is None and exchange.session is None and exchange.workflow is None:
        return None
    return {
        "trace_id": exchange.trace_id,
        "session": exchange.session,
        "workflow_type": exchange.workflow,
    }


def likelihood_record(exchange: Exchange) -> dict[str, Any] | None:
    """The record's ``likelihood``: the shadow legs' outputs scored under the target, when the
    likelihood scorer added them (``report.quality`` reads ``legs.<backend>.mean_logprob``)."""
    lk = exchange.likelihood
    if lk is None:
        return None
    return {
        "scorer": lk.scorer,
        "legs": {
            name: {"mean_logprob": leg.mean_logprob, "tokens": leg.tokens, "source": leg.source}
            for name, leg in lk.legs.items()
        },
    }


def tokens_record(exchange: Exchange) -> dict[str, Any] | None:
    """The record's ``tokens``: ids for counterfactual scoring, when the token tap added them."""
    t = exchange.tokens
    if t is None:
        return None
    leg = next((leg for leg in exchange.legs if leg.role == t.leg), None)
    reported = leg.recording.output_tokens if leg is not None and leg.recording else None
    return {
        "source": t.source,
        "leg": t.leg,
        "prompt": list(t.prompt),
        "output": list(t.output),
        "output_source": t.output_source or t.source,
        "output_tokens_reported": reported,
        "drafters": {name: list(ids) for name, ids in t.drafters.items()},
        "legs": {name: list(ids) for name, ids in t.legs.items()},
        "drafter_confidence": {name: list(p) for name, p in t.drafter_confidence.items()},
    }
