"""GET /metrics rendering: OTel → Prometheus names, cumulative buckets, promtool, per-app isolation."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel.prometheus import CONTENT_TYPE, label_name, metric_name, render
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from tests.otel.conftest import InMemoryTelemetry
from tests.otel.exchanges import make_exchange
from tests.receivers.prometheus import promtool_check_metrics, requires_promtool

EXPECTED_FAMILIES = {
    "gen_ai_client_operation_duration_seconds": "histogram",
    "gen_ai_client_operation_time_to_first_chunk_seconds": "histogram",
    "gen_ai_client_operation_time_per_output_chunk_seconds": "histogram",
    "gen_ai_client_token_usage": "histogram",
    "specshadow_time_per_output_token_seconds": "histogram",
    "specshadow_gateway_overhead_seconds": "histogram",
    "specshadow_tokens_per_event": "histogram",
    "specshadow_acceptance_length": "histogram",
    "specshadow_shadow_requests": "counter",
    "specshadow_shadow_breaker_state": "gauge",
    "specshadow_policy_generation": "gauge",
    "specshadow_policy_last_reload_success": "gauge",
    "specshadow_policy_reload": "counter",
    "specshadow_compare_results": "counter",
    "target_info": "gauge",
}


def populate(mem: InMemoryTelemetry) -> None:
    t = mem.telemetry
    t.record_exchange_metrics(make_exchange())
    t.count_shadow("dropped", role="candidate", backend="spec", reason="budget")
    t.set_breaker_state("spec", 0)
    t.count_policy_reload("ok")
    t.bind_policy_status(lambda: (2, True))
    t.count_comparison("match", role="candidate", category="chat")


@pytest.mark.parametrize(
    ("name", "unit", "counter", "expected"),
    [
        (
            "gen_ai.client.operation.duration",
            "s",
            False,
            "gen_ai_client_operation_duration_seconds",
        ),
        ("gen_ai.client.token.usage", "{token}", False, "gen_ai_client_token_usage"),
        ("specshadow.shadow.requests", "{request}", True, "specshadow_shadow_requests_total"),
        ("already_total", "", True, "already_total"),
        ("weird-name..x", "By", False, "weird_name_x_bytes"),
        ("ratio", "1", False, "ratio"),
    ],
)
def test_metric_names_follow_the_otel_to_prometheus_rules(
    name: str, unit: str, counter: bool, expected: str
) -> None:
    assert metric_name(name, unit, counter=counter) == expected


def test_label_names_replace_dots_and_guard_leading_digits() -> None:
    assert label_name("specshadow.leg.role") == "specshadow_leg_role"
    assert label_name("9lives") == "key_9lives"


def test_exposition_has_every_family_with_the_right_type(mem: InMemoryTelemetry) -> None:
    populate(mem)
    body, content_type = mem.telemetry.render_prometheus()
    assert content_type == CONTENT_TYPE
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert families == EXPECTED_FAMILIES


def test_histogram_buckets_are_cumulative_and_end_at_count(mem: InMemoryTelemetry) -> None:
    populate(mem)
    body, _ = mem.telemetry.render_prometheus()
    (ttft,) = [
        f
        for f in text_string_to_metric_families(body.decode())
        if f.name == "gen_ai_client_operation_time_to_first_chunk_seconds"
    ]
    primary = [s for s in ttft.samples if s.labels.get("specshadow_leg_role") == "primary"]
    buckets = [(float(s.labels["le"]), s.value) for s in primary if s.name.endswith("_bucket")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1] == (math.inf, 1.0)
    assert [v for le, v in buckets if le == 0.02] == [1.0] and [
        v for le, v in buckets if le == 0.015
    ] == [0.0]
    (total,) = [s.value for s in primary if s.name.endswith("_count")]
    assert total == 1.0


def test_label_values_are_escaped() -> None:
    telemetry = build_telemetry(
        TelemetrySettings(resource_attributes={"note": 'a "quoted"\\ line\nbreak'})
    )
    body, _ = telemetry.render_prometheus()
    (info,) = [f for f in text_string_to_metric_families(body.decode()) if f.name == "target_info"]
    assert info.samples[0].labels["note"] == 'a "quoted"\\ line\nbreak'
    assert telemetry.shutdown(5.0)


def test_two_telemetries_in_one_process_keep_separate_metrics(mem: InMemoryTelemetry) -> None:
    other = build_telemetry(TelemetrySettings(service_name="other"))
    populate(mem)
    body, _ = other.render_prometheus()
    assert b"gen_ai_client_operation_duration_seconds_bucket" not in body
    assert b'service_name="other"' in body
    assert other.shutdown(5.0)


def test_disabled_telemetry_renders_an_empty_exposition() -> None:
    telemetry = build_telemetry(TelemetrySettings(enabled=False))
    telemetry.record_exchange_metrics(make_exchange())
    assert telemetry.render_prometheus() == (b"", CONTENT_TYPE)
    assert render(None) == b""
    assert telemetry.shutdown(1.0)


@requires_promtool
def test_exposition_passes_promtool_check_metrics(mem: InMemoryTelemetry) -> None:
    populate(mem)
    mem.telemetry.count_telemetry_dropped("spans", "queue_full", 3)
    body, _ = mem.telemetry.render_prometheus()
    passed, output = promtool_check_metrics(body)
    assert passed, output
    assert output.strip() == "", output  # no lint warnings either
