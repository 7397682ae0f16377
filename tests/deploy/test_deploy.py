"""Deployment files are read, not run (no Docker engine or cluster here): they parse, reference
files that exist, agree with the CLI and with each other, and the dashboard queries only metrics and
labels the gateway's /metrics actually exposes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from policies.parse import read_yaml, validate_policy
from tests.otel.exchanges import make_exchange
from tests.receivers.prometheus import PROMTOOL, requires_promtool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specshadow.json"
SERVE_ARGS = [
    "specshadow",
    "serve",
    "--host",
    "0.0.0.0",
    "--port",
    "8080",
    "--policy",
    "/etc/specshadow/policy.yaml",
]

PROMQL_WORDS = {
    # functions and aggregations used (or plausibly used) in dashboards
    "histogram_quantile", "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "by",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "topk",
    "bottomk", "clamp_min", "clamp_max", "abs", "label_values", "offset", "bool", "delta", "deriv",
    "avg_over_time", "max_over_time", "min_over_time", "quantile", "vector", "scalar", "time",
    "label_replace",
}  # fmt: skip


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture(scope="module")
def exposition() -> dict[str, set[str]]:
    """Sample name → label names, from a Telemetry after one synthetic exchange and every counter
    (GenAI metrics under both generations of names, as the dashboard reads either)."""
    telemetry = build_telemetry(TelemetrySettings(genai_names="both"))
    telemetry.record_exchange_metrics(make_exchange())
    telemetry.count_shadow("dropped", role="candidate", backend="candidate", reason="budget")
    telemetry.set_breaker_state("candidate", 0)
    telemetry.count_policy_reload("ok")
    telemetry.bind_policy_status(lambda: (1, True))
    telemetry.count_comparison("match", role="candidate", category="chat")
    telemetry.count_telemetry_dropped("spans", "queue_full", 1)
    body, _ = telemetry.render_prometheus()
    assert telemetry.shutdown(5.0)
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["definition"]


def promql_references(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, labels used in matchers of those metrics, labels used in by/without)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (regexes, $vars) out
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    grouping: set[str] = set()
    for match in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouping.update(label.strip() for label in match.group(1).split(",") if label.strip())
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", expr)
    matcher_labels: set[str] = set()
    for match in re.finditer(r"\{([^}]*)\}", expr):
        matcher_labels.update(
            re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", match.group(1))
        )
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    names = {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_WORDS}
    # label_values(metric, label): the second argument is a label
    for _metric, label in re.findall(
        r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*([a-zA-Z_]\w*)\s*\)", expr
    ):
        names.discard(label)
        grouping.add(label)
    return names, matcher_labels, grouping


def test_every_yaml_and_json_file_parses() -> None:
    assert len(yaml_files()) >= 10
    for path in yaml_files():
        assert load_all(path), path
    json.loads(DASHBOARD.read_text())


def test_promql_reference_extraction_sees_metrics_and_labels() -> None:
    names, matchers, grouping = promql_references(
        'histogram_quantile(0.5, sum by (le, specshadow_leg_role) (rate(x_bucket{gen_ai_request_model=~"$model"}[$__rate_interval])))'
    )
    assert (names, matchers, grouping) == (
        {"x_bucket"},
        {"gen_ai_request_model"},
        {"le", "specshadow_leg_role"},
    )


def test_every_dashboard_query_uses_metrics_and_labels_the_gateway_exposes(
    exposition: dict[str, set[str]],
) -> None:
    checked = 0
    for title, expr in dashboard_exprs():
        names, matchers, grouping = promql_references(expr)
        assert names, f"{title}: no metric in {expr!r}"
        for name in names:
            assert name in exposition, f"{title}: {name} is not exposed by the gateway"
            missing = matchers - exposition[name]
            assert not missing, f"{title}: {name} has no label(s) {missing}"
        available = set().union(*(exposition[n] for n in names)) | {"le"}
        assert grouping <= available, (
            f"{title}: grouping labels {grouping - available} do not exist"
        )
        checked += 1
    assert checked >= 20


def test_dashboard_covers_the_panels_sres_asked_for() -> None:
    exprs = " ".join(expr for _title, expr in dashboard_exprs())
    for metric in (
        "gen_ai_client_operation_time_to_first_chunk_seconds_bucket",
        "specshadow_time_per_output_token_seconds_bucket",
        "gen_ai_client_operation_time_per_output_chunk_seconds_bucket",
        "specshadow_tokens_per_event_sum",
        "specshadow_acceptance_length_sum",
        "specshadow_compare_results_total",
        "specshadow_shadow_requests_total",
        "specshadow_gateway_overhead_seconds_bucket",
        "specshadow_policy_reload_total",
        "specshadow_policy_last_reload_success",
    ):
        assert metric in exprs, metric
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, specshadow_leg_role)" in exprs


def test_every_genai_panel_reads_the_default_and_the_latest_names() -> None:
    legacy_to_latest = {
        "gen_ai_client_operation_time_to_first_chunk_seconds": "gen_ai_client_inference_time_to_first_chunk_seconds",
        "gen_ai_client_operation_time_per_output_chunk_seconds": "gen_ai_client_inference_time_per_output_chunk_seconds",
        "gen_ai_client_operation_duration_seconds": "gen_ai_client_inference_duration_seconds",
        "gen_ai_client_token_usage": "gen_ai_client_inference_usage_output_tokens_total",
    }
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        exprs = " ".join(target["expr"] for target in panel.get("targets", []))
        for legacy, latest in legacy_to_latest.items():
            if legacy in exprs:
                assert latest in exprs, f"{panel['title']}: reads {legacy} but not {latest}"
                checked += 1
    assert checked >= 5


def test_grafana_provisioning_points_at_the_dashboard_and_datasource() -> None:
    providers = load_all(DEPLOY / "grafana/provisioning/dashboards/dashboards.yaml")[0]["providers"]
    datasources = load_all(DEPLOY / "grafana/provisioning/datasources/datasources.yaml")[0][
        "datasources"
    ]
    compose = load_all(DEPLOY / "compose.yaml")[0]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == providers[0]["options"]["path"]
    assert {d["type"] for d in datasources} == {"prometheus", "jaeger"}
    assert json.loads(DASHBOARD.read_text())["templating"]["list"][0]["current"]["value"] in {
        d["uid"] for d in datasources
    }


def test_compose_has_every_service_and_references_files_that_exist() -> None:
    compose = load_all(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    assert set(services) >= {
        "gateway",
        "vllm-primary",
        "vllm-candidate",
        "otel-collector",
        "jaeger",
        "prometheus",
        "grafana",
    }
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build is not None:
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT and (context / build["dockerfile"]).is_file(), name
    assert "--speculative-config" in " ".join(services["vllm-candidate"]["command"])


def test_compose_gateway_runs_the_cli_with_its_policy_mounted_as_a_directory() -> None:
    gateway = load_all(DEPLOY / "compose.yaml")[0]["services"]["gateway"]
    assert gateway["command"] == SERVE_ARGS
    (mount,) = gateway["volumes"]
    source, target, _mode = mount.split(":")
    assert target == "/etc/specshadow" and (DEPLOY / source / "policy.yaml").is_file()
    assert gateway["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith(
        "http://otel-collector:"
    )
    prometheus = load_all(DEPLOY / "prometheus/prometheus.yml")[0]
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert "gateway:8080" in targets


def test_policy_files_validate_against_the_policy_schema() -> None:
    validate_policy(
        read_yaml((DEPLOY / "policy/policy.yaml").read_text(), source="deploy"), source="deploy"
    )
    configmap = load_all(DEPLOY / "k8s/policy-configmap.yaml")[0]
    validate_policy(read_yaml(configmap["data"]["policy.yaml"], source="k8s"), source="k8s")


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_all(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_kubernetes_gateway_mounts_the_policy_configmap_as_a_directory() -> None:
    objects = k8s_objects()
    deployment = objects[("Deployment", "specshadow")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == SERVE_ARGS
    (mount,) = container["volumeMounts"]
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    assert mount["mountPath"] == str(Path(SERVE_ARGS[-1]).parent)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert ("ConfigMap", volume["configMap"]["name"]) in objects
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    service = objects[("Service", "specshadow")]
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert ("Service", "otel-collector") in objects


def test_kustomization_lists_every_manifest_and_collector_config_matches_compose() -> None:
    kustomization = load_all(DEPLOY / "k8s/kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    configmap = k8s_objects()[("ConfigMap", "otel-collector-config")]
    assert (
        yaml.safe_load(configmap["data"]["config.yaml"])
        == load_all(DEPLOY / "otel-collector/config.yaml")[0]
    )


def test_collector_pipelines_use_only_defined_components() -> None:
    config = load_all(DEPLOY / "otel-collector/config.yaml")[0]
    for name, pipeline in config["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"{name}: {kind} {component} is not defined"


@requires_promtool
def test_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "config", "--syntax-only", str(DEPLOY / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + shlex.join(proc.args)


def test_the_image_copies_every_product_package_and_installs_no_extra() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.M))
    packages = set(re.findall(r'"(\w+)\*"', (ROOT / "pyproject.toml").read_text()))
    assert copied == packages  # pyproject's [tool.setuptools.packages.find] include list
    installs = re.findall(r"pip install [^\n]*", dockerfile)
    assert installs == ["pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels"]  # no [extra]
