"""``specshadow policy check|schema`` through the real CLI entry point (once as a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.model import render_json_schema
from specshadow.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def specshadow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specshadow", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_of_a_valid_file_exits_0_with_a_one_line_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["policy", "check", str(EXAMPLES / "production.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "ok — 4 rules (with default), 3 backends, sha256 " in lines[0]


def test_check_of_an_invalid_file_exits_1_with_the_field_path_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nrules:\n  - name: a\n    ratio: 1.5\n    legs: []\n")
    result = specshadow("policy", "check", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"{path}: rules[0].ratio: must be between 0 and 1, got 1.5\n"


def test_check_reports_kill_switch_and_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "check", str(EXAMPLES / "kill-switch.yaml")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("KILL SWITCH ON")
    assert main(["policy", "check", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read: No such file or directory" in capsys.readouterr().err


def test_schema_prints_the_committed_schema(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    assert main(["policy", "schema"]) == 0
    printed = capsysbinary.readouterr().out
    assert printed == render_json_schema()
    assert json.loads(printed)["title"] == "specshadow policy"
    out = tmp_path / "schema.json"
    assert main(["policy", "schema", "--out", str(out)]) == 0
    assert out.read_bytes() == printed


def test_a_rollout_whose_quality_guards_have_no_reference_is_refused_by_check_and_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No baseline leg and ``ratio: 0``: no canary answer has the primary's answer behind it, so
    ``sampled_divergence`` and ``divergence_rate`` could never judge. ``policy check`` and
    ``serve`` both refuse it with the field path, in one line, before anything starts."""
    path = tmp_path / "rollout.yaml"
    path.write_text(
        "version: 1\n"
        "backends:\n  prim: {url: 'http://127.0.0.1:9', kind: sim}\n"
        "  cand: {url: 'http://127.0.0.1:10', kind: sim}\n"
        "primary: prim\n"
        "default:\n  ratio: 0\n  legs: [{backend: cand, role: candidate}]\n"
        "  rollout: {stage: canary, steps: [0.2, 1.0]}\n"
    )
    why = "default.ratio: 0 mirrors nothing, so no canary answer has the primary's answer behind it"
    assert main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: {why}") and err.count("\n") == 1, err
    assert main(["serve", "--policy", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specshadow serve: {why}") and err.count("\n") == 1, err
    assert "Traceback" not in err
    # The same rule with the primary mirrored behind a fifth of its traffic is accepted.
    path.write_text(path.read_text().replace("ratio: 0\n", "ratio: 0.2\n"))
    assert main(["policy", "check", str(path)]) == 0
