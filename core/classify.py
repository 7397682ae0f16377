"""Request classifier: which kind of prompt an exchange was (pure, cheap, off the hot path).

The record sink calls :func:`categorize` in its worker thread when an exchange arrives. Order:

1. the request header ``x-specshadow-category`` (already in ``Exchange.category``) — source
   ``"header"``;
2. a policy rule — not available yet: rules match categories but do not assign them;
3. :func:`classify_request` over the parsed body — source ``"classifier"``.

The classifier's rules, first hit wins:

- ``tool_call``: the request offers ``tools`` (or legacy ``functions``) and ``tool_choice`` is
  not ``"none"``;
- ``structured_output``: ``response_format.type`` (the Responses API: ``text.format.type``) is
  ``json_object`` or ``json_schema``;
- ``rag``: prompt text longer than :data:`RAG_MIN_CHARS`, or numbered sources (``[1]`` … at
  least two distinct), or a ``context:`` / ``sources:`` / ``documents:`` marker line;
- ``code``: a code fence, or at least :data:`CODE_MIN_HITS` programming keywords;
- ``multi_turn``: more than one user message;
- ``math``: "solve"/"calculate"/"equation"/… or a dense run of digits and operators;
- ``chat``: everything else.

Only the last :data:`SCAN_CHARS` characters of the prompt are scanned for keywords, so the cost is
bounded whatever the prompt size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core import request_body

CategorySource = Literal["header", "policy", "classifier", "unknown"]
CATEGORIES = (
    "tool_call",
    "structured_output",
    "rag",
    "code",
    "multi_turn",
    "math",
    "chat",
)
# Every reader's name for an exchange with no category (records, reports, telemetry labels), and
# the pooled category's: every category together.
UNCATEGORIZED = "uncategorized"
ALL = "all"

RAG_MIN_CHARS = 8000
SCAN_CHARS = 16_384
CODE_MIN_HITS = 2

_CODE_FENCE = re.compile(r"```")
_CODE_WORDS = re.compile(
    r"\b(?:def|class|import|return|function|const|let|var|public|static|void|#include|"
    r"SELECT|FROM|WHERE|lambda|async|await|struct|impl|fn|println|printf|console\.log)\b"
    r"|[{};]\s*$|=>|->",
    re.MULTILINE,
)
_SOURCES = re.compile(r"\[(\d{1,3})\]")
_CONTEXT_MARKER = re.compile(r"^\s*(?:context|sources?|documents?|passages?)\s*:", re.I | re.M)
_MATH_WORDS = re.compile(
    r"\b(?:solve|calculate|compute|equation|integral|derivative|simplify|prove)\b", re.I
)
_MATH_EXPR = re.compile(r"\d+\s*[-+*/^=]\s*\d+")


@dataclass(frozen=True, slots=True)
class RequestTraits:
    """What the comparison and classifier need to know about a request body."""

    json_mode: bool  # response_format json_object / json_schema
    has_tools: bool
    user_messages: int
    prompt_chars: int


def prompt_text(payload: Mapping[str, Any]) -> str:
    """The prompt's text: the messages' contents joined by newlines (chat, or the Responses API's
    instructions and input), or the completion prompt."""
    messages = request_body.messages(payload)
    if messages is not None:
        return "\n".join(request_body.content_text(m.get("content")) for m in messages)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def request_traits(payload: Mapping[str, Any], text: str | None = None) -> RequestTraits:
    """``text``: the payload's :func:`prompt_text`, when the caller has it already."""
    messages = request_body.messages(payload)
    users = 1 if messages is None else sum(1 for m in messages if m.get("role") == "user")
    return RequestTraits(
        request_body.json_mode(payload),
        request_body.offers_tools(payload),
        users,
        len(prompt_text(payload) if text is None else text),
    )


def classify_request(payload: Mapping[str, Any]) -> str:
    """The built-in category of a request body (rules in the module docstring)."""
    text = prompt_text(payload)
    traits = request_traits(payload, text)
    if traits.has_tools:
        return "tool_call"
    if traits.json_mode:
        return "structured_output"
    scan = text[-SCAN_CHARS:]
    if (
        traits.prompt_chars > RAG_MIN_CHARS
        or len(set(_SOURCES.findall(scan))) >= 2
        or _CONTEXT_MARKER.search(scan)
    ):
        return "rag"
    if _CODE_FENCE.search(scan) or len(_CODE_WORDS.findall(scan)) >= CODE_MIN_HITS:
        return "code"
    if traits.user_messages > 1:
        return "multi_turn"
    if _MATH_WORDS.search(scan) or len(_MATH_EXPR.findall(scan)) >= 1:
        return "math"
    return "chat"


def categorize(
    header: str | None,
    payload: Mapping[str, Any] | None,
    *,
    policy_category: str | None = None,
) -> tuple[str | None, CategorySource]:
    """Category and where it came from: header, then policy, then the classifier."""
    if header and header.strip():
        return header.strip(), "header"
    if policy_category:
        return policy_category, "policy"
    if payload is not None:
        return classify_request(payload), "classifier"
    return None, "unknown"
