"""The wheel holds the product and nothing a clone accumulates, and an installed copy's
missing-extra hint installs from where that copy came from.

The wheel is built the way ``pip install .`` builds it (in the tree, with the backend that
pyproject's build-system requires, offline: ``--no-build-isolation``), in a copy of the tracked
files to which a demo's ``specshadow-out/`` and other leftovers were added.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.e2e.test_slim_install import BLOCKED

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PACKAGES = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
DATA = {  # the data files the product reads at run time
    "loadgen/data/demo_trace.jsonl",
    "loadgen/data/ATTRIBUTION.md",
    "policies/schema.json",
    "policies/examples/minimal.yaml",
    "policies/examples/production.yaml",
}
LEFTOVERS = {  # what a clone collects: the demo's output, build trees, caches, scratch files
    "specshadow-out/demo/records.sqlite": b"SQLite format 3\x00",
    "specshadow-out/demo/report/report.md": b"# report\n",
    "specshadow-out/demo/report/report.json": b"{}\n",
    "specshadow-out/demo/shadow-report/rollout.yaml": b"rollout: {}\n",
    "specshadow-out/demo/shadow-report/counterfactual.jsonl": b"{}\n",
    "build/bdist.linux-x86_64/notes.md": b"# notes\n",
    "build/report.json": b"{}\n",
    "out/report/report.md": b"# report\n",
    "report/__pycache__/cli.cpython-311.pyc": b"\x00",
    "dist/old.json": b"{}\n",
}
pytestmark = pytest.mark.e2e


def run(
    *cmd: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, shlex.join(cmd) + "\n" + proc.stdout + proc.stderr
    return proc


def tracked() -> list[str]:
    """The repository's files: tracked, or new and not ignored (a work tree's in-flight files)."""
    out = run(
        "git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT
    ).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked files in a temporary folder, plus leftovers."""
    build_requires = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in build_requires:  # offline build: the backend must already be here
        assert req.specifier.contains(Version(version(req.name))), (
            f"{req} is not installed: scripts/bootstrap installs the dev extra"
        )
    root = tmp_path_factory.mktemp("clone") / "specshadow"
    for name in tracked():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    for name, body in LEFTOVERS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return root


@pytest.fixture(scope="module")
def built(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the wheel built in the clone, pip's output while building it)."""
    out = tmp_path_factory.mktemp("wheel")
    proc = run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-w", str(out), str(clone), cwd=clone,
    )  # fmt: skip
    (wheel,) = out.glob("specshadow-*.whl")
    return wheel, proc.stdout + proc.stderr


def test_the_wheel_holds_every_product_file_and_nothing_else(
    clone: Path, built: tuple[Path, str]
) -> None:
    wheel, _log = built
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if ".dist-info/" not in n]
    product = {f for f in tracked() if f.split("/")[0] in PACKAGES}
    assert not [n for n in names if n.startswith(("specshadow-out/", "build/", "out/", "dist/"))]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert set(names) >= DATA
    assert sorted(names) == sorted(product)  # every tracked file of a package, no other


def extra_requires(requires: list[Requirement], extra: str) -> set[str]:
    """The distributions ``extra`` adds, through extras that name other extras of the project."""
    names: set[str] = set()
    for r in requires:
        if r.marker is None or "extra" not in str(r.marker):
            continue
        if not r.marker.evaluate({"extra": extra}):
            continue
        if r.name == "specshadow":
            for inner in r.extras:
                names |= extra_requires(requires, inner)
        else:
            names.add(r.name)
    return names


def test_the_metadata_has_the_demo_extra_and_an_spdx_license_without_a_deprecation(
    built: tuple[Path, str],
) -> None:
    wheel, log = built
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(meta).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert {"report", "loadgen", "demo", "fleet", "all", "dev"} <= set(
        metadata.get_all("Provides-Extra") or ()
    )
    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist") or ()]
    demo = extra_requires(requires, "demo")
    assert {"numpy", "matplotlib"} <= demo
    assert not demo & {"chdb", "pyarrow", "pandas", "openai"}  # the demo runs on SQLite
    # e.g. "BuildBackendWarning: `project.license` as a TOML table is deprecated"
    assert "deprecat" not in log.lower(), log
    assert "BuildBackendWarning" not in log, log


def hint(installed: Path, cwd: Path) -> str:
    """The missing-report-extra line of `specshadow report` run from ``installed``."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED, "report", "--store", "none.sqlite", "--out", "."],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    prefix = "specshadow report needs numpy, matplotlib, which the 'report' extra installs: "
    assert proc.stderr.startswith(prefix), proc.stderr
    return proc.stderr.strip().removeprefix(prefix)


def test_a_copy_installed_from_the_wheel_points_at_the_index(
    built: tuple[Path, str], tmp_path: Path
) -> None:
    wheel, _log = built
    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
        str(wheel), cwd=tmp_path)  # fmt: skip
    assert hint(target, cwd=tmp_path) == "pip install 'specshadow[report]'"


def test_a_copy_installed_from_a_clone_points_at_the_clone(clone: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--target", str(target), str(clone), cwd=tmp_path)  # fmt: skip
    assert hint(target, cwd=tmp_path) == (
        f"{sys.executable} -m pip install {shlex.quote(f'{clone}[report]')}"
    )


def test_the_source_tree_run_as_it_is_points_at_itself(clone: Path) -> None:
    assert hint(clone, cwd=clone) == f"{sys.executable} -m pip install -e '.[report]'"
    assert hint(clone, cwd=clone / "docs") == (
        f"{sys.executable} -m pip install -e {shlex.quote(f'{clone}[report]')}"
    )


def test_a_stale_build_tree_does_not_ship(clone: Path, tmp_path: Path) -> None:
    stale = {"build/lib/specshadow-out/demo/report/report.md", "build/lib/report/removed.py"}
    for name in stale:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_text("stale\n")
    try:
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
            "-w", str(tmp_path), str(clone), cwd=clone)  # fmt: skip
    finally:
        shutil.rmtree(clone / "build" / "lib", ignore_errors=True)
    (wheel,) = tmp_path.glob("specshadow-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert not {n.removeprefix("build/lib/") for n in stale} & names
