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

With token texts (a ``tokenizer.json`` or ``{id: text}`` file, or a tokenizer server's
``/detokenize``, asked once per distinct id and kept: bounded by the vocabulary), ``rejections``
counts, per class of :mod:`.rejections` (every class present, zeros included, so every row has
the same shape), the target tokens at which the configuration's drafting steps were first
rejected on this row; without texts it is ``null``. With a drafter's vocabulary (EAGLE-3's
``d2t`` or a list of target ids), ``out_of_vocabulary`` counts the row's output tokens the
drafter cannot propose — rejections by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from counterfactual.grid import Config, parse_windows
from counterfactual.rejections import (
    CLASSES,
    classify_output,
    detokenize_pieces,
    load_drafter_vocabulary,
    load_pieces,
)
from counterfactual.replay import Replay, drafter_offers, ngram_offers, replay
from records.export import Labeller, LabelOptions
from records.reader import Record

__all__ = ["DEFAULT_CONFIG", "TokenTexts", "label_row", "labeller", "parse_config"]

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


class TokenTexts:
    """Token id → text: a file's table, or a tokenizer's ``/detokenize`` asked once per id."""

    __slots__ = ("table", "url")

    def __init__(self, table: Mapping[int, str] | None = None, url: str | None = None) -> None:
        self.table: dict[int, str] = dict(table or {})
        self.url = url

    def pieces(self, ids: list[int]) -> list[str]:
        if self.url is not None:
            missing = {t for t in ids if t not in self.table}
            if missing:
                self.table.update(detokenize_pieces(self.url, missing))
                self.table.update((t, "") for t in missing if t not in self.table)
        return [self.table.get(t, "") for t in ids]


def label_row(
    record: Record,
    config: Config,
    texts: TokenTexts | None = None,
    vocabulary: frozenset[int] | None = None,
) -> dict[str, Any]:
    """The row's labels under ``config`` (module doc)."""
    r = _replayed(record, config)
    drafted = r.draft_tokens if r is not None else 0
    labels: dict[str, Any] = {
        "acceptance_config": config.label,
        "acceptance": r.accepted / drafted if r is not None and drafted else None,
        "mean_acceptance_length": r.mean_acceptance_length if r is not None else None,
        "drafted": drafted,
        "accepted": r.accepted if r is not None else 0,
    }
    tokens = record.tokens
    output = tokens.output if tokens is not None else None
    if texts is not None:
        rejections: dict[str, int] | None = None
        if r is not None and output:
            classes = classify_output(texts.pieces(output))
            rejections = dict.fromkeys(CLASSES, 0)
            for pos in r.rejected_at:
                rejections[classes[pos]] += 1
        labels["rejections"] = rejections
    if vocabulary is not None:
        labels["out_of_vocabulary"] = (
            sum(t not in vocabulary for t in output) if output is not None else None
        )
    return labels


def _address(url: str) -> str:
    """``http://host:port/…`` → ``host:port`` (a record's ``server_address``)."""
    parsed = urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.hostname}:{port}"


def labeller(options: LabelOptions) -> Labeller:
    """The export's labeller (:class:`records.export.LabelOptions`: the configuration, default
    :data:`DEFAULT_CONFIG`; token texts; a drafter's vocabulary).

    Raises:
        ValueError: a configuration that does not parse, or a file that is not what it says
            (and, from the labeller, a ``tokenizer`` that is a record's primary server).
        OSError: a file that cannot be read.
    """
    config = parse_config(options.config or DEFAULT_CONFIG)
    texts: TokenTexts | None = None
    if options.token_texts is not None:
        texts = TokenTexts(load_pieces(options.token_texts))
    elif options.tokenizer is not None:
        texts = TokenTexts(url=options.tokenizer)
    vocabulary = (
        load_drafter_vocabulary(options.drafter_vocabulary)
        if options.drafter_vocabulary is not None
        else None
    )

    primary_guard = _address(options.tokenizer) if options.tokenizer is not None else None

    def label(record: Record) -> Mapping[str, Any]:
        primary = record.primary
        if (
            primary_guard is not None
            and primary is not None
            and primary.server_address == primary_guard
        ):
            raise ValueError(
                f"--tokenizer {options.tokenizer} is the primary's server ({primary_guard}): "
                "give a candidate's or the tokenizer backend's (production never pays)"
            )
        return label_row(record, config, texts, vocabulary)

    return label
