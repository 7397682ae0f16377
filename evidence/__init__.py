"""The evidence pipeline: what a finished exchange tells, computed once and handed to consumers.

Owns request classification (``classify``), per-leg acceptance three ways (``acceptance``), the
comparison of a shadow leg with the primary (``compare``), the backends' ``/metrics`` scraper
(``scrape``), the comparison record and its schema (``schema``; docs/records.md), the embedded
SQLite store and its writer (``store``), reading records back from stores and files
(``sources``), the worker that turns every exchange into one :class:`~core.evidence.Evidence`
off the event loop (``worker``) and ``specshadow records`` (``cli``).

Builds on :mod:`core` only: it knows nothing of the gateway that produced the exchanges nor of
the telemetry that consumes the evidence (see docs/architecture.md).
"""
