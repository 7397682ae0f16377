"""Where drafts get rejected: the target token at each step's first rejected position, classified.

A token is classified from its text *in context* (the output decoded piece by piece), so a
number inside a JSON value is a JSON value and an identifier inside a tool call's arguments is
a tool-call argument. The classes, checked in this order:

``whitespace`` (spaces and newlines only), ``tool_call_argument`` (inside the value of a JSON
``arguments`` / ``parameters`` / ``input`` key, or inside ``<tool_call>``), ``json_structure`` /
``json_key`` / ``json_value`` (inside JSON: an output that starts with ``{`` or ``[``, a
```` ```json ```` fence), ``citation_marker`` (``[3]``, ``[1, 2]``, ``[^4]``, ``【…】``,
``(Smith et al., 2020)``), ``number``, ``non_latin`` (letters beyond Latin Extended-B, or a
partial UTF-8 byte piece, decoded as U+FFFD), ``code_identifier`` (a word with ``_`` or
camelCase, followed by ``(`` or after ``x.``, or any word inside a code fence or backticks),
``capitalised_name`` (a capitalised word that does not start a sentence), ``punctuation``,
``other``.

Token text comes from a *pieces* table (id → the token's decoded text): a Hugging Face
``tokenizer.json``, a JSON ``{id: text}`` file, or the tokenizer backend's ``POST /detokenize``
one id at a time (vLLM's, the simulator's). Without one, rejections are counted by position
but not classified.

A drafter's vocabulary (EAGLE-3's pruned draft vocabulary: its ``d2t`` offsets, target id =
draft id + ``d2t[draft id]``, or a plain list of target ids) makes every output token outside it
a rejection by construction: counted per category.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from core import jsonx

__all__ = [
    "CLASSES",
    "classify_output",
    "detokenize_pieces",
    "load_drafter_vocabulary",
    "load_pieces",
    "shares",
]

CLASSES: tuple[str, ...] = (
    "number",
    "code_identifier",
    "capitalised_name",
    "citation_marker",
    "json_structure",
    "json_key",
    "json_value",
    "tool_call_argument",
    "whitespace",
    "punctuation",
    "non_latin",
    "other",
)

_TOOL_KEYS = frozenset({"arguments", "parameters", "input", "args"})
_CITATION = re.compile(
    r"\[\^?\d+(?:\s*[,–-]\s*\d+)*\]|【[^】]{0,40}】|†|"
    r"\((?:[A-Z][\w'-]+)(?: et al\.| and [A-Z][\w'-]+)?,? \d{4}[a-z]?\)"
)
_NUMBER = re.compile(r"^[+-]?[\d.,%]*\d[\d.,%]*$")
_WORD = re.compile(r"\w")


def _json_labels(text: str) -> list[str | None]:
    """Per character: ``json_structure`` / ``json_key`` / ``json_value`` /
    ``tool_call_argument`` inside JSON regions, else None (a tolerant scanner: cut-off JSON and
    prose around it are fine)."""
    labels: list[str | None] = [None] * len(text)
    stripped = text.lstrip()
    starts = [len(text) - len(stripped)] if stripped[:1] in ("{", "[") else []
    starts.extend(m.end() for m in re.finditer(r"```json\s*\n|<tool_call>\s*", text))
    for start in starts:
        _scan_json(text, start, labels)
    for m in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, re.S):
        for i in range(m.start(1), m.end(1)):
            if labels[i] is None:
                labels[i] = "tool_call_argument"
    return labels


def _scan_json(text: str, start: int, labels: list[str | None]) -> None:
    stack: list[str] = []  # "{" or "["
    expect_key = False
    last_key = ""
    tool_depth: int | None = None  # stack depth at which a tool call's arguments value began
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        in_tool = tool_depth is not None
        if c in "{[":
            if not stack and i != start and text[start:i].strip():
                break
            if tool_depth is None and stack and last_key in _TOOL_KEYS and not expect_key:
                tool_depth = len(stack)
                in_tool = True
            labels[i] = "tool_call_argument" if in_tool else "json_structure"
            stack.append(c)
            expect_key = c == "{"
            i += 1
        elif c in "}]":
            labels[i] = "tool_call_argument" if in_tool else "json_structure"
            if stack:
                stack.pop()
            if tool_depth is not None and len(stack) <= tool_depth:
                tool_depth = None
            expect_key = False
            i += 1
            if not stack:
                break
        elif c in ",:":
            labels[i] = "tool_call_argument" if in_tool else "json_structure"
            if c == "," and stack and stack[-1] == "{":
                expect_key = True
            i += 1
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            end = min(j + 1, n)
            if expect_key and not in_tool:
                label = "json_key"
                last_key = text[i + 1 : min(j, n)]
                expect_key = False
            else:
                arg_value = not in_tool and last_key in _TOOL_KEYS and bool(stack)
                label = "tool_call_argument" if in_tool or arg_value else "json_value"
                if expect_key:
                    expect_key = False
            for p in range(i, end):
                labels[p] = label
            i = end
        elif c.isspace():
            i += 1
        else:
            j = i
            while j < n and text[j] not in ',:{}[]"' and not text[j].isspace():
                j += 1
            label = "tool_call_argument" if in_tool or last_key in _TOOL_KEYS else "json_value"
            for p in range(i, j):
                labels[p] = label
            i = max(j, i + 1)


def _regions(text: str) -> tuple[list[bool], list[bool]]:
    """(citation, code) per character."""
    citation = [False] * len(text)
    for m in _CITATION.finditer(text):
        for i in range(m.start(), m.end()):
            citation[i] = True
    code = [False] * len(text)
    for m in re.finditer(r"```.*?(```|$)|`[^`\n]+`", text, re.S):
        for i in range(m.start(), m.end()):
            code[i] = True
    return citation, code


def _word(text: str, s: int, e: int) -> tuple[int, int]:
    while s > 0 and _WORD.match(text[s - 1]):
        s -= 1
    while e < len(text) and _WORD.match(text[e]):
        e += 1
    return s, e


def _non_latin(piece: str) -> bool:
    return any(
        ch == "\ufffd" or (ord(ch) > 0x24F and unicodedata.category(ch).startswith("L"))
        for ch in piece
    )


def _classify(
    text: str,
    s: int,
    e: int,
    labels: Sequence[str | None],
    citation: Sequence[bool],
    code: Sequence[bool],
) -> str:
    piece = text[s:e]
    core = piece.strip()
    if not core:
        return "whitespace"
    first = s + (len(piece) - len(piece.lstrip()))
    spans = range(first, e)
    if any(labels[i] == "tool_call_argument" for i in spans):
        return "tool_call_argument"
    if labels[first] is not None:
        return labels[first]  # type: ignore[return-value]  # one of the JSON classes
    if any(citation[i] for i in spans):
        return "citation_marker"
    if _NUMBER.match(core):
        return "number"
    if _non_latin(core):
        return "non_latin"
    if _WORD.search(core):
        ws, we = _word(text, first, e)
        word = text[ws:we]
        if word and not word.isdigit():
            after = text[we : we + 1]
            before = text[max(ws - 2, 0) : ws]
            camel = any(a.islower() and b.isupper() for a, b in itertools.pairwise(word))
            if (
                code[first]
                or "_" in word
                or camel
                or after == "("
                or (len(before) == 2 and before[1] == "." and before[0].isalnum())
            ):
                return "code_identifier"
            if word[0].isupper():
                head = text[:ws].rstrip(" \t\"'*(")
                if head and head[-1] not in ".!?:\n#>-" and not head.endswith("\n"):
                    return "capitalised_name"
        return "other"
    if all(unicodedata.category(ch)[0] in "PS" for ch in core):
        return "punctuation"
    return "other"


def classify_output(pieces: Sequence[str]) -> list[str]:
    """One class per output token, from the tokens' texts in order (see the module doc)."""
    text = "".join(pieces)
    labels = _json_labels(text)
    citation, code = _regions(text)
    out: list[str] = []
    s = 0
    for piece in pieces:
        e = s + len(piece)
        out.append(_classify(text, s, e, labels, citation, code) if piece else "other")
        s = e
    return out


