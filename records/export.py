"""``specshadow records export``: production's own prompts and outputs as drafter training data.

The best drafter for a workload is trained on that workload's target outputs (speculators,
SpecForge). Records of the token tap's share hold exactly that: the prompt's ids as the engine's
chat template spelled them and the output's ids the engine generated (``tokens``,
docs/counterfactual.md). This module turns records into rows, streamed one record at a time:

- ``speculators``: pre-tokenised rows, ``input_ids`` = prompt ids + output ids and ``loss_mask``
  0 on every prompt position, 1 on every output position — the representation speculators' data
  preparation passes straight through (it only checks the two have the same length and that
  some position is supervised);
- ``conversations``: ``{"id": …, "conversations": [{"role": "user", …}, {"role": "assistant",
  …}]}`` from the text the capture setting kept (``capture: full`` or ``redacted``); the record keeps the
  prompt's text (its messages' contents joined by newlines), not its turns, so the prompt is one
  user turn. Rows need the text; a record with ids but no text is skipped and counted.

Every row carries its labels beside the data: ``exchange_id``, ``category``, ``greedy``,
``output_source`` (speculators rows: ``engine`` or ``leg:<backend>`` — the engine's own ids —
or a re-tokenizer's) and what a :data:`Labeller` adds (the CLI's labeller replays a speculative
configuration on the row: its acceptance and the classes of the tokens it rejected;
``counterfactual/labels.py``). Filters: category, window (applied where the records are read) and
acceptance (``min_acceptance``/``max_acceptance`` on the labelled draft acceptance rate, to weight
a training set toward where drafts fail); ``engine_ids_only`` keeps the speculators rows whose
output ids are the engine's own. A redaction hook (``module:function``) sees every row
last and returns it, changed or not, or ``None`` to drop it.

Only what the capture policy let the record keep is exported: no row is built from a record
without token ids (speculators) or text (conversations); :class:`ExportCounts` says how many
were skipped and why. Memory is one record and one row at a time.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

from core import jsonx
from records.reader import Record

__all__ = [
    "FORMATS",
    "ExportCounts",
    "ExportFilter",
    "LabelOptions",
    "Labeller",
    "LabellerFactory",
    "RedactError",
    "Redactor",
    "export_rows",
    "load_redactor",
    "write_rows",
]

Format = Literal["speculators", "conversations"]
FORMATS: tuple[Format, ...] = ("speculators", "conversations")

# A row's labels from one record: ``acceptance`` (the labelled draft acceptance rate, a number
# or None) is what the acceptance filters read; everything else is copied into the row.
Labeller = Callable[[Record], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class LabelOptions:
    """What a labeller is built from (the export command's flags): the configuration replayed
    on each row, and where token texts (to classify rejected tokens) and a drafter's vocabulary
    come from. The labeller itself is the counterfactual package's (``counterfactual.labels``)."""

    config: str | None = None
    token_texts: str | None = None  # a tokenizer.json or an {id: text} JSON file
    tokenizer: str | None = None  # a server whose POST /detokenize gives a token's text
    drafter_vocabulary: str | None = None  # EAGLE-3 d2t or a list of target ids


LabellerFactory = Callable[[LabelOptions], Labeller]
Redactor = Callable[[dict[str, Any]], dict[str, Any] | None]


class RedactError(ValueError):
    """A ``--redact`` hook that cannot be loaded, raised or returned something other than a row
    or None (the message says which, and on which exchange)."""


@dataclass(frozen=True, slots=True)
class ExportFilter:
    """Which records become rows: ``category`` (None: all) and the labelled acceptance bounds."""

    category: str | None = None
    min_acceptance: float | None = None
    max_acceptance: float | None = None
    engine_ids_only: bool = False  # speculators: skip rows whose output ids were re-tokenized

    @property
    def on_acceptance(self) -> bool:
        return self.min_acceptance is not None or self.max_acceptance is not None


@dataclass(slots=True)
class ExportCounts:
    """What happened to every record read: written, or skipped and why."""

    read: int = 0
    written: int = 0
    no_token_ids: int = 0  # speculators: the record holds no prompt or output ids
    no_text: int = 0  # conversations: the capture setting kept no prompt or output text
    empty_output: int = 0  # nothing to supervise
    not_engine_ids: int = 0  # engine_ids_only: the output ids are re-tokenized text
    other_category: int = 0
    no_acceptance: int = 0  # an acceptance filter is on, the row has no acceptance label
    outside_acceptance: int = 0
    redacted_away: int = 0  # the redaction hook returned None

    def as_json(self) -> dict[str, int]:
        return asdict(self)


def _speculators(record: Record) -> dict[str, Any] | str:
    tokens = record.tokens
    prompt = tokens.prompt if tokens is not None else None
    output = tokens.output if tokens is not None else None
    if tokens is None or prompt is None or output is None:
        return "no_token_ids"
    if not output:
        return "empty_output"
    return {
        "input_ids": [*prompt, *output],
        "loss_mask": [0] * len(prompt) + [1] * len(output),
        "output_source": tokens.output_source,
    }


def _conversations(record: Record) -> dict[str, Any] | str:
    prompt = record.request_text
    primary = record.primary
    output = primary.text if primary is not None else None
    if prompt is None or output is None:
        return "no_text"
    if not output:
        return "empty_output"
    return {
        "id": record.exchange_id,  # SpecForge's rows name themselves
        "conversations": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": output},
        ],
    }


