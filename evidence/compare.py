"""Comparison: two legs of one exchange → a :class:`Comparison` (pure, bounded cost).

Runs in the record sink's worker thread, never on the request path. ``a`` is the reference leg
(the primary), ``b`` the leg judged against it (candidate, or baseline for the noise floor); deltas
are ``b − a`` and ratios ``b / a`` (a ratio below 1 means ``b`` was faster or shorter).

What is compared:

- **Output units.** Tokens when both legs carried logprobs (``ChoiceOutput.tokens`` on every
  choice), else characters. A leg's output is, per choice in index order: its text, then each tool
  call's name and arguments, then its refusal — the same order a token stream carries them.
- **exact_match / first_divergence.** Exact equality of those units (and finish reasons are *not*
  part of it); ``first_divergence`` is the index of the first differing unit (``None`` when equal),
  ``divergence_fraction`` that index over the longer output.
- **similarity** (0..1, bounded cost). Common prefix and suffix are stripped in linear time; the
  middle is matched with :class:`difflib.SequenceMatcher` over at most :data:`MAX_SIMILARITY_UNITS`
  units per side (tokens, else word pieces ``\\S+|\\s+``). Units beyond the cap count as unmatched,
  so a capped score is a lower bound (``similarity_capped``).
- **JSON** (requests with ``response_format`` json, or — when the request is unknown — outputs
  that look like a JSON document): both valid? semantically equal (parsed; key order ignored;
  ``true`` never equals ``1``)?
- **Tool calls:** same function names in the same order; parsed arguments equal (raw strings when
  either side is not valid JSON).
- **Refusal** (:func:`is_refusal`): the ``refusal`` field, or one of :data:`REFUSAL_PATTERNS` within
  the first :data:`REFUSAL_WINDOW_CHARS` characters. ``one_sided_refusal``: exactly one leg refused.
- **Citations:** ``[3]``-style markers (``[n]`` and ``[n, m]``), compared as sets.
- **Latency:** paired deltas and ratios of ttft, tpot, chunk-gap p50/p99, e2e, tokens per event.
- **flag:** only for greedy requests (temperature 0 or a fixed seed) that did not match exactly;
  sampled requests are never flagged one by one — they count only in distributions.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

from core import jsonx
from core.evidence import Comparison, LatencyDelta
from core.exchange import LegResult, Role
from core.timings import ChoiceOutput, Recording

MAX_SIMILARITY_UNITS = 2048  # per side, after stripping the common prefix and suffix
REFUSAL_WINDOW_CHARS = 300
REFUSAL_PATTERNS: tuple[str, ...] = (
    r"\bI(?:'m| am) (?:sorry|afraid|unable|not able)\b",
    r"\bI (?:can(?:not|'t)|won't|will not) (?:help|assist|comply|provide|do that|fulfil)",
    r"\bI must (?:decline|refuse)\b",
    r"\bAs an AI\b",
    r"\b(?:not able|unable) to (?:help|assist|comply) with\b",
)
_REFUSAL = re.compile("|".join(REFUSAL_PATTERNS), re.IGNORECASE)
_CITATION = re.compile(r"\[(\d{1,4}(?:\s*,\s*\d{1,4})*)\]")
_WORD_PIECES = re.compile(r"\S+|\s+")


def is_greedy(temperature: float | None, seed: int | None) -> bool:
    """Greedy requests are expected to match exactly: temperature 0, or a fixed seed."""
    return temperature == 0 or seed is not None


def is_refusal(text: str, refusal_field: str | None = None) -> bool:
    """The documented refusal detector (see the module docstring)."""
    if refusal_field:
        return True
    return _REFUSAL.search(text[:REFUSAL_WINDOW_CHARS]) is not None


def citations(text: str) -> tuple[int, ...]:
    """Sorted distinct ``[n]`` source numbers cited in ``text``."""
    found: set[int] = set()
    for match in _CITATION.finditer(text):
        found.update(int(n) for n in match.group(1).split(","))
    return tuple(sorted(found))


def json_equal(a: Any, b: Any) -> bool:
    """Parsed-JSON equality: key order ignored, ``true``/``1`` and ``1``/``1.0`` kept apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_INVALID = object()


