"""TelemetrySettings.from_env: the standard OTEL_* variables, table-driven, errors name the variable."""

from __future__ import annotations

import pytest

from otel.settings import OtlpTarget, TelemetrySettings
from otel.setup import build_telemetry


def test_defaults_export_nothing_over_otlp_but_serve_prometheus() -> None:
    settings = TelemetrySettings.from_env({})
    assert settings.enabled and settings.prometheus
    assert settings.traces is None and settings.metrics is None
    assert settings.service_name == "specshadow"
    assert settings.sampler == "parentbased_always_on"


def test_generic_endpoint_gets_signal_paths_for_http_protobuf() -> None:
    settings = TelemetrySettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
    assert settings.traces == OtlpTarget(
        "http://collector:4318/v1/traces", "http/protobuf", {}, 3.0
    )
    assert (
        settings.metrics is not None
        and settings.metrics.endpoint == "http://collector:4318/v1/metrics"
    )


def test_signal_specific_endpoint_protocol_and_headers_win() -> None:
    settings = TelemetrySettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4317",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=a,authorization=Bearer%20t0k",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=b",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
        }
    )
    assert settings.traces == OtlpTarget(
        "http://tempo:4317", "grpc", {"x-tenant": "b", "authorization": "Bearer t0k"}, 1.5
    )
    assert settings.metrics is not None and settings.metrics.protocol == "http/protobuf"
    assert settings.metrics.headers == {"x-tenant": "a", "authorization": "Bearer t0k"}


def test_grpc_endpoint_is_used_as_given_and_defaults_to_4317() -> None:
    settings = TelemetrySettings.from_env(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert settings.traces is not None and settings.traces.endpoint == "http://localhost:4317"
    assert settings.metrics is None  # OTEL_METRICS_EXPORTER unset and no endpoint


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({"OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_SDK_DISABLED": "false"}, True),
        ({"SPECSHADOW_TELEMETRY": "off"}, False),
        ({"SPECSHADOW_TELEMETRY": "on"}, True),
    ],
)
def test_telemetry_can_be_switched_off(environ: dict[str, str], enabled: bool) -> None:
    assert TelemetrySettings.from_env(environ).enabled is enabled


def test_metrics_exporter_prometheus_serves_metrics_without_otlp() -> None:
    settings = TelemetrySettings.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "prometheus"}
    )
    assert settings.prometheus and settings.metrics is None and settings.traces is not None


def test_exporter_none_turns_a_signal_off_even_with_an_endpoint() -> None:
    settings = TelemetrySettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
        }
    )
    assert settings.traces is None and settings.metrics is None and not settings.prometheus


def test_service_name_and_resource_attributes() -> None:
    settings = TelemetrySettings.from_env(
        {
            "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=prod,team=ml%2Cinfra"
        }
    )
    assert settings.service_name == "from-attrs"
    assert settings.resource_attributes == {"deployment.environment": "prod", "team": "ml,infra"}
    named = TelemetrySettings.from_env(
        {"OTEL_SERVICE_NAME": "gw", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}
    )
    assert named.service_name == "gw"


def test_sampler_ratio_and_intervals() -> None:
    settings = TelemetrySettings.from_env(
        {
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_METRIC_EXPORT_INTERVAL": "5000",
            "OTEL_BSP_MAX_QUEUE_SIZE": "64",
        }
    )
    assert (settings.sampler, settings.sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert settings.metric_export_interval_s == 5.0 and settings.span_queue_size == 64


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_HEADERS": "novalue"},
            "OTEL_EXPORTER_OTLP_HEADERS",
        ),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL"),
    ],
)
def test_invalid_values_are_rejected_naming_the_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TelemetrySettings.from_env(environ)


def test_disabled_telemetry_is_a_no_op_everywhere() -> None:
    telemetry = build_telemetry(TelemetrySettings(enabled=False))
    assert not telemetry.enabled
    span = telemetry.start_request_span(route="/v1/chat/completions", method="POST", carrier={})
    assert not span.is_recording()
    assert telemetry.traceparent_headers(span) == {}
    assert telemetry.force_flush(1.0) and telemetry.shutdown(1.0)


def test_the_telemetry_switch_takes_fixed_words_and_names_itself() -> None:
    import pytest

    assert not TelemetrySettings.from_env({"SPECSHADOW_TELEMETRY": "false"}).enabled
    with pytest.raises(ValueError, match="SPECSHADOW_TELEMETRY: expected on/off"):
        TelemetrySettings.from_env({"SPECSHADOW_TELEMETRY": "sometimes"})
