"""Comparison records: schema (``schema``), embedded SQLite store (``store``), the exchange sink
that writes them off the event loop (``sink``), and ``specshadow records`` (``cli``).

The record schema is documented in docs/records.md.
"""

from gateway.records.schema import SCHEMA, build_record
from gateway.records.sink import RecordEvidence, RecordHook, RecordSink, build_record_sink
from gateway.records.store import RecordStore, query_records

__all__ = [
    "SCHEMA",
    "RecordEvidence",
    "RecordHook",
    "RecordSink",
    "RecordStore",
    "build_record",
    "build_record_sink",
    "query_records",
]
