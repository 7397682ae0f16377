"""Labels for exported training rows (``specshadow records export``): how a speculative
configuration fares on each row.

A drafter training set is worth weighting toward where drafts fail. Each row is labelled with one
configuration replayed on its own ids (:mod:`.replay`: exact on greedy requests, one draw of the
configuration's acceptance on sampled ones): ``acceptance`` (accepted / drafted tokens, the
number the export's ``--min-acceptance``/``--max-acceptance`` filter), ``mean_acceptance_length``,
``drafted`` and ``accepted``, and ``acceptance_config`` naming the configuration. The
configuration is written as ``ngram:K:MIN-MAX`` (vLLM's n-gram proposer, depth ``K``, lookup
window) or ``draft:BACKEND:K`` (a declared drafter whose teacher-forced predictions the record
holds); the default is vLLM's n-gram at k = 4 over the 2-4 window. A row the configuration
cannot score (no ids; a drafter the record has no predictions of; nothing drafted) has
``acceptance`` ``null``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from counterfactual.grid import Config, parse_windows
from counterfactual.replay import Replay, drafter_offers, ngram_offers, replay
from records.export import Labeller
from records.reader import Record

__all__ = ["DEFAULT_CONFIG", "label_row", "labeller", "parse_config"]

DEFAULT_CONFIG = "ngram:4:2-4"


def parse_config(text: str) -> Config:
    """``ngram:4:2-4`` or ``draft:BACKEND:4`` → the configuration.

    Raises:
        ValueError: naming what is wrong.
    """
    parts = text.strip().split(":")
    try:
        if len(parts) == 3 and parts[0] == "ngram":
            ((lo, hi),) = parse_windows(parts[2])
            k = int(parts[1])
            if k < 1:
                raise ValueError
            return Config("ngram", k, lo, hi)
        if len(parts) == 3 and parts[0] == "draft" and parts[1]:
            k = int(parts[2])
            if k < 1:
                raise ValueError
            return Config("draft_model", k, drafter=parts[1])
    except ValueError:
        pass
    raise ValueError(
        f"acceptance configuration {text!r}: expected ngram:K:MIN-MAX (e.g. ngram:4:2-4) or "
        "draft:BACKEND:K, with K >= 1"
    )


def _replayed(record: Record, config: Config) -> Replay | None:
    tokens = record.tokens
    prompt = tokens.prompt if tokens is not None else None
    output = tokens.output if tokens is not None else None
    if tokens is None or prompt is None or output is None:
        return None
    k = config.num_speculative_tokens
    if config.proposer == "ngram":
        lo, hi = config.prompt_lookup_min or 1, config.prompt_lookup_max or 1
        available, match = ngram_offers(prompt, output, lo, hi, k)
    else:
        predicted = tokens.drafters.get(config.drafter or "")
        if predicted is None or len(predicted) != len(output):
            return None
        available, match = drafter_offers(output, predicted)
    return replay(len(output), k, available, match)


def label_row(record: Record, config: Config) -> dict[str, Any]:
    """The row's acceptance labels under ``config``."""
    r = _replayed(record, config)
    drafted = r.draft_tokens if r is not None else 0
    return {
        "acceptance_config": config.label,
        "acceptance": r.accepted / drafted if r is not None and drafted else None,
        "mean_acceptance_length": r.mean_acceptance_length if r is not None else None,
        "drafted": drafted,
        "accepted": r.accepted if r is not None else 0,
    }


def labeller(text: str | None) -> Labeller:
    """The export's labeller for configuration ``text`` (None: :data:`DEFAULT_CONFIG`).

    Raises:
        ValueError: a configuration that does not parse.
    """
    config = parse_config(text or DEFAULT_CONFIG)

    def label(record: Record) -> Mapping[str, Any]:
        return label_row(record, config)

    return label
