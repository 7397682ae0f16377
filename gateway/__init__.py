"""specshadow's gateway: an OpenAI-compatible proxy that relays the primary byte for byte, mirrors
a sampled share to shadow legs, and hands every finished exchange to its sinks.

The request path::

            ┌───────────── gateway/proxy.py (gateway/handlers.py is the aiohttp shell) ──────────┐
 client ──▶ │ receive (body read once) → policy.decide() → forward primary (legs.LegRun)         │──▶ client
            │                 │                  │  tee: StreamRecorder.feed(chunk, t_ns)         │   (bytes unchanged)
            │                 └─ sampled? ─▶ shadow.ShadowDispatcher.launch() ─▶ shadow upstreams │
            │           all legs finished ─▶ Exchange ─▶ sinks (the evidence pipeline, tests…)    │
            └─────────────────────────────────────────────────────────────────────────────────────┘

Pure modules: ``headers``, ``errors``. I/O shells: ``handlers``, ``proxy``, ``legs``, ``shadow``,
``forward``, ``upstream``, ``retry``, ``app``, ``admin``, ``serve``. Builds on :mod:`core`,
:mod:`policies` and :mod:`otel` (docs/architecture.md).
"""
