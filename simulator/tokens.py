"""The simulator's tokenizer (pure): a stable id per text piece, text and chat prompts as ids.

This is what ``POST /tokenize`` answers and what the speculative replay drafts over
(:mod:`simulator.ngram`), so a test or the product can rebuild every draft from the ids alone.

- **Pieces**: :func:`simulator.textgen.split_pieces` (JSON punctuation, a word with its leading
  space, whitespace runs, letter runs, 1–3 digits, any other character). Output tokens are
  pieces of the same tokenizer, so ``text_ids(output_text) == output ids`` for text and JSON
  answers (a tool call's output ids are its name as one piece, then its arguments' pieces).
- **Special pieces** ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` have ids 0, 1, 2 and are
  recognised inside text, as a Hugging Face tokenizer does.
- **Ids**: a fixed vocabulary (the specials, every ASCII character, 0–999, every simulator word
  with and without a capital and a leading space, the chat roles) gets the ids ``3 …``
  ``len(VOCABULARY) − 1`` in a fixed order, so no two pieces the simulator generates as text
  can share an id. Any other piece gets ``HASHED_BASE + blake2b(piece) mod (2³¹ − 1 −
  HASHED_BASE)``: stable across processes, below 2³¹ (fits an ``int32`` array as vLLM's are),
  disjoint from the fixed range; two distinct hashed pieces collide with probability about
  ``n² / 4·10⁹`` for ``n`` distinct ones — and a collision would change nothing the tests
  check, since drafts and acceptance are defined on the ids themselves.
- **Chat template** (ChatML-like): per message ``<|im_start|>``, the role, ``"\\n"``, the
  content's pieces, ``<|im_end|>``, ``"\\n"``; with ``add_generation_prompt`` then
  ``<|im_start|>``, ``assistant``, ``"\\n"``. Offered tools come first as a ``tools`` message whose
  content is their JSON. A message's content is its text (:func:`core.request_body.content_text`).
  There is no BOS token: ``add_special_tokens`` changes nothing.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from core import jsonx
from core.request_body import content_text
from simulator.textgen import WORDS, split_pieces

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_PIECES: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer", "tools")


def _vocabulary() -> tuple[str, ...]:
    pieces: list[str] = [*SPECIAL_PIECES, "\n", "\t", "\n\n", "  "]
    pieces += [chr(c) for c in range(32, 127)]
    pieces += [str(i) for i in range(1000)]
    pieces += [f"{i:02d}" for i in range(10)] + [f"{i:03d}" for i in range(100)]
    for word in (*WORDS, *ROLES):
        for form in (word, word.capitalize()):
            pieces += [form, " " + form]
    seen: dict[str, None] = {}
    for piece in pieces:
        seen.setdefault(piece, None)
    return tuple(seen)


VOCABULARY: tuple[str, ...] = _vocabulary()
HASHED_BASE = 1 << 20
_ID_SPACE = (1 << 31) - 1 - HASHED_BASE
_FIXED: dict[str, int] = {piece: i for i, piece in enumerate(VOCABULARY)}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_PIECES) + ")")

# Hashed pieces seen by this process, for :func:`decode` (bounded; ids never depend on it).
_SEEN: dict[int, str] = {}
_SEEN_MAX = 1 << 20
_SEEN_LOCK = threading.Lock()


def piece_id(piece: str) -> int:
    """The stable id of one piece (see the module doc)."""
    fixed = _FIXED.get(piece)
    if fixed is not None:
        return fixed
    h = int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=8).digest(), "big")
    token_id = HASHED_BASE + h % _ID_SPACE
    if token_id not in _SEEN and len(_SEEN) < _SEEN_MAX:
        with _SEEN_LOCK:
            _SEEN[token_id] = piece
    return token_id


def ids_of(pieces: Iterable[str]) -> list[int]:
    """The ids of already-split pieces (an answer's output tokens)."""
    return [piece_id(p) for p in pieces]


def text_pieces(text: str) -> list[str]:
    """``text`` as pieces, special pieces recognised."""
    out: list[str] = []
    for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            out.append(part)
        elif part:
            out += split_pieces(part)
    return out


def text_ids(text: str) -> list[int]:
    """The ids of ``text`` (a completions prompt, an answer's text)."""
    return ids_of(text_pieces(text))


def chat_pieces(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
) -> list[str]:
    """The chat template's pieces (see the module doc)."""
    out: list[str] = []

    def block(role: str, content: str) -> None:
        out.extend((IM_START, *text_pieces(role), "\n", *text_pieces(content), IM_END, "\n"))

    if tools:
        block("tools", jsonx.dumps(list(tools)).decode())
    for message in messages:
        block(str(message.get("role", "")), content_text(message.get("content")))
    if add_generation_prompt:
        out.extend((IM_START, "assistant", "\n"))
    return out


def chat_ids(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Any] | None = None,
) -> list[int]:
    """The ids of a chat prompt, as ``POST /tokenize`` with ``messages`` answers them."""
    return ids_of(chat_pieces(messages, add_generation_prompt=add_generation_prompt, tools=tools))


def content_pieces(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pieces of every message's content, in order (what a copying answer copies from)."""
    out: list[str] = []
    for message in messages:
        out += text_pieces(content_text(message.get("content")))
    return out


def decode_piece(token_id: int) -> str | None:
    """The piece of ``token_id``: fixed vocabulary, or a hashed piece this process has seen."""
    if 0 <= token_id < len(VOCABULARY):
        return VOCABULARY[token_id]
    return _SEEN.get(token_id)


def decode(token_ids: Iterable[int]) -> str:
    """The text of ``token_ids``; raises ``KeyError`` on an id this process cannot name."""
    pieces: list[str] = []
    for token_id in token_ids:
        piece = decode_piece(token_id)
        if piece is None:
            raise KeyError(token_id)
        pieces.append(piece)
    return "".join(pieces)
