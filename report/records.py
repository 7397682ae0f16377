"""The report's own names over its records (pure).

Records are read through :mod:`records.reader` (typed, lazy views next to the writer, which hold
every field name); this module re-exports the report's name for the pooled category (declared
once, in :mod:`core.classify`, for the counterfactual matrix too).
"""

from __future__ import annotations

from core.classify import ALL  # the pooled category: every category of the window together
from records.reader import Record

__all__ = ["ALL", "Record"]
