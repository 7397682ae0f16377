"""The typed record reader against its writer: every field it reads is one the writer writes,
every wide column reads what the reader reads, and the test builders write the writer's shape.

Records come from the writer itself (:func:`evidence.worker.build_evidence` over hand-built
exchanges), so a renamed field in either fails here rather than as a silent ``None`` in a report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from core.exchange import CaptureSpec, LegLoad, SpeculativeSpec, TokenIds
from evidence.engine_config import resolve_engine
from evidence.scrape import BackendSnapshot, MetricsSample, WindowStats, window_json
from evidence.worker import backend_facts, build_evidence
from records.fields import Field, declared_paths, opaque_paths
from records.reader import Leg, Record, read, read_all
from records.wide import EXCHANGE_COLUMNS, LEG_COLUMNS
from records.writer import build_record
from tests.otel.exchanges import make_exchange, make_leg, make_recording
from tests.report import synthetic

FULL = CaptureSpec(text="full", redact=frozenset())
SPEC = SpeculativeSpec(
    method="ngram", num_speculative_tokens=4, label="ngram-4", verification="lossless"
)


def written() -> dict[str, Any]:
    """A record as the writer writes it: a candidate with speculative counters and a baseline,
    every leg with its load at dispatch and its backend's gauges, and the token tap's ids."""
    ex = make_exchange()
    load = LegLoad(in_flight=3, rate_rps=12.0, window_s=10.0, replicas=2)
    ex = dataclasses.replace(
        ex,
        primary=dataclasses.replace(ex.primary, load=load),
        shadows=tuple(
            dataclasses.replace(s, load=load, speculative=SPEC if s.role == "candidate" else None)
            for s in ex.shadows
        ),
        dropped=(("vllm-eagle", "candidate", "budget"),),
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        session="s-1",
        workflow="triage-agent",
        tokens=TokenIds(
            source="tokenize:vllm-ngram",
            leg="primary",
            prompt=(1, 2, 3),
            output=(4, 5),
            drafters={"drafter": (4, 6)},
            output_source="engine",
            legs={"vllm-ngram": (4, 5)},
        ),
    )

    def nearest(backend: str, unix_ns: int) -> MetricsSample:
        return MetricsSample(0, unix_ns, 1.0, 4.0, 2.0, (), 0.25, 3.0, 1.0)

    evidence = build_evidence(ex, capture_default=FULL)
    window = WindowStats(10.0, 4, 8.0, 24.0, 12.0, 0.5, 2.5, (0.7, 0.5, 0.3))
    snapshot = BackendSnapshot("vllm-ngram", "http://x", True, 4, 0, None, 1, window, 0.25, 3.0)
    facts = dataclasses.replace(  # the worker's, with a scraper's gauges and window
        backend_facts(),
        nearest=nearest,
        window=lambda backend: window_json(snapshot if backend == "vllm-ngram" else None),
        engine=lambda leg: resolve_engine(
            {"info": ("vllm_server_info", {"engine": "vllm", "version": "0.32.0"})},
            {"quantization": "fp8"},
        ).to_json(),  # type: ignore[union-attr]
    )
    return build_record(evidence, capture=FULL, facts=facts)


class Tracing(Mapping[str, Any]):
    """A JSON object that remembers every key path read through it (and through its children)."""

    def __init__(self, raw: Mapping[str, Any], path: tuple[str, ...], seen: set[tuple[str, ...]]):
        self._raw, self._path, self._seen = raw, path, seen

    def _wrap(self, value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, Mapping):
            return Tracing(value, path, self._seen)
        if isinstance(value, list):
            return [self._wrap(v, (*path, "[]")) for v in value]
        return value

    def __getitem__(self, key: str) -> Any:
        self._seen.add((*self._path, key))
        return self._wrap(self._raw[key], (*self._path, key))

    def get(self, key: str, default: Any = None) -> Any:
        self._seen.add((*self._path, key))
        return self._wrap(self._raw[key], (*self._path, key)) if key in self._raw else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def touch(view: object, depth: int = 0) -> None:
    """Read every public property of ``view`` and of the views it returns."""
    if depth > 3:
        return
    for name in dir(type(view)):
        if name.startswith("_") or name == "raw":
            continue
        attr = getattr(type(view), name)
        if isinstance(attr, property | Field):
            value = getattr(view, name)
            for v in value if isinstance(value, tuple) else (value,):
                if hasattr(v, "raw"):
                    touch(v, depth + 1)
    if isinstance(view, Record):
        view.by_role()
        view.candidate_leg("vllm-ngram")
        view.comparison("primary", "candidate")
        view.named_candidates()
        view.mean_logprob("vllm-ngram")
    if isinstance(view, Leg):
        for t in ("ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s", "chunk_gap_p99_s"):
            view.timing(t)


def paths(obj: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every key path of a JSON value (list items under ``[]``)."""
    out: set[tuple[str, ...]] = set()
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out.add((*prefix, k))
            out |= paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for v in obj:
            out |= paths(v, (*prefix, "[]"))
    return out


