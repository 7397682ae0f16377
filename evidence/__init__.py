"""The evidence pipeline: what a finished exchange tells, computed once and handed to consumers.

Owns per-leg acceptance three ways (``acceptance``), the comparison of a shadow leg with the
primary (``compare``), every leg's token count on one footing (``counts``), output quality
scalars (``quality``) and target likelihoods (``likelihood``), the token tap (``tokens``), the
backends' ``/metrics`` scraper (``scrape``), what each backend says it runs (``serverinfo``; its
engine configuration reduced and fingerprinted: ``engine_config``) and what it is (``detect``), and the worker that turns every exchange into one
:class:`~core.evidence.Evidence` off the event loop (``worker``). The record it writes and every
store it goes to are :mod:`records`'.

Builds on :mod:`core` and :mod:`records` only: it knows nothing of the gateway that produced the
exchanges nor of the telemetry that consumes the evidence (see docs/architecture.md).
"""
