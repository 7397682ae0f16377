"""The parts of a client's request body specshadow reads, the same for every route (pure).

Chat completions carry ``messages``; the Responses API carries ``instructions`` (a system message)
and ``input`` (a string — one user message — or a list of items: messages with a ``role``, and
function-call items); completions carry ``prompt``. Structured output is ``response_format`` in
chat and ``text.format`` in the Responses API; tools are ``tools`` (or legacy ``functions``)
in both. Everything here reads and never writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_JSON_FORMATS = frozenset({"json_object", "json_schema"})


def messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The conversation as role/content messages, or None for a completions ``prompt``."""
    raw = payload.get("messages")
    if isinstance(raw, list):
        return [m for m in raw if isinstance(m, Mapping)]
    if "input" not in payload and "instructions" not in payload:
        return None
    out: list[Mapping[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    given = payload.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, Mapping):
                role = item.get("role")
                out.append(item if role is not None else {"role": str(item.get("type")), **item})
    return out


def content_text(content: Any) -> str:
    """A message's text: the string, or the ``text`` of each part of a content list (parts
    without text — images, audio — contribute nothing), joined by spaces."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return ""


def json_mode(payload: Mapping[str, Any]) -> bool:
    """The request asks for JSON output (``response_format`` or the Responses ``text.format``)."""
    rf = payload.get("response_format")
    if isinstance(rf, Mapping):
        return rf.get("type") in _JSON_FORMATS
    text = payload.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    return isinstance(fmt, Mapping) and fmt.get("type") in _JSON_FORMATS


def offers_tools(payload: Mapping[str, Any]) -> bool:
    """Tools are offered and ``tool_choice`` does not rule them out."""
    tools = payload.get("tools") or payload.get("functions")
    return bool(tools) and payload.get("tool_choice") != "none"