# Paths the writer writes only in some exchanges (a rollout, the likelihood scorer, the
# backend's own report): the reader may read them; they are checked against the docs instead.
OPTIONAL = {
    ("legs", "[]", "speculative", "reported"),
    ("rollout", "stage"),
    ("rollout", "failover"),
    ("rollout", "episode"),
    ("likelihood", "legs"),
    ("legs", "[]", "acceptance", "backend_window", "kv_cache_usage_perc"),
}


def test_every_field_the_reader_reads_is_one_the_writer_writes() -> None:
    raw = written()
    seen: set[tuple[str, ...]] = set()
    touch(read(Tracing(raw, (), seen)))
    unknown = {p for p in seen - paths(raw) - OPTIONAL if p[-1:] != ("[]",)}
    assert not unknown, sorted(unknown)
    # and it read the fields the report needs, not a handful
    assert len(seen) > 60, len(seen)


def test_docs_name_every_optional_path() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "records.md").read_text()
    for path in OPTIONAL:
        assert f"`{path[-1]}`" in docs or path[-1] in docs, path


def test_the_reader_reads_the_writers_values() -> None:
    raw = written()
    r = read(raw)
    assert r.exchange_id == "ex-1" and r.started_unix_ns == raw["started_unix_ns"]
    assert r.category == raw["category"] and r.served_by == "primary"
    assert [leg.role for leg in r.legs] == ["primary", "candidate", "baseline"]
    cand = r.candidate_leg("vllm-ngram")
    assert cand is not None and cand is r.candidate_leg(None)
    assert cand.ok and cand.e2e_s == raw["legs"][1]["e2e_s"]
    assert cand.acceptance.num_drafts == raw["legs"][1]["acceptance"]["num_drafts"]
    assert cand.text == raw["legs"][1]["output"]["text"]
    c = r.comparison("primary", "candidate", b_backend="vllm-ngram")
    assert c is not None and c.exact_match == raw["comparisons"][0]["exact_match"]
    assert r.comparison("primary", "candidate", b_backend="another") is None
    assert r.policy_rule == "mirror-all" and r.rollout_stage is None
    # what the counterfactual matrix reads: the ids, the captured texts, the servers
    t = r.tokens
    assert t is not None and (t.prompt, t.output) == ([1, 2, 3], [4, 5])
    assert t.drafters == {"drafter": [4, 6]} and t.legs == {"vllm-ngram": [4, 5]}
    assert t.leg == "primary" and t.output_source == "engine"
    assert t.output_tokens_reported == raw["legs"][0]["output_tokens"]
    assert r.request_text == raw["request"]["text"] and r.request_text
    assert cand.server_address == raw["legs"][1]["server_address"]
    spec = cand.speculative
    assert spec is not None and spec.prompt_lookup_min is None is spec.prompt_lookup_max
    assert read({**raw, "tokens": None}).tokens is None
    bad = read({**raw, "tokens": {"prompt": [1, True], "output": "x", "legs": {"b": [1.5]}}}).tokens
    assert bad is not None and bad.prompt is None and bad.output is None and bad.legs == {}


