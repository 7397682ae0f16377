"""The report's sentence on token counts (report.counts): which footing the mirrored legs were
read on, tallied from records of known sources."""

from __future__ import annotations

from typing import Any

from records.reader import read_all
from report.counts import counts


def record(*sources: str | None) -> dict[str, Any]:
    roles = ["primary", "candidate", "baseline"]
    return {
        "legs": [
            {"role": roles[i], "output_tokens": None if s is None else 10, "tokens_source": s}
            for i, s in enumerate(sources)
        ]
    }


def test_every_footing_is_counted_and_said() -> None:
    c = counts(
        read_all(
            [
                record("usage", "usage"),
                record("matched", "usage"),
                record("tokenize", "tokenize", "tokenize"),
                record("estimated", "estimated"),
                record("estimated", None),  # a failed leg with no output is not a leg counted
                record("estimated"),  # not mirrored: nothing compared
            ]
        )
    )
    assert c.legs == 10 and c.own == 3 and c.exchanges_estimated == 2
    assert c.by_source == {"usage": 3, "matched": 1, "tokenize": 3, "estimated": 3}
    sentence = c.sentence()
    assert sentence is not None
    assert sentence.startswith("Token counts: 3 of 10 legs of mirrored exchanges carried")
    assert "1 (streams without usage" in sentence and "3 were counted" in sentence
    assert "3 in 2 exchanges were compared as estimates" in sentence


def test_nothing_is_said_when_every_leg_counted_itself() -> None:
    assert counts(read_all([record("usage", "logprobs")])).sentence() is None
    assert counts([]).sentence() is None