def shares(
    rejected: Mapping[str, int], output: Mapping[str, int]
) -> dict[str, dict[str, float | int]]:
    """Per class: rejections, their share of all rejections, and the class's share of output
    tokens (each share column sums to 1 over the classes)."""
    total_r = sum(rejected.values())
    total_o = sum(output.values())
    return {
        c: {
            "rejections": rejected.get(c, 0),
            "rejection_share": rejected.get(c, 0) / total_r if total_r else 0.0,
            "output_share": output.get(c, 0) / total_o if total_o else 0.0,
        }
        for c in CLASSES
        if rejected.get(c, 0) or output.get(c, 0)
    }


# -- token texts ---------------------------------------------------------------------------


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (a ``tokenizer.json`` ByteLevel piece → bytes)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
        cs = list(bs)
        extra = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    return _BYTE_DECODER


def load_pieces(path: str | Path) -> dict[int, str]:
    """Token texts from a Hugging Face ``tokenizer.json`` (byte-level or SentencePiece ``▁``
    pieces) or a JSON ``{id: text}`` / list-of-texts file.

    Raises:
        ValueError: the file is neither.
    """
    raw = jsonx.loads(Path(path).read_bytes())
    if isinstance(raw, list):
        return {i: str(t) for i, t in enumerate(raw)}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a tokenizer.json or a JSON {{id: text}} map")
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("vocab"), dict | list):
        vocab = model["vocab"]
        items = (
            vocab.items()
            if isinstance(vocab, dict)
            else ((entry[0], i) for i, entry in enumerate(vocab))
        )
        byte_level = "ByteLevel" in jsonx.dumps(raw.get("decoder") or {}).decode()
        decoder = _byte_decoder()
        out: dict[int, str] = {}
        for piece, token_id in items:
            if byte_level and all(ch in decoder for ch in piece):
                text = bytes(decoder[ch] for ch in piece).decode("utf-8", "replace")
            else:
                text = re.sub(r"^<0x([0-9A-Fa-f]{2})>$", lambda m: chr(int(m[1], 16)), piece)
                text = text.replace("▁", " ")
            out[int(token_id)] = text
        for added in raw.get("added_tokens") or ():
            out[int(added["id"])] = str(added["content"])
        return out
    try:
        return {int(k): str(v) for k, v in raw.items()}
    except ValueError:
        raise ValueError(f"{path}: expected a tokenizer.json or a JSON {{id: text}} map") from None


