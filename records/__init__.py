"""The comparison record, declared once: one versioned JSON object per exchange.

Owns everything that knows a record's fields: the writer (``writer``: an exchange's evidence →
the record, docs/records.md), the typed reader every consumer reads records through (``reader``),
the derived rules written once with their SQL forms (``rules``: buckets, the completed leg, no
category, ``ALL``, the canonical order), the wide row of the column stores (``wide``), the stores
(``sqlite_store``: the embedded SQLite store; ``clickhouse``: ClickHouse servers and chDB;
``stores``: a store named by URL, opened, copied), reading records back from stores and OTLP
JSON lines (``readback``), and ``specshadow records`` with the ``--store`` argument every command
shares (``cli``).

Builds on :mod:`core` only: what computes the evidence (``evidence``) writes through it, what
reads records (``report``, ``counterfactual``) reads through it.
"""
