"""The ``specshadow`` command and the product assembled: the top of the package graph.

Owns the console script (``main``), ``specshadow serve``'s command line (``serve``), the
composition of gateway, evidence pipeline, telemetry and records (``app``), the demo (``demo``),
the in-process gateway used by the demo and the real-vLLM checks (``inprocess``) and the agreement
check with ``vllm bench serve`` (``agreement``). It is the only package that may import every
other (docs/architecture.md).
"""
