"""Installed size and import time of the gateway: the slim install against the full one.

``python -m bench.install_footprint [--runs N] [--json FILE]`` builds this tree's wheel once and
installs it into two fresh virtual environments side by side:

- ``slim`` — ``pip install specshadow``: what the gateway needs (after the slim-install change);
- ``full`` — ``pip install 'specshadow[all]' openai``: everything, i.e. what a plain
  ``pip install specshadow`` brought before that change (numpy, matplotlib and the openai SDK
  were core dependencies then).

For each it measures the size of ``site-packages`` (files on disk), the number of distributions,
the median over ``--runs`` fresh interpreters of the time to import what ``specshadow serve``
imports, and the median wall time of ``specshadow serve --help`` (console script start). Prints
one table with the ratios slim ÷ full. Takes a minute or two (two pip installs).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.tables import render_table, write_json

ROOT = Path(__file__).resolve().parents[1]
IMPORT_PROBE = (
    "import time; t = time.perf_counter(); import specshadow.serve, specshadow.main; "
    "print(time.perf_counter() - t)"
)


def run(cmd: list[str], **kw: object) -> str:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    return str(out.stdout)


def build_wheel(out: Path) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (wheel,) = out.glob("specshadow-*.whl")
    return wheel


def make_env(path: Path, requirements: list[str]) -> Path:
    run([sys.executable, "-m", "venv", str(path)])
    python = path / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", *requirements])
    return python


def site_packages_bytes(python: Path) -> tuple[int, int]:
    """(bytes of files under site-packages, distributions installed)."""
    site = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    )
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file() and not f.is_symlink())
    dists = len(list(site.glob("*.dist-info")))
    return size, dists


def median_import_s(python: Path, runs: int) -> float:
    return statistics.median(
        float(run([str(python), "-c", IMPORT_PROBE], cwd="/")) for _ in range(runs)
    )


def median_help_s(python: Path, runs: int) -> float:
    script = python.with_name("specshadow")
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run([str(script), "serve", "--help"], cwd="/")
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per timing")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specshadow-footprint-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work / "wheel")
        arms = {
            "slim": [str(wheel)],
            "full": [f"{wheel}[all]", "openai>=1.40"],
        }
        rows: dict[str, dict[str, float]] = {}
        for name, requirements in arms.items():
            python = make_env(work / name, requirements)
            size, dists = site_packages_bytes(python)
            rows[name] = {
                "site_packages_mib": size / 2**20,
                "distributions": dists,
                "import_s": median_import_s(python, args.runs),
                "serve_help_s": median_help_s(python, args.runs),
            }
    slim, full = rows["slim"], rows["full"]
    table = [
        (metric, slim[metric], full[metric], slim[metric] / full[metric])
        for metric in ("site_packages_mib", "distributions", "import_s", "serve_help_s")
    ]
    print(render_table("Install footprint", ("metric", "slim", "full", "slim / full"), table))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
