"""Traces: JSONL of OpenAI request bodies, read once into frozen :class:`TraceRecord`\\ s (pure).

Each line is a chat-completions (``messages``) or completions (``prompt``) request body, plus
optional keys that are NOT sent upstream: ``timestamp`` (seconds, any origin — only differences
matter), ``category`` and ``meta``. They are stripped here, so nothing downstream can leak them into
a request (the OpenAI API rejects unknown keys). ``shared/traces/`` and the bundled
``loadgen/data/demo_trace.jsonl`` are in this format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from core import jsonx

__all__ = [
    "EXTRA_KEYS",
    "TraceError",
    "TraceRecord",
    "bundled_trace",
    "read_trace",
    "trace_records",
]

Route = Literal["chat", "completions"]
# Keys of a trace line that describe the request and are never sent.
EXTRA_KEYS = frozenset({"timestamp", "category", "meta"})
ROUTE_PATHS: dict[Route, str] = {"chat": "/chat/completions", "completions": "/completions"}


class TraceError(ValueError):
    """A trace line that is not a usable request (names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trace row: the request body to send and what describes it."""

    index: int  # position in the trace (0-based)
    body: Mapping[str, Any]  # the OpenAI request body, extras removed (read-only)
    route: Route
    timestamp_s: float | None
    category: str | None
    meta: Mapping[str, Any] | None


def parse_trace_line(obj: object, index: int) -> TraceRecord:
    """One decoded JSON line → :class:`TraceRecord`; raises :class:`TraceError` naming the line."""
    where = f"trace line {index + 1}"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    body = {k: v for k, v in obj.items() if k not in EXTRA_KEYS}
    if "messages" in body:
        route: Route = "chat"
    elif "prompt" in body:
        route = "completions"
    else:
        raise TraceError(f"{where}: neither 'messages' (chat) nor 'prompt' (completions)")
    ts = obj.get("timestamp")
    if ts is not None and (
        isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts)
    ):
        raise TraceError(f"{where}: 'timestamp' must be a number of seconds")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        raise TraceError(f"{where}: 'category' must be a string")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise TraceError(f"{where}: 'meta' must be an object")
    return TraceRecord(
        index=index,
        body=MappingProxyType(body),
        route=route,
        timestamp_s=float(ts) if ts is not None else None,
        category=category,
        meta=MappingProxyType(meta) if meta is not None else None,
    )


def trace_records(rows: Iterable[Mapping[str, Any] | TraceRecord]) -> list[TraceRecord]:
    """Rows already decoded (dicts, or records passed through) → records, re-indexed in order."""
    out: list[TraceRecord] = []
    for i, row in enumerate(rows):
        if isinstance(row, TraceRecord):
            out.append(row if row.index == i else parse_trace_line(_as_dict(row), i))
        else:
            out.append(parse_trace_line(dict(row), i))
    return out


def _as_dict(record: TraceRecord) -> dict[str, Any]:
    raw = dict(record.body)
    if record.timestamp_s is not None:
        raw["timestamp"] = record.timestamp_s
    if record.category is not None:
        raw["category"] = record.category
    if record.meta is not None:
        raw["meta"] = dict(record.meta)
    return raw


def parse_trace_text(text: str | bytes) -> list[TraceRecord]:
    """JSONL text → records; blank lines are skipped (they do not count as indices)."""
    raw = text.encode() if isinstance(text, str) else text
    out: list[TraceRecord] = []
    lines = raw.split(b"\n")
    for obj in jsonx.json_lines(
        lines, invalid=lambda n, e: TraceError(f"trace line {n}: invalid JSON: {e}")
    ):
        out.append(parse_trace_line(obj, len(out)))
    return out


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Read a JSONL trace file. Raises :class:`TraceError` (bad line) or ``OSError``."""
    return parse_trace_text(Path(path).read_bytes())


def bundled_trace() -> list[TraceRecord]:
    """The 40-row demo trace shipped with the package (chat, multi_turn, structured_output)."""
    data = resources.files("loadgen").joinpath("data/demo_trace.jsonl").read_bytes()
    return parse_trace_text(data)