def test_a_failed_leg_is_not_ok_and_says_why() -> None:
    failed = make_leg("candidate", backend="c", status=503, recording=make_recording())
    raw = dict(build_evidence(make_exchange(shadows=(failed,))).record)
    leg = read(raw).candidate_leg("c")
    assert leg is not None and not leg.ok and leg.status == 503


@pytest.mark.parametrize(
    "bad", [True, "3", float("nan"), float("inf"), [1], {"x": 1}, None], ids=repr
)
def test_a_value_of_the_wrong_type_reads_as_none(bad: Any) -> None:
    raw = written()
    leg = dict(raw["legs"][1])
    leg.update(e2e_s=bad, status=bad, share=bad, load={"per_replica_rate_rps": bad})
    r = read({**raw, "legs": [raw["legs"][0], leg, "not a leg"], "started_unix_ns": bad})
    cand = r.candidate_leg(None)
    assert cand is not None
    assert cand.e2e_s is None and cand.status is None and cand.share is None
    assert cand.load.per_replica_rate_rps is None
    assert r.started_unix_ns == 0 and len(r.legs) == 2


def test_missing_category_and_backend_read_as_the_wide_rows_defaults() -> None:
    r = read({"legs": [{"role": "candidate"}], "category": None})
    assert r.category == "uncategorized"
    assert r.legs[0].backend == ""
    assert read({}).legs == () and read({}).primary is None


# -- the wide row reads what the reader reads ----------------------------------------------

EXCHANGE_READ: dict[str, Callable[[Record], Any]] = {
    "exchange_id": lambda r: r.exchange_id,
    "time_unix_ns": lambda r: r.started_unix_ns,
    "schema": lambda r: r.schema,
    "category": lambda r: r.raw.get("category"),  # the column keeps null; the reader names it
    "served_by": lambda r: r.raw.get("served_by"),  # the column keeps null; SQL reads ifNull
    "rollout_stage": lambda r: r.rollout_stage,
    "rollout_episode": lambda r: r.rollout_episode,
    "policy_rule": lambda r: r.policy_rule,
    "sampled": lambda r: int(r.sampling.sampled),
    "output_length_bucket": lambda r: r.output_length_bucket,
    "speculation_skip": lambda r: r.speculation_skip,
    "candidates": lambda r: list(r.sampling.candidates),
    "dropped_backends": lambda r: [d.backend for d in r.sampling.dropped],
    "dropped_roles": lambda r: [d.role or "" for d in r.sampling.dropped],
    "dropped_reasons": lambda r: [d.reason for d in r.sampling.dropped],
}
LEG_READ: dict[str, Callable[[Leg], Any]] = {
    "role": lambda leg: leg.role or "",
    "backend": lambda leg: leg.backend,
    "outcome": lambda leg: leg.outcome,
    "status": lambda leg: leg.status,
    "ttft_s": lambda leg: leg.ttft_s,
    "tpot_s": lambda leg: leg.tpot_s,
    "e2e_s": lambda leg: leg.e2e_s,
    "output_tokens": lambda leg: leg.output_tokens,
    "share": lambda leg: leg.share,
    "in_flight": lambda leg: leg.load.in_flight,
    "per_replica_rate_rps": lambda leg: leg.load.per_replica_rate_rps,
    "num_requests_running": lambda leg: (s := leg.load.scraped) and s.num_requests_running,
    "load_parity": lambda leg: leg.load_parity,
    "method": lambda leg: (s := leg.speculative) and s.method,
    "num_speculative_tokens": lambda leg: (
        None if (s := leg.speculative) is None or s.num_speculative_tokens is None
        else float(s.num_speculative_tokens)
    ),
    "tokens_per_pass": lambda leg: leg.acceptance.tokens_per_pass,
    "mean_acceptance_length": lambda leg: leg.acceptance.mean_acceptance_length,
    "num_drafts": lambda leg: leg.acceptance.num_drafts,
    "num_draft_tokens": lambda leg: leg.acceptance.num_draft_tokens,
    "num_accepted_tokens": lambda leg: leg.acceptance.num_accepted_tokens,
    "output_sha256": lambda leg: leg.output_sha256,
    "similarity": lambda leg: (q := leg.quality) and q.similarity,
    "refusal": lambda leg: None if (q := leg.quality) is None or q.refusal is None
    else int(q.refusal),
    "error_type": lambda leg: leg.error_type,
}  # fmt: skip


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def test_every_wide_column_the_report_aggregates_reads_what_the_reader_reads() -> None:
    raw = written()
    r = read(raw)
    checked = 0
    for c in EXCHANGE_COLUMNS:
        if c.name in EXCHANGE_READ:
            assert same(c.value(raw), EXCHANGE_READ[c.name](r)), c.name
            checked += 1
    for c in LEG_COLUMNS:
        if c.name in LEG_READ:
            for leg_raw, leg in zip(raw["legs"], r.legs, strict=True):
                assert same(c.value(leg_raw), LEG_READ[c.name](leg)), c.name
            checked += 1
    # every column the SQL report reads has its reader twin here
    from report import sql

    text = Path(sql.__file__).read_text()
    used = {c.name for c in EXCHANGE_COLUMNS if c.name in text}
    used |= {c.name for c in LEG_COLUMNS if f"legs_{c.name}" in text}
    assert used <= {*EXCHANGE_READ, *LEG_READ}, sorted(used - {*EXCHANGE_READ, *LEG_READ})
    assert checked == len(EXCHANGE_READ) + len(LEG_READ)


