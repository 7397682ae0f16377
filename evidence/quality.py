"""What the quality tests read from one leg's output: scalars and a string-kernel sketch.

Sampled requests (temperature > 0, no seed) give a different text on every leg, so exact match
says nothing there. What a lossless candidate does promise is that its output, for the same
prompt, is a draw from the same distribution as the baseline's (a plain copy of production): the
two legs of one exchange are exchangeable. The report's tests (:mod:`report.quality`) and the
rollout's sampled-traffic guard compare the two legs through the values computed here, once per
leg, on the evidence worker's thread — never the text, so records stay free of it unless the
policy's ``capture`` allows:

- scalars (:class:`core.evidence.LegQuality`): output length, stopped at ``max_tokens``,
  repetition (distinct bigrams, repeated 4-grams, the longest repeated span), refusal, JSON
  validity where JSON was asked, tool-call validity, citation markers, similarity to the
  primary's output (the common reference);
- the **sketch**: the output's 4-grams (of its UTF-8 bytes) hashed (CRC-32) into ``SKETCH_DIM`` signed
  buckets, L2-normalised. Its dot product is a normalised spectrum string kernel, so the MMD
  between candidate and baseline outputs is computed from sketches alone. 4-grams of a typical
  output number in the hundreds; collisions in 128 buckets blur the kernel, they do not bias the
  test (both legs are hashed alike, and the test's null is exact under any fixed feature map).

A sketch is not the text and cannot be turned back into it, but it is a function of it: someone
holding a guessed output can check it against a sketch, as they can against the ``sha256`` that
records already carry.

Also here: :func:`speculation_skip`, the request parameters for which vLLM serves a request with
plain decoding even on a speculative server (frequency / presence / repetition penalties,
``min_p``) — such requests say nothing about speculation's speed and are kept out of it.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from core.evidence import LegQuality, SpeculationSkip
from core.exchange import LegResult
from evidence.compare import citations, is_refusal, looks_like_json, parse_json

SKETCH_DIM = 128
SKETCH_NGRAM = 4
MAX_SKETCH_CHARS = 16_384  # longer outputs are sketched on their first 16 KiB
MAX_REPEAT_WORDS = 10_000  # repetition statistics on the first 10k words

_WORDS = re.compile(r"\w+|[^\w\s]")
_INVALID_MARK = parse_json("\x00")  # the parser's invalid marker


def sketch(text: str) -> tuple[float, ...] | None:
    """The normalised hashed 4-gram vector of ``text`` (UTF-8 byte 4-grams, signed CRC-32
    buckets: stable across processes, so sketches from every gateway replica are comparable);
    None when it has no 4-gram."""
    data = text[:MAX_SKETCH_CHARS].encode()
    n = len(data) - SKETCH_NGRAM + 1
    if n <= 0:
        return None
    counts = Counter(
        map(data.__getitem__, map(slice, range(n), range(SKETCH_NGRAM, n + SKETCH_NGRAM)))
    )
    vec = [0.0] * SKETCH_DIM
    for gram, c in counts.items():
        h = zlib.crc32(gram)
        vec[h % SKETCH_DIM] += c if h & 0x10000 else -c
    norm = math.sqrt(sum(v * v for v in vec))
    if norm == 0.0:
        return None
    return tuple(round(v / norm, 4) for v in vec)


def _longest_repeat(words: Sequence[str]) -> int:
    """Length (in words) of the longest span occurring at least twice (binary search on n)."""

    def repeats(n: int) -> bool:
        seen: set[tuple[str, ...]] = set()
        for i in range(len(words) - n + 1):
            g = tuple(words[i : i + n])
            if g in seen:
                return True
            seen.add(g)
        return False

    lo, hi = 0, len(words) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if repeats(mid):
            lo = mid
        else:
            hi = mid - 1
    return max(lo, 0)


def repetition_stats(text: str) -> tuple[float | None, float | None, int]:
    """``(distinct_2, repetition, longest_repeat)`` of ``text``'s words and punctuation."""
    words = _WORDS.findall(text)[:MAX_REPEAT_WORDS]
    bigrams = [tuple(words[i : i + 2]) for i in range(len(words) - 1)]
    distinct_2 = len(set(bigrams)) / len(bigrams) if bigrams else None
    four = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    repetition = 1.0 - len(set(four)) / len(four) if four else None
    return distinct_2, repetition, _longest_repeat(words)


def leg_quality(
    leg: LegResult, *, expects_json: bool | None, similarity: float | None, sampled: bool
) -> LegQuality | None:
    """The quality scalars of one completed leg (None when it did not complete)."""
    rec = leg.recording
    if rec is None or leg.outcome != "completed" or not rec.choices:
        return None
    text = "".join(c.text for c in rec.choices)
    units = rec.output_tokens if rec.output_tokens is not None else len(_WORDS.findall(text))
    distinct_2, repetition, longest = repetition_stats(text)
    json_expected = expects_json if expects_json is not None else looks_like_json(text)
    calls = [t for c in rec.choices for t in c.tool_calls]
    tool_valid: bool | None = None
    if calls:
        tool_valid = all(
            bool(t.name) and isinstance(parse_json(t.arguments or "{}"), dict) for t in calls
        )
    return LegQuality(
        units=units,
        finish_length=any(c.finish_reason == "length" for c in rec.choices),
        distinct_2=distinct_2,
        repetition=repetition,
        longest_repeat=longest,
        refusal=any(is_refusal(c.text, c.refusal) for c in rec.choices),
        json_valid=(parse_json(text) is not _INVALID_MARK) if json_expected else None,
        tool_calls=len(calls),
        tool_valid=tool_valid,
        citations=len(citations(text)),
        similarity=similarity,
        sketch=sketch(text) if sampled else None,
    )


def speculation_skip(request_json: Mapping[str, Any] | None) -> SpeculationSkip | None:
    """Why vLLM would decode this request plainly on a speculative server, if it would."""
    if not request_json:
        return None

    def number(key: str) -> float | None:
        v = request_json.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    for key, neutral in (
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        v = number(key)
        if v is not None and v != neutral:
            return "penalty"
    min_p = number("min_p")
    if min_p is not None and min_p > 0:
        return "min_p"
    return None
