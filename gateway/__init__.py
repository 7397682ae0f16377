"""specshadow's gateway: an OpenAI-compatible proxy that mirrors, times and compares.

The request path (DESIGN §2)::

            ┌──────────────────── gateway/handlers.py ────────────────────┐
 client ──▶ │ receive (body read once) → policy.decide() → forward primary │──▶ client (bytes unchanged)
            │                 │                  │  tee: StreamRecorder.feed(chunk, t_ns)
            │                 │                  ▼
            │                 └─ sampled? ─▶ shadow.mirror() ─▶ shadow upstreams (tracked tasks)
            │                                     │
            │           all legs finished ─▶ Exchange ─▶ sink (compare, records, telemetry)
            └──────────────────────────────────────────────────────────────┘

Pure modules (no I/O): ``sse``, ``timings``, ``headers``, ``errors``, ``jsonx``.
I/O shells: ``handlers``, ``forward``, ``upstream``, ``tasks``, ``app``, ``cli``.
"""
