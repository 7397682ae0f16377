"""Metrics from hand-built exchanges: right instruments, right attributes, never an id or text."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel import semconv as sc
from otel.instruments import CHUNK_GAP_BUCKETS_S, OVERHEAD_BUCKETS_S
from tests.otel.conftest import InMemoryTelemetry
from tests.otel.exchanges import make_exchange, make_leg, make_recording, make_timings


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def only(found: dict[str, list[Any]], name: str, **attrs: str) -> Any:
    matching = [
        p for p in found.get(name, []) if all(p.attributes.get(k) == v for k, v in attrs.items())
    ]
    assert len(matching) == 1, (name, attrs, [p.attributes for p in found.get(name, [])])
    return matching[0]


def role(value: str) -> dict[str, str]:
    return {sc.LEG_ROLE: value}


def test_every_leg_feeds_the_genai_client_histograms(mem: InMemoryTelemetry) -> None:
    mem.telemetry.record_exchange_metrics(make_exchange())
    found = points(mem.reader)
    for leg_role in ("primary", "candidate", "baseline"):
        duration = only(found, sc.METRIC_OPERATION_DURATION, **{sc.LEG_ROLE: leg_role})
        assert duration.count == 1 and duration.sum == pytest.approx(0.05)
        assert dict(duration.attributes) == {
            sc.GEN_AI_OPERATION_NAME: "chat",
            sc.GEN_AI_REQUEST_MODEL: "tiny-llama",
            sc.LEG_ROLE: leg_role,
            sc.BACKEND: {"primary": "primary", "candidate": "vllm-ngram", "baseline": "vllm-plain"}[
                leg_role
            ],
        }
        assert only(
            found, sc.METRIC_TIME_TO_FIRST_CHUNK, **{sc.LEG_ROLE: leg_role}
        ).sum == pytest.approx(0.02)
        assert only(
            found, sc.METRIC_TIME_PER_OUTPUT_TOKEN, **{sc.LEG_ROLE: leg_role}
        ).sum == pytest.approx(0.003)
        gaps = only(found, sc.METRIC_TIME_PER_OUTPUT_CHUNK, **{sc.LEG_ROLE: leg_role})
        assert gaps.count == 3 and gaps.sum == pytest.approx(0.012)  # one observation per chunk gap
        tokens_in = only(
            found, sc.METRIC_TOKEN_USAGE, **{sc.LEG_ROLE: leg_role, sc.GEN_AI_TOKEN_TYPE: "input"}
        )
        tokens_out = only(
            found, sc.METRIC_TOKEN_USAGE, **{sc.LEG_ROLE: leg_role, sc.GEN_AI_TOKEN_TYPE: "output"}
        )
        assert (tokens_in.sum, tokens_out.sum) == (7, 10)
        tpe = only(found, sc.METRIC_TOKENS_PER_EVENT, **{sc.LEG_ROLE: leg_role})
        assert tpe.sum == pytest.approx(2.5) and tpe.attributes[sc.CATEGORY] == "chat"


def test_chunk_gap_buckets_resolve_milliseconds_and_overhead_buckets_microseconds() -> None:
    assert sum(1 for b in CHUNK_GAP_BUCKETS_S if 0.001 <= b <= 0.01) >= 8
    assert (
        OVERHEAD_BUCKETS_S[0] <= 0.000025 and sum(1 for b in OVERHEAD_BUCKETS_S if b < 0.001) >= 5
    )


def test_chunk_gap_observations_are_bounded_per_leg(mem: InMemoryTelemetry) -> None:
    many = make_recording(timings=make_timings(chunk_gaps_s=(0.001,) * 5000))
    exchange = replace(make_exchange(shadows=()), primary=make_leg(recording=many))
    mem.telemetry.record_exchange_metrics(exchange)
    gaps = only(points(mem.reader), sc.METRIC_TIME_PER_OUTPUT_CHUNK)
    assert 100 <= gaps.count <= 128  # an even stride through all 5000, at most 128


def test_acceptance_length_is_recorded_by_category_for_legs_that_report_it(
    mem: InMemoryTelemetry,
) -> None:
    mem.telemetry.record_exchange_metrics(make_exchange(category="code"))
    found = points(mem.reader)
    accepted = only(found, sc.METRIC_ACCEPTANCE_LENGTH)
    assert accepted.sum == pytest.approx(3.9)
    assert (
        accepted.attributes[sc.LEG_ROLE] == "candidate"
        and accepted.attributes[sc.CATEGORY] == "code"
    )


def test_overhead_records_the_recorders_p50_p99_and_max(mem: InMemoryTelemetry) -> None:
    mem.telemetry.record_exchange_metrics(make_exchange(shadows=()))
    found = points(mem.reader)
    stats = {p.attributes[sc.OVERHEAD_STAT]: p.sum for p in found[sc.METRIC_GATEWAY_OVERHEAD]}
    assert stats == pytest.approx({"p50": 0.00004, "p99": 0.0002, "max": 0.0003})


def test_failed_legs_count_as_failed_shadows_with_error_type_on_duration(
    mem: InMemoryTelemetry,
) -> None:
    failed = make_leg(
        "candidate",
        outcome="upstream_timeout",
        error_type="UpstreamTimeout",
        status=None,
        with_recording=False,
    )
    mem.telemetry.record_exchange_metrics(make_exchange(shadows=(failed, make_leg("baseline"))))
    found = points(mem.reader)
    duration = only(found, sc.METRIC_OPERATION_DURATION, **role("candidate"))
    assert duration.attributes[sc.ERROR_TYPE] == "UpstreamTimeout"
    assert duration.sum == pytest.approx(0.06)  # no output: t0 → leg end
    assert (
        only(found, sc.METRIC_SHADOW_REQUESTS, **{sc.OUTCOME: "failed"}).attributes[sc.REASON]
        == "upstream_timeout"
    )
    assert (
        only(found, sc.METRIC_SHADOW_REQUESTS, **{sc.OUTCOME: "completed"}).attributes[sc.LEG_ROLE]
        == "baseline"
    )
    assert sc.METRIC_TIME_TO_FIRST_CHUNK not in [
        n
        for n, ps in found.items()
        if any(p.attributes.get(sc.LEG_ROLE) == "candidate" for p in ps)
    ]


def test_metric_attributes_never_carry_ids_or_text(mem: InMemoryTelemetry) -> None:
    mem.telemetry.record_exchange_metrics(make_exchange())
    mem.telemetry.count_comparison("diverge", role="candidate", category="chat")
    forbidden = {
        sc.REQUEST_ID,
        sc.EXCHANGE_ID,
        sc.GEN_AI_RESPONSE_ID,
        sc.GEN_AI_OUTPUT_MESSAGES,
        sc.GEN_AI_INPUT_MESSAGES,
    }
    for name, ps in points(mem.reader).items():
        for p in ps:
            assert not forbidden & set(p.attributes), name
            assert not any(v in ("req-1", "ex-1", "Hello world") for v in p.attributes.values()), (
                name
            )


def test_shadow_breaker_policy_and_comparison_counters(mem: InMemoryTelemetry) -> None:
    t = mem.telemetry
    t.count_shadow("sampled", role="candidate", backend="spec")
    t.count_shadow("dropped", role="candidate", backend="spec", reason="budget")
    t.count_shadow("dropped", role="candidate", backend="spec", reason="budget")
    t.set_breaker_state("spec", sc.BREAKER_OPEN)
    t.count_policy_reload("ok")
    t.count_policy_reload("error")
    t.count_comparison("match", role="baseline", category=None)
    generation = {"value": 4}
    t.bind_policy_status(lambda: (generation["value"], False))
    found = points(mem.reader)
    assert only(found, sc.METRIC_SHADOW_REQUESTS, **{sc.OUTCOME: "dropped"}).value == 2
    assert only(found, sc.METRIC_SHADOW_REQUESTS, **{sc.OUTCOME: "sampled"}).value == 1
    assert only(found, sc.METRIC_BREAKER_STATE, **{sc.BACKEND: "spec"}).value == 2
    assert only(found, sc.METRIC_POLICY_RELOAD, **{sc.RESULT: "error"}).value == 1
    assert only(found, sc.METRIC_COMPARE_RESULTS).attributes[sc.CATEGORY] == "uncategorized"
    assert only(found, sc.METRIC_POLICY_GENERATION).value == 4
    assert only(found, sc.METRIC_POLICY_LAST_RELOAD_SUCCESS).value == 0
    generation["value"] = 5
    assert (
        only(points(mem.reader), sc.METRIC_POLICY_GENERATION).value == 5
    )  # read at collection time


def test_a_policy_status_callable_that_raises_yields_no_gauge_and_no_error(
    mem: InMemoryTelemetry,
) -> None:
    def broken() -> tuple[int, bool]:
        raise RuntimeError("policy holder not ready")

    mem.telemetry.bind_policy_status(broken)
    mem.telemetry.count_policy_reload("ok")
    found = points(mem.reader)
    assert sc.METRIC_POLICY_GENERATION not in found
