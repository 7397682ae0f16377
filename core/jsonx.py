"""The project's only JSON codec: orjson behind two functions.

Everything that encodes or decodes JSON goes through here, so all JSON has one speed and one set of
semantics (ruff's banned-api rule forbids stdlib ``json`` in product code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError


def dumps(obj: Any, *, sort_keys: bool = False, indent: bool = False) -> bytes:
    """Encode to UTF-8 JSON bytes. Non-string dict keys and dataclasses are accepted."""
    option = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
    if sort_keys:
        option |= orjson.OPT_SORT_KEYS
    if indent:
        option |= orjson.OPT_INDENT_2
    return orjson.dumps(obj, option=option)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Decode JSON; raises :data:`JSONDecodeError` (a ``ValueError``) on bad input."""
    return orjson.loads(data)


def json_lines(
    lines: Iterable[bytes | str], *, invalid: Callable[[int, JSONDecodeError], Exception]
) -> Iterator[Any]:
    """The decoded value of each non-blank line of a JSON-lines file (``lines``: the file opened
    in binary, or its bytes split on ``\\n``). A line that does not parse raises
    ``invalid(line number, the decode error)`` — the caller's error, naming its source — from
    that error. Blank lines are skipped but counted."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except JSONDecodeError as exc:
            raise invalid(number, exc) from exc
        yield obj


def as_int(value: object) -> int | None:
    """A decoded JSON integer, else None (``true`` is not 1 here)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_number(value: object) -> float | None:
    """A decoded JSON number as a float, else None (booleans are not numbers here)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None
