"""The report's own names over its records (pure).

Records are read through :mod:`evidence.reader` (typed, lazy views next to the writer, which hold
every field name); this module holds what is the report's choice: the pooled category's name.
"""

from __future__ import annotations

from evidence.reader import Record

__all__ = ["ALL", "Record"]

ALL = "all"  # the pooled category: every category of the window together
