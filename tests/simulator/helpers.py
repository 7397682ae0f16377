"""Test helpers for the simulator: an independent SSE splitter, a tiny JSON Schema checker, and
the n-gram proposer and the replay step contract written independently of the simulator."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    comments: list[str]
    data: str

    @property
    def sent_ns(self) -> int | None:
        for c in self.comments:
            if c.startswith(" sent_ns="):
                return int(c.split("=", 1)[1])
        return None

    def json(self) -> Any:
        return json.loads(self.data)


def split_events(body: bytes) -> list[Event]:
    """Split an SSE body (the simulator writes LF only) into events."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block:
            continue
        comments, data = [], []
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line[1:])
            elif line.startswith("data: "):
                data.append(line[6:])
        events.append(Event(comments, "\n".join(data)))
    return events


def fits_schema(value: Any, schema: dict[str, Any], root: dict[str, Any] | None = None) -> bool:
    """The subset of JSON Schema the tests use, checked independently of the simulator."""
    root = root or schema
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        return fits_schema(value, node, root)
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(fits_schema(value, s, root) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        return all(fits_schema(v, props[k], root) for k, v in value.items() if k in props)
    if kind == "array":
        if not isinstance(value, list):
            return False
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 10**9):
            return False
        return all(fits_schema(v, schema.get("items", {}), root) for v in value)
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    if kind in checks:
        ok = checks[kind](value)
        if ok and kind in ("integer", "number"):
            ok = schema.get("minimum", -(10**18)) <= value <= schema.get("maximum", 10**18)
        if ok and kind == "string":
            ok = schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10**9)
        return ok
    return True


def brute_force(tokens: list[int], lo: int, hi: int, max_model_len: int, k: int) -> list[int]:
    """The proposer's definition, written the obvious way: the longest suffix n-gram that occurs
    earlier (not as the suffix itself), its earliest occurrence, the tokens after it."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < lo or k <= 0:
        return []
    for n in range(min(hi, total), lo - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def replayed_steps(
    prompt: list[int], out: list[int], k: int, propose: Callable[[list[int], int], list[int]]
) -> list[tuple[int, int]]:
    """The replay contract, independently: ``[(drafted, accepted), ...]``, prefill first."""
    steps = [(0, 0)]
    j = 1
    while j < len(out):
        draft = propose(list(prompt) + list(out[:j]), k)[: len(out) - j - 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == out[j + accepted]:
            accepted += 1
        steps.append((len(draft), accepted))
        j += accepted + 1
    return steps