def parse_json(text: str) -> Any:
    """The parsed document, or the module's ``_INVALID`` marker."""
    try:
        return jsonx.loads(text)
    except jsonx.JSONDecodeError:
        return _INVALID


def looks_like_json(text: str) -> bool:
    t = text.strip()
    return len(t) >= 2 and ((t[0], t[-1]) in (("{", "}"), ("[", "]")))


def _units(choices: Sequence[ChoiceOutput], tokens: bool) -> list[str] | str:
    if tokens:
        return [t for c in choices for t in (c.tokens or ())]
    parts: list[str] = []
    for c in choices:
        parts.append(c.text)
        for call in c.tool_calls:
            parts.extend((call.name or "", call.arguments))
        parts.append(c.refusal or "")
    return "".join(parts)


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def similarity(a: Sequence[Any], b: Sequence[Any]) -> tuple[float, bool]:
    """Bounded-cost similarity in [0, 1] and whether the cap cut the middle (lower bound)."""
    total = len(a) + len(b)
    if total == 0:
        return 1.0, False
    prefix = 0
    limit = min(len(a), len(b))
    while prefix < limit and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and a[len(a) - 1 - suffix] == b[len(b) - 1 - suffix]:
        suffix += 1
    mid_a = a[prefix : len(a) - suffix]
    mid_b = b[prefix : len(b) - suffix]
    capped = len(mid_a) > MAX_SIMILARITY_UNITS or len(mid_b) > MAX_SIMILARITY_UNITS
    matched = 0
    if mid_a and mid_b:
        matcher = difflib.SequenceMatcher(
            None, list(mid_a[:MAX_SIMILARITY_UNITS]), list(mid_b[:MAX_SIMILARITY_UNITS]), False
        )
        matched = sum(block.size for block in matcher.get_matching_blocks())
    return 2.0 * (prefix + suffix + matched) / total, capped


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def _latency(ra: Recording, rb: Recording) -> tuple[LatencyDelta, ...]:
    ta, tb = ra.timings, rb.timings
    pairs = (
        ("ttft_s", ta.ttft_s, tb.ttft_s),
        ("tpot_s", ta.tpot_s, tb.tpot_s),
        ("chunk_gap_p50_s", ta.chunk_gap_p50_s, tb.chunk_gap_p50_s),
        ("chunk_gap_p99_s", ta.chunk_gap_p99_s, tb.chunk_gap_p99_s),
        ("e2e_s", ta.e2e_s, tb.e2e_s),
        ("tokens_per_event", ta.tokens_per_event, tb.tokens_per_event),
    )
    return tuple(
        LatencyDelta(name, x, y, None if x is None or y is None else y - x, _ratio(x, y))
        for name, x, y in pairs
    )


def _text(rec: Recording) -> str:
    return "".join(c.text for c in rec.choices)


def _json_verdict(ta: str, tb: str) -> tuple[bool, bool, bool | None]:
    pa, pb = parse_json(ta), parse_json(tb)
    valid_a, valid_b = pa is not _INVALID, pb is not _INVALID
    return valid_a, valid_b, (json_equal(pa, pb) if valid_a and valid_b else None)


def _tool_verdict(ra: Recording, rb: Recording) -> tuple[bool | None, bool | None]:
    calls_a = [t for c in ra.choices for t in c.tool_calls]
    calls_b = [t for c in rb.choices for t in c.tool_calls]
    if not calls_a and not calls_b:
        return None, None
    names_equal = [t.name for t in calls_a] == [t.name for t in calls_b]
    if len(calls_a) != len(calls_b):
        return names_equal, False
    for x, y in zip(calls_a, calls_b, strict=True):
        px, py = parse_json(x.arguments or "{}"), parse_json(y.arguments or "{}")
        if px is _INVALID or py is _INVALID:
            if x.arguments != y.arguments:
                return names_equal, False
        elif not json_equal(px, py):
            return names_equal, False
    return names_equal, True


