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
