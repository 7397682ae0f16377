"""Process settings are strict: fixed words for booleans, ranges, unknown names rejected, and
every error names the variable or flag it came from."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False),
     ("true", True), ("1", True), ("Yes", True), ("on", True)],
)  # fmt: skip
def test_booleans_take_a_fixed_set_of_words(raw: str, expected: bool) -> None:
    assert Settings.from_env({"SPECSHADOW_RELOAD_ON_SIGHUP": raw}).reload_on_sighup is expected


def test_a_boolean_outside_the_set_names_its_variable() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"SPECSHADOW_RELOAD_ON_SIGHUP": "maybe"})
    assert info.value.problems == [
        "SPECSHADOW_RELOAD_ON_SIGHUP: expected true/false (or 1/0, yes/no, on/off), got 'maybe'"
    ]


def test_an_unknown_specshadow_variable_is_rejected_with_the_closest_name() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"SPECSHADOW_POLICY_POLL": "3"})
    (problem,) = info.value.problems
    assert problem.startswith(
        "SPECSHADOW_POLICY_POLL: unknown setting; did you mean SPECSHADOW_POLICY_POLL_S?"
    )


def test_variables_other_parts_read_and_foreign_ones_are_left_alone() -> None:
    env = {"SPECSHADOW_TELEMETRY": "off", "SPECSHADOW_CACHE": "/tmp/x", "OTHER_THING": "1"}
    assert Settings.from_env(env) == Settings()


def test_kubernetes_service_links_for_a_service_named_specshadow_are_left_alone() -> None:
    # What a pod gets when deploy/k8s's Service "specshadow" exists before the pod starts.
    links = {
        "SPECSHADOW_SERVICE_HOST": "10.96.0.12",
        "SPECSHADOW_SERVICE_PORT": "8080",
        "SPECSHADOW_SERVICE_PORT_HTTP": "8080",
        "SPECSHADOW_PORT": "tcp://10.96.0.12:8080",
        "SPECSHADOW_PORT_8080_TCP": "tcp://10.96.0.12:8080",
        "SPECSHADOW_PORT_8080_TCP_PROTO": "tcp",
        "SPECSHADOW_PORT_8080_TCP_PORT": "8080",
        "SPECSHADOW_PORT_8080_TCP_ADDR": "10.96.0.12",
    }
    assert Settings.from_env(links) == Settings()
    # A port the user sets is still a port, and a near miss of a link is still a typo.
    assert Settings.from_env({**links, "SPECSHADOW_PORT": "9000"}).port == 9000
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"SPECSHADOW_PORT": "tcp9000"})
    assert info.value.problems == ["SPECSHADOW_PORT: expected an integer, got 'tcp9000'"]
    with pytest.raises(SettingsError):
        Settings.from_env({"SPECSHADOW_SERVICE_HOSTS": "x"})


def test_every_specshadow_variable_the_check_scripts_name_is_one_the_gateway_knows() -> None:
    # The tests start gateways that inherit scripts/check's environment: a SPECSHADOW_* variable
    # set there that the gateway does not know stops every one of them (it once failed CI).
    known = set(Settings.known_variables())
    for path in [ROOT / ".ci" / "run", *sorted((ROOT / "scripts").iterdir())]:
        if path.is_file():
            names = set(re.findall(r"\bSPECSHADOW_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
            assert names <= known, f"{path.relative_to(ROOT)}: {sorted(names - known)}"


def test_every_problem_is_reported_at_once_each_naming_its_variable() -> None:
    env = {
        "SPECSHADOW_PORT": "70000",
        "SPECSHADOW_MAX_BODY_BYTES": "lots",
        "SPECSHADOW_UPSTREAM_IDLE_TIMEOUT_S": "0",
        "SPECSHADOW_UPSTREAM_KEEPALIVE_S": "-1",
        "SPECSHADOW_SHADOW_RATIO": "1.5",
    }
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    # Parse errors first (nothing can be range-checked before every value parses).
    assert info.value.problems == ["SPECSHADOW_MAX_BODY_BYTES: expected an integer, got 'lots'"]
    del env["SPECSHADOW_MAX_BODY_BYTES"]
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    assert sorted(info.value.problems) == [
        "SPECSHADOW_PORT: must be 0–65535, got 70000",
        "SPECSHADOW_SHADOW_RATIO: must be between 0 and 1, got 1.5",
        "SPECSHADOW_UPSTREAM_IDLE_TIMEOUT_S: must be positive, got 0.0",
        "SPECSHADOW_UPSTREAM_KEEPALIVE_S: must be positive, got -1.0",
    ]


def test_a_flag_overrides_the_environment_and_is_named_in_its_error() -> None:
    env = {"SPECSHADOW_PORT": "9000", "SPECSHADOW_UPSTREAM_CONNECT_TIMEOUT_S": "3"}
    settings = Settings.from_env(env, port=9100, upstream_idle_timeout_s=7.5)
    assert (settings.port, settings.upstream.idle_timeout_s) == (9100, 7.5)
    assert settings.upstream.connect_timeout_s == 3.0
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env, flags={"port": "--port"}, port=-1)
    assert info.value.problems == ["--port: must be 0–65535, got -1"]


def test_optional_and_tuple_fields_parse() -> None:
    settings = Settings.from_env(
        {"SPECSHADOW_SHADOW_URLS": "http://a:1, http://b:2", "SPECSHADOW_GIL_SWITCH_INTERVAL_S": ""}
    )
    assert settings.shadow_urls == ("http://a:1", "http://b:2")
    assert settings.gil_switch_interval_s is None


def test_serve_fails_fast_with_one_line_per_problem_and_no_traceback() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specshadow",
            "serve",
            "--primary",
            "http://127.0.0.1:9",
            "--port",
            "99999",
        ],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "SPECSHADOW_RELOAD_ON_SIGHUP": "nope",
            "SPECSHADOW_TELEMETRY": "off",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "specshadow serve: SPECSHADOW_RELOAD_ON_SIGHUP: expected true/false (or 1/0, yes/no, on/off), got 'nope'"
    ]
    assert "Traceback" not in out.stderr
