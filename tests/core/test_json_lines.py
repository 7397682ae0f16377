"""core.jsonx.json_lines: the one JSON-lines reader (records read back, report inputs, traces)."""

from __future__ import annotations

import pytest

from core import jsonx


def _invalid(number: int, exc: jsonx.JSONDecodeError) -> Exception:
    return LookupError(f"line {number}: {exc}")


def test_each_non_blank_line_is_decoded_and_blank_lines_still_count() -> None:
    lines = [b'{"a": 1}\n', b"\n", b"  \r\n", b"[2]\n", b"3"]
    assert list(jsonx.json_lines(lines, invalid=_invalid)) == [{"a": 1}, [2], 3]
    with pytest.raises(LookupError, match=r"^line 4: ") as info:
        list(jsonx.json_lines([b"1\n", b"\n", b"2\n", b"{oops\n"], invalid=_invalid))
    assert isinstance(info.value.__cause__, jsonx.JSONDecodeError)


def test_values_before_a_bad_line_are_yielded_first() -> None:
    seen: list[object] = []
    with pytest.raises(LookupError):
        seen.extend(jsonx.json_lines(["1", "nope", "2"], invalid=_invalid))
    assert seen == [1]
