"""What the report says about token counts: how many legs were counted by their own response,
and how the rest were put on one footing with the legs they were compared with (pure).

Every per-token figure of the report (TPOT, tokens per event, output length) divides by a count.
The evidence worker puts every leg of a mirrored exchange on one footing before comparing it
(:mod:`evidence.counts`: ``matched``, ``tokenize`` or — both legs alike — ``estimated``); this
module counts, over the legs of mirrored exchanges, which footing each one was read on, so the
report can say it in one sentence beside the figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from records.reader import Record

OWN = ("usage", "continuous_usage", "logprobs")


@dataclass(frozen=True, slots=True)
class Counts:
    """Legs of mirrored exchanges by the footing their count was read on."""

    legs: int
    by_source: dict[str, int]  # tokens_source → legs
    exchanges_estimated: int  # mirrored exchanges compared in estimated units

    @property
    def own(self) -> int:
        return sum(self.by_source.get(s, 0) for s in OWN)

    def sentence(self) -> str | None:
        """One sentence for the report; None when every leg was counted by its own response."""
        if self.legs == 0 or self.own == self.legs:
            return None
        matched = self.by_source.get("matched", 0)
        tokenized = self.by_source.get("tokenize", 0)
        estimated = self.by_source.get("estimated", 0)
        parts = [f"{self.own} of {self.legs} legs of mirrored exchanges carried their own count"]
        if matched:
            parts.append(
                f"{matched} (streams without usage, e.g. the openai SDK's default) took the exact "
                "count of a leg that answered the same output"
            )
        if tokenized:
            parts.append(
                f"{tokenized} were counted, with every leg of their exchange, by the engine's "
                "tokenizer on a shadow backend"
            )
        if estimated:
            parts.append(
                f"{estimated} in {self.exchanges_estimated} exchanges were compared as estimates "
                "(characters / 4 on every leg of the exchange alike: ratios hold, absolute token "
                "figures are rough)"
            )
        return (
            "Token counts: " + "; ".join(parts) + ". No estimate is compared with an exact count."
        )


def counts(records: Iterable[Record]) -> Counts:
    """Tally the legs of mirrored exchanges (those with more than one leg) by count source."""
    by: Counter[str] = Counter()
    legs = estimated = 0
    for r in records:
        if len(r.legs) < 2:
            continue
        sources = [leg.tokens_source for leg in r.legs if leg.output_tokens is not None]
        for s in sources:
            by[s or "unknown"] += 1
        legs += len(sources)
        estimated += "estimated" in sources
    return Counts(legs, dict(by), estimated)