def _engine_ids(row: Mapping[str, Any]) -> bool:
    """The output ids are the engine's own: the primary's, or a shadow's that answered the very
    same text (not text re-tokenized, which respells some tokens)."""
    source = row.get("output_source") or ""
    return source == "engine" or source.startswith("leg:")


_BUILDERS: dict[Format, Callable[[Record], dict[str, Any] | str]] = {
    "speculators": _speculators,
    "conversations": _conversations,
}


def export_rows(
    records: Iterable[Mapping[str, Any]],
    fmt: Format,
    *,
    where: ExportFilter = ExportFilter(),
    labeller: Labeller | None = None,
    redact: Redactor | None = None,
    counts: ExportCounts | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per record that passes, streamed; ``counts`` (updated as rows are drawn) says
    what happened to each record.

    Raises:
        ValueError: an acceptance filter without a labeller (nothing to filter on).
        RedactError: the redaction hook raised, or returned something other than a row or None.
    """
    if where.on_acceptance and labeller is None:
        raise ValueError("an acceptance filter needs acceptance labels (a labeller)")
    build = _BUILDERS[fmt]
    c = counts if counts is not None else ExportCounts()
    for raw in records:
        c.read += 1
        record = Record(raw)
        if where.category is not None and record.category != where.category:
            c.other_category += 1
            continue
        data = build(record)
        if isinstance(data, str):  # why there is no row: the counter's name
            setattr(c, data, getattr(c, data) + 1)
            continue
        if where.engine_ids_only and fmt == "speculators" and not _engine_ids(data):
            c.not_engine_ids += 1
            continue
        labels = dict(labeller(record)) if labeller is not None else {}
        if where.on_acceptance:
            acceptance = labels.get("acceptance")
            if not isinstance(acceptance, int | float):
                c.no_acceptance += 1
                continue
            if (where.min_acceptance is not None and acceptance < where.min_acceptance) or (
                where.max_acceptance is not None and acceptance > where.max_acceptance
            ):
                c.outside_acceptance += 1
                continue
        row: dict[str, Any] = {
            **data,
            "exchange_id": record.exchange_id,
            "category": record.category,
            "greedy": record.greedy,
            **labels,
        }
        if redact is not None:
            try:
                kept = redact(row)
            except Exception as exc:  # the operator's code: say where, stop the export
                raise RedactError(
                    f"the redaction hook raised on exchange {record.exchange_id}: {exc!r}"
                ) from exc
            if kept is None:
                c.redacted_away += 1
                continue
            if not isinstance(kept, dict):
                raise RedactError(
                    f"the redaction hook returned {type(kept).__name__} for exchange "
                    f"{record.exchange_id}: expected the row (a dict) or None"
                )
            row = kept
        c.written += 1
        yield row


def write_rows(rows: Iterable[Mapping[str, Any]], out: IO[bytes]) -> int:
    """Write ``rows`` as JSON lines; how many."""
    n = 0
    for row in rows:
        out.write(jsonx.dumps(row) + b"\n")
        n += 1
    return n


def load_redactor(spec: str) -> Redactor:
    """``module:function`` (or ``path/to/file.py:function``) → the function.

    Raises:
        RedactError: naming what could not be found.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RedactError(f"--redact {spec!r}: expected module:function")
    try:
        if target.endswith(".py"):
            path = Path(target)
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise RedactError(f"--redact {spec!r}: cannot load {target}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except (ImportError, OSError, SyntaxError) as exc:
        raise RedactError(f"--redact {spec!r}: cannot import {target}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RedactError(f"--redact {spec!r}: {target} has no function {attr!r}")
    redactor: Redactor = fn
    return redactor
