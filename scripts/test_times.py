#!/usr/bin/env python3
"""Summarise pytest junit xml files: tests per file (tier), their time, and the slowest tests.

    .venv/bin/python scripts/test_times.py [--slowest 20] report/*.xml

``scripts/check`` runs it after its tiers. A test's time is pytest's junit ``time``: setup, call
and teardown together, so a test that pays for a fixture's start shows it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("xml", nargs="+", type=Path)
    args = parser.parse_args(argv)
    out = sys.stdout
    rows: list[tuple[float, str, str]] = []
    out.write(
        "\ncheck: tests per tier (sum of test times: with workers it exceeds the wall time)\n"
    )
    for path in args.xml:
        tier = path.stem
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        total = 0.0
        for case in ET.parse(path).getroot().iter("testcase"):
            seconds = float(case.get("time") or 0.0)
            total += seconds
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
            counts[outcome] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            rows.append((seconds, tier, name))
        summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        out.write(f"  {tier:<12} {summary or 'no tests'}; {total:.0f} s of test time\n")
    rows.sort(reverse=True)
    out.write(f"\ncheck: the {args.slowest} slowest tests (setup + call + teardown)\n")
    for seconds, tier, name in rows[: args.slowest]:
        out.write(f"  {seconds:8.1f} s  {tier:<11} {name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