def detokenize_pieces(url: str, ids: Iterable[int], *, timeout_s: float = 10.0) -> dict[int, str]:
    """Each id's text through the tokenizer's ``POST /detokenize`` (one call per distinct id).
    An id it cannot decode is left out.

    Raises:
        OSError: the tokenizer cannot be reached at all (the first call failed).
    """
    out: dict[int, str] = {}
    first = True
    for token_id in sorted(set(ids)):
        request = urllib.request.Request(
            url.rstrip("/") + "/detokenize",
            data=jsonx.dumps({"tokens": [token_id]}),
            headers={"content-type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                answer = jsonx.loads(resp.read())
        except urllib.error.HTTPError:
            first = False
            continue
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if first:
                raise OSError(f"{url}/detokenize: {exc}") from exc
            continue
        first = False
        # ``answer``: the tokenizer's /detokenize response ({"prompt": text}), not a record.
        text = answer.get("prompt") if isinstance(answer, dict) else None
        if isinstance(text, str):
            out[token_id] = text
    return out


def load_drafter_vocabulary(path: str | Path) -> frozenset[int]:
    """The target ids a drafter can propose: EAGLE-3's ``{"d2t": [offset, …]}`` (target id =
    draft id + offset) or a JSON list of target ids (``{"token_ids": […]}`` too).

    Raises:
        ValueError: neither form.
    """
    raw = jsonx.loads(Path(path).read_bytes())
    if isinstance(raw, dict) and isinstance(raw.get("d2t"), list):
        return frozenset(i + int(off) for i, off in enumerate(raw["d2t"]))
    if isinstance(raw, dict) and isinstance(raw.get("token_ids"), list):
        raw = raw["token_ids"]
    if isinstance(raw, list) and all(isinstance(t, int) for t in raw):
        return frozenset(raw)
    raise ValueError(f'{path}: expected {{"d2t": [offsets]}} or a JSON list of target token ids')