def compare(
    a: LegResult, b: LegResult, *, greedy: bool, expects_json: bool | None = None
) -> Comparison:
    """Judge leg ``b`` against leg ``a`` (the result names both legs' backends)."""
    return dataclasses.replace(
        _compare(a, b, greedy=greedy, expects_json=expects_json),
        a_backend=a.backend,
        b_backend=b.backend,
    )


def _compare(
    a: LegResult, b: LegResult, *, greedy: bool, expects_json: bool | None = None
) -> Comparison:
    """Judge leg ``b`` against leg ``a``.

    ``expects_json``: the request asked for JSON (``response_format`` json_object/json_schema);
    ``None`` when the request is unknown — then JSON is judged if either output looks like a
    JSON document.
    """
    ra, rb = a.recording, b.recording
    latency = _latency(ra, rb) if ra is not None and rb is not None else ()
    if (
        ra is None
        or rb is None
        or a.outcome != "completed"
        or b.outcome != "completed"
        or not ra.choices
        or not rb.choices
    ):
        return _incomparable(a.role, b.role, greedy, latency, bool(expects_json))
    use_tokens = all(c.tokens is not None for c in (*ra.choices, *rb.choices))
    ua, ub = _units(ra.choices, use_tokens), _units(rb.choices, use_tokens)
    first = _first_difference(ua, ub)
    exact = first is None
    if use_tokens:
        sim, capped = similarity(ua, ub)
    else:
        assert isinstance(ua, str)
        assert isinstance(ub, str)
        sim, capped = similarity(_WORD_PIECES.findall(ua), _WORD_PIECES.findall(ub))
    longer = max(len(ua), len(ub))
    text_a, text_b = _text(ra), _text(rb)
    json_expected = (
        expects_json
        if expects_json is not None
        else looks_like_json(text_a) or looks_like_json(text_b)
    )
    valid_a = valid_b = json_eq = None
    if json_expected:
        valid_a, valid_b, json_eq = _json_verdict(text_a, text_b)
    names_equal, args_equal = _tool_verdict(ra, rb)
    refusal_a = any(is_refusal(c.text, c.refusal) for c in ra.choices)
    refusal_b = any(is_refusal(c.text, c.refusal) for c in rb.choices)
    cites_a, cites_b = citations(text_a), citations(text_b)
    cited = bool(cites_a or cites_b)
    return Comparison(
        a=a.role,
        b=b.role,
        comparable=True,
        greedy=greedy,
        exact_match=exact,
        first_divergence=first,
        divergence_unit="token" if use_tokens else "char",
        divergence_fraction=None if first is None else first / longer,
        similarity=sim,
        similarity_capped=capped,
        finish_reason_equal=[c.finish_reason for c in ra.choices]
        == [c.finish_reason for c in rb.choices],
        length_ratio=_ratio(float(len(ua)), float(len(ub))),
        json_expected=bool(json_expected),
        json_valid_a=valid_a,
        json_valid_b=valid_b,
        json_equal=json_eq,
        tool_names_equal=names_equal,
        tool_arguments_equal=args_equal,
        refusal_a=refusal_a,
        refusal_b=refusal_b,
        one_sided_refusal=refusal_a != refusal_b,
        citations_a=cites_a if cited else None,
        citations_b=cites_b if cited else None,
        citations_equal=(cites_a == cites_b) if cited else None,
        latency=latency,
        flag=greedy and not exact,
    )


def _incomparable(
    a: Role, b: Role, greedy: bool, latency: tuple[LatencyDelta, ...], json_expected: bool
) -> Comparison:
    return Comparison(
        a=a,
        b=b,
        comparable=False,
        greedy=greedy,
        exact_match=None,
        first_divergence=None,
        divergence_unit=None,
        divergence_fraction=None,
        similarity=None,
        similarity_capped=False,
        finish_reason_equal=None,
        length_ratio=None,
        json_expected=json_expected,
        json_valid_a=None,
        json_valid_b=None,
        json_equal=None,
        tool_names_equal=None,
        tool_arguments_equal=None,
        refusal_a=None,
        refusal_b=None,
        one_sided_refusal=None,
        citations_a=None,
        citations_b=None,
        citations_equal=None,
        latency=latency,
        flag=False,
    )