# -- the test builders write the writer's shape ---------------------------------------------


def test_the_report_test_builders_write_only_fields_the_writer_writes() -> None:
    writer = paths(written()) | OPTIONAL
    built = synthetic.several(
        {"a": {"speedups": {"chat": 1.5}}, "b": {"speedups": {"chat": 1.2}}}, n=2
    ) + synthetic.records(speedups={"chat": 1.4}, n=2)
    extra = set().union(*(paths(r) for r in built)) - writer
    assert not extra, sorted(extra)
    views = read_all(built)
    assert all(v.candidate_leg(None) is not None for v in views)


def test_the_writer_writes_exactly_the_declared_fields() -> None:
    """records.reader declares every field of a record (records.fields); the writer writes no
    other and the declaration holds none the writer never writes. A field added to one side only
    fails here, naming it."""
    raw = written()
    declared = set(declared_paths(Record))
    opaque = set(opaque_paths(Record))

    def inside_opaque(path: tuple[str, ...]) -> bool:
        return any(path[: len(o)] == o and len(path) > len(o) for o in opaque)

    wrote = {p for p in paths(raw) if not inside_opaque(p)}
    assert not wrote - declared, sorted(wrote - declared)
    never = declared - wrote - OPTIONAL - WRITTEN_ELSEWHERE
    assert not never, sorted(never)


# Declared paths this fixture's exchange does not produce but the writer does write elsewhere.
WRITTEN_ELSEWHERE = {
    ("legs", "[]", "tokens_reported", "count"),  # a leg recounted by evidence.counts
    ("legs", "[]", "tokens_reported", "source"),
    ("likelihood", "scorer"),  # the likelihood scorer's exchanges
    ("legs", "[]", "load", "scraped", "age_s"),
}


def test_the_record_carries_the_rollout_episode_the_exchange_was_dispatched_in() -> None:
    """Issue 36: the exchange's rollout episode (stamped at dispatch) reaches the record, the
    reader and the wide row — evidence → record, declared once."""
    from records.wide import wide_row

    ex = dataclasses.replace(
        make_exchange(), rollout_stage="canary", rollout_episode="ep-7", failover=None
    )
    raw = build_record(build_evidence(ex, capture_default=FULL), capture=FULL)
    assert raw["rollout"] == {"stage": "canary", "failover": None, "episode": "ep-7"}
    r = read(raw)
    assert (r.rollout_stage, r.rollout_episode) == ("canary", "ep-7")
    assert wide_row(raw)["rollout_episode"] == "ep-7"
    outside = build_record(build_evidence(make_exchange(), capture_default=FULL), capture=FULL)
    assert outside["rollout"] is None and read(outside).rollout_episode is None
    assert wide_row(outside)["rollout_episode"] is None
