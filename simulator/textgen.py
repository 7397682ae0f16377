"""Deterministic output tokens from a prompt (pure): words, JSON documents, tool-call arguments.

The prompt's canonical bytes are hashed with blake2b; every random choice below comes from a
``random.Random`` seeded by that digest and a purpose label, so the same prompt gives the same
tokens in every mode and on every server — which is the lossless property of greedy speculative
decoding that the gateway's diffing relies on. Nothing here depends on ``max_tokens``: callers cut
the token list, so a shorter ``max_tokens`` yields a prefix.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core import jsonx

WORDS: tuple[str, ...] = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim",
    "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi",
    "aliquip", "ex", "ea", "commodo", "consequat", "duis", "aute", "irure", "in", "reprehenderit",
    "voluptate", "velit", "esse", "cillum", "fugiat", "nulla", "pariatur", "excepteur", "sint",
    "occaecat", "cupidatat", "non", "proident", "sunt", "culpa", "qui", "officia", "deserunt",
    "mollit", "anim", "id", "est", "laborum",
)  # fmt: skip

# A word keeps its leading space (as byte-level BPE does), so the answer's own tokens — " word",
# ".", "," from :func:`word_tokens` — split back into exactly themselves.
_PIECE = re.compile(r'[{}\[\],:]|"| [A-Za-z]+|\s+|[A-Za-z]+|\d{1,3}|.', re.DOTALL)


def digest(canonical: bytes) -> bytes:
    """The prompt hash that keys every deterministic choice."""
    return hashlib.blake2b(canonical, digest_size=16).digest()


def rng_for(label: str, prompt_digest: bytes, *extra: int) -> random.Random:
    """A private RNG for one purpose (``label``) of one prompt."""
    material = b"|".join([label.encode(), prompt_digest, *(str(x).encode() for x in extra)])
    return random.Random(int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big"))


def natural_length(prompt_digest: bytes, lo: int, hi: int) -> int:
    """Output length the 'model' would produce before its end token, in ``[lo, hi]``."""
    return rng_for("length", prompt_digest).randint(lo, hi)


def word_tokens(rng: random.Random, n: int) -> list[str]:
    """``n`` word-like tokens forming sentences; the last is ``"."`` (the natural end)."""
    tokens: list[str] = []
    capital = True
    for i in range(n):
        if i == n - 1 and n > 1:
            tokens.append(".")
            break
        if i > 0 and not capital and tokens[-1] not in {".", ","}:
            roll = rng.random()
            if roll < 0.07:
                tokens.append(".")
                capital = True
                continue
            if roll < 0.12:
                tokens.append(",")
                continue
        word = rng.choice(WORDS)
        if capital:
            word = word.capitalize()
            capital = False
        tokens.append(word if i == 0 else " " + word)
    return tokens


def copying_tokens(
    words_rng: random.Random,
    copy_rng: random.Random,
    n: int,
    source: Sequence[str],
    copy: float,
    split: Callable[[str], list[str]],
) -> list[str]:
    """``n`` tokens of text that repeats its context, ending in ``"."``.

    Segment by segment, with probability ``copy`` the answer copies a span of 4–24 pieces — of
    ``source`` (the prompt's content pieces) or, once it has 8 pieces, of itself (one time in
    three, or always without a source) — else it takes the next 4–16 tokens of the
    :func:`word_tokens` stream of ``words_rng``. The text is then split again with ``split`` (the
    tokenizer) and cut to ``n − 1`` pieces plus ``"."``, so splitting the answer's text (or any
    prefix cut at a token boundary) gives back exactly its tokens.
    """
    if n <= 1:
        return word_tokens(words_rng, n)
    words = word_tokens(words_rng, n + 1)[:-1]
    pieces: list[str] = []
    fresh = 0
    while len(pieces) < n or len(split("".join(pieces))) < n:
        if copy_rng.random() < copy:
            own = len(pieces) >= 8 and (not source or copy_rng.random() < 1 / 3)
            pool = pieces if own else source
            if len(pool) >= 4:
                length = min(copy_rng.randint(4, 24), len(pool))
                start = copy_rng.randrange(len(pool) - length + 1)
                pieces += pool[start : start + length]
                continue
        take = copy_rng.randint(4, 16)
        while fresh + take > len(words):  # splitting merged pieces: the text needs more
            words += word_tokens(words_rng, 64)[1:-1]
        pieces += words[fresh : fresh + take]
        fresh += take
    return [*split("".join(pieces))[: n - 1], "."]


def diverged_tokens(rng: random.Random, original: Sequence[str], start: int) -> list[str]:
    """``original`` with every token from index ``start`` on replaced by a different one."""
    out = list(original[:start])
    for tok in original[start:]:
        alt = " " + rng.choice(WORDS)
        while alt == tok:
            alt = " " + rng.choice(WORDS)
        out.append(alt)
    return out


def split_pieces(text: str) -> list[str]:
    """Tokenize text into BPE-like pieces whose concatenation is ``text`` (the simulator's one
    tokenizer: :mod:`simulator.tokens` gives the pieces their ids)."""
    return _PIECE.findall(text)


def token_logprobs(rng: random.Random, n: int) -> list[float]:
    """Plausible greedy logprobs (mostly near 0, sometimes lower)."""
    return [-round(rng.expovariate(3.0), 4) for _ in range(n)]


# ---------------------------------------------------------------- JSON from a JSON Schema


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    node: Any = root
    for part in ref[2:].split("/"):
        node = node.get(part, {}) if isinstance(node, Mapping) else {}
    return node if isinstance(node, Mapping) else {}


def _string_for(name: str, schema: Mapping[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date":
        return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
    if fmt == "email":
        return f"{rng.choice(WORDS)}@example.com"
    if fmt in ("uri", "url"):
        return f"https://example.com/{rng.choice(WORDS)}"
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
    text = " ".join(words)
    lname = name.lower()
    if any(key in lname for key in ("city", "location", "place")):
        text = rng.choice(("Jakarta", "Paris", "Lagos", "Lima", "Osaka", "Oslo"))
    min_len = int(schema.get("minLength", 0))
    max_len = schema.get("maxLength")
    while len(text) < min_len:
        text += " " + rng.choice(WORDS)
    if isinstance(max_len, int):
        text = text[:max_len]
    return text


def value_for_schema(
    schema: Mapping[str, Any],
    rng: random.Random,
    *,
    root: Mapping[str, Any] | None = None,
    name: str = "",
    depth: int = 0,
) -> Any:
    """A plausible value that validates against the common subset of JSON Schema.

    Objects fill their ``required`` properties (all properties when none are required); enums and
    consts pick from the schema; ``anyOf``/``oneOf`` take the first non-null branch; ``$ref``
    resolves within the document.
    """
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            non_null = [b for b in branches if isinstance(b, Mapping) and b.get("type") != "null"]
            return value_for_schema(
                (non_null or branches)[0], rng, root=root, name=name, depth=depth
            )
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of and isinstance(all_of[0], Mapping):
        return value_for_schema(all_of[0], rng, root=root, name=name, depth=depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props = schema.get("properties") if depth < 6 else None
        if not isinstance(props, Mapping):
            return {} if depth else {"answer": _string_for("answer", {}, rng)}
        required = schema.get("required")
        keys = (
            [k for k in required if k in props]
            if isinstance(required, list) and required
            else list(props)
        )
        return {
            k: value_for_schema(props[k], rng, root=root, name=k, depth=depth + 1) for k in keys
        }
    if kind == "array":
        items = schema.get("items")
        lo = int(schema.get("minItems", 1))
        hi = int(schema.get("maxItems", max(lo, 3)))
        count = rng.randint(lo, max(lo, hi)) if depth < 6 else lo
        item_schema = items if isinstance(items, Mapping) else {"type": "string"}
        return [
            value_for_schema(item_schema, rng, root=root, name=name, depth=depth + 1)
            for _ in range(count)
        ]
    if kind == "integer":
        lo_i = int(schema.get("minimum", 0))
        return rng.randint(lo_i, int(schema.get("maximum", lo_i + 100)))
    if kind == "number":
        lo_f = float(schema.get("minimum", 0.0))
        return round(rng.uniform(lo_f, float(schema.get("maximum", lo_f + 1.0))), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string_for(name, schema, rng)


def json_document(schema: Mapping[str, Any] | None, rng: random.Random) -> str:
    """A JSON text: fits ``schema`` when given, else a small generic object (``json_object``)."""
    if schema is None:
        value: Any = {
            "answer": _string_for("answer", {}, rng),
            "confidence": round(rng.random(), 2),
        }
    else:
        value = value_for_schema(schema, rng)
    return dump_json(value)


def dump_json(value: Any) -> str:
    """JSON with ``", "`` and ``": "`` separators, the way chat models write it."""
    if isinstance(value, Mapping):
        inner = ", ".join(
            f"{jsonx.dumps(str(k)).decode()}: {dump_json(v)}" for k, v in value.items()
        )
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump_json(v) for v in value) + "]"
    return jsonx.dumps(value).decode()
