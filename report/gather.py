"""Which engine sums the window: the choice above both. One ``chdb:///`` or ``clickhouse://``
store is summed in the engine (:mod:`report.sql`); any other sources are streamed once through
the Python fold (:mod:`report.population`). Neither engine imports the other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from records.stores import is_url, parse_store
from report import population, sql
from report.aggregates import SAMPLE, Population

__all__ = ["gather"]


def gather(
    sources: Sequence[str],
    *,
    since_unix_ns: int | None = None,
    until_unix_ns: int | None = None,
    sample: int = SAMPLE,
) -> tuple[Population, list[dict[str, Any]]]:
    """The window's population and its bounded sample, from any record sources: in the engine
    for one column store, else streamed in Python."""
    one = str(sources[0]) if len(sources) == 1 else ""
    if one and is_url(one) and parse_store(one).kind in ("chdb", "clickhouse"):
        return sql.gather(
            one, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, sample=sample
        )
    return population.gather(
        sources, since_unix_ns=since_unix_ns, until_unix_ns=until_unix_ns, sample=sample
    )
