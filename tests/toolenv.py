"""Third-party tools the tests drive, each in its own virtual environment outside the repo.

Phoenix (a trace store and UI), AIPerf and GuideLLM (peer benchmark clients) pin their own
dependencies — Phoenix alone is ~860 MB — so none of them goes into the project's ``.venv``. Like
the vLLM tier's environment (``specshadow vllm setup``), each is built on first use and cached::

    $SPECSHADOW_CACHE (default ~/.cache/specshadow)/
      <tool>/venv/          python -m venv + pip install of the pinned requirements
      <tool>/install.json   what was installed, how long it took, how big it is (written last)
      <tool>/.lock          held while building, so concurrent test sessions build it once

``install.json`` present with the same requirements ⇒ ready; otherwise the venv is rebuilt. The
build time and size are what CI pays on a cold cache (docs/telemetry.md, docs/benchmarks.md).

Standard library only, so it also runs as a script before the tests, e.g. in CI's bootstrap::

    python tests/toolenv.py phoenix aiperf guidellm
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Pinned: a new release is a deliberate change (its output formats are what the tests parse).
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "phoenix": ("arize-phoenix==20.26.1",),
    "aiperf": ("aiperf==0.13.0",),
    # torch: the CPU build (the local wheel folder here; elsewhere the PyTorch CPU index), not
    # the CUDA build PyPI resolves to (6.1 GB installed, against 1.5 GB)
    "guidellm": ("guidellm==0.8.1", "torch==2.13.0+cpu"),
}
INSTALL_TIMEOUT_S = 1800.0


class ToolEnvError(RuntimeError):
    """A tool's environment could not be built (the pip output's tail says why)."""


@dataclass(frozen=True, slots=True)
class ToolEnv:
    name: str
    root: Path
    install: dict[str, object]  # install.json: requirements, seconds, megabytes, python

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    def bin(self, script: str) -> Path:
        return self.venv / "bin" / script


def cache_root() -> Path:
    configured = os.environ.get("SPECSHADOW_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specshadow"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _megabytes(path: Path) -> float:
    total = sum(p.lstat().st_size for p in path.rglob("*") if not p.is_symlink())
    return round(total / 1e6, 1)


def _read_install(root: Path) -> dict[str, object] | None:
    try:
        data: dict[str, object] = json.loads((root / "install.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def ensure(name: str, cache: Path | None = None) -> ToolEnv:
    """The tool's environment, built now if it is missing or its pins changed."""
    requirements = list(REQUIREMENTS[name])
    root = (cache or cache_root()) / name
    with _locked(root / ".lock"):
        done = _read_install(root)
        if done is not None and done.get("requirements") == requirements:
            return ToolEnv(name, root, done)
        (root / "install.json").unlink(missing_ok=True)
        shutil.rmtree(root / "venv", ignore_errors=True)
        started = time.monotonic()
        log = root / "install.log"
        with log.open("wb") as out:
            for argv in (
                [sys.executable, "-m", "venv", str(root / "venv")],
                [str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
                 *requirements],
            ):  # fmt: skip
                proc = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S,
                    check=False,
                )  # fmt: skip
                if proc.returncode != 0:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise ToolEnvError(f"{name}: {' '.join(argv)} exited {proc.returncode}\n{tail}")
        install: dict[str, object] = {
            "requirements": requirements,
            "seconds": round(time.monotonic() - started, 1),
            "megabytes": _megabytes(root / "venv"),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        }
        (root / "install.json").write_text(json.dumps(install, indent=1) + "\n")
        return ToolEnv(name, root, install)


def main(argv: list[str]) -> int:
    names = argv or sorted(REQUIREMENTS)
    unknown = [n for n in names if n not in REQUIREMENTS]
    if unknown:
        print(f"toolenv: unknown tool {unknown[0]!r} (known: {', '.join(REQUIREMENTS)})")
        return 2
    for name in names:
        env = ensure(name)
        print(f"{name}: {env.venv} ({json.dumps(env.install)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
