"""Report inputs: comparison records from the gateway's store, and loadgen/matrix result files.

Records: the embedded SQLite store (read through :func:`evidence.query_records`), or JSON
lines as ``specshadow records --store PATH`` prints them (``.jsonl``), or a folder of ``.jsonl``.
Results: JSONL, one object per line — matrix cells (``schema specshadow.matrix/1``) and/or
per-request loadgen results; :func:`report.analysis.analyze` tells them apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core import jsonx

__all__ = ["read_jsonl", "read_results"]


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for obj in jsonx.json_lines(
            f, invalid=lambda n, e: ValueError(f"{path}:{n}: invalid JSON: {e}")
        ):
            if isinstance(obj, dict):
                yield obj


def read_results(path: str | Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path))
