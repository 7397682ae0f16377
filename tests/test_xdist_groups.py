"""The suite's worker grouping holds: under ``--dist loadgroup`` (scripts/check), tests that share
a session-scoped fixture run on one xdist worker, so a slow fixture (Phoenix, ClickHouse, a built
wheel) is built once per run, not once per worker.

pytest 9.2.0 silently broke this: xdist 3.8 groups by suffixing the node id, which pytest 9.2's
structured node ids ignore (pytest-dev/pytest-xdist#1386), and every worker built its own copy of
each such fixture. pyproject.toml keeps pytest below 9.2 until xdist has the fix; this test is
what says when a dependency bump breaks the grouping again. It runs a small suite under
``tests/`` of a temporary folder with this suite's own collection hook, on three workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems  # the suite's grouping hook

@pytest.fixture(scope="session")
def built_on():
    return os.environ["PYTEST_XDIST_WORKER"]
"""

MODULE = """
import os
import pytest

@pytest.mark.parametrize("i", range(4))
def test_fixture(built_on, i):
    with open(os.environ["GROUPS_OUT"], "a") as fh:
        fh.write(f"fixture {built_on} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.xdist_group("marked")
@pytest.mark.parametrize("i", range(4))
def test_marked(i):
    with open(os.environ["GROUPS_OUT"], "a") as fh:
        fh.write(f"marked - {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    pass
"""


def test_tests_of_one_session_fixture_and_of_one_mark_each_run_on_one_worker(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "tests"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("a", "b"):
        (suite / f"test_{name}.py").write_text(MODULE)
    out = tmp_path / "groups.txt"
    env = {**os.environ, "GROUPS_OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-n", "3", "--dist", "loadgroup", "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in out.read_text().splitlines()]
    fixture = [row for row in rows if row[0] == "fixture"]
    marked = [row for row in rows if row[0] == "marked"]
    assert len(fixture) == 8 and len(marked) == 8, rows
    # Every test of the fixture ran where it was built, and that was one worker for both modules.
    assert {(built, ran) for _, built, ran in fixture} == {(fixture[0][1], fixture[0][1])}, fixture
    assert len({ran for _, _, ran in marked}) == 1, marked
