"""Benchmarks: real processes on 127.0.0.1, measured from the client's side (not timed tests).

- ``bench.harness``: the process fleet (start, readiness, always-kill), the stamped-SSE streaming
  client, per-request analysis, summaries and fixed-width tables.
- ``bench.proxy_overhead``: direct-to-upstream vs through the gateway, interleaved (issue 2).
- ``bench.shadow_isolation``: the primary's latency with shadows off / healthy / slow / hung /
  refusing, interleaved (issue 3).
- ``bench.raw_relay``: a minimal aiohttp relay, the floor any Python proxy is measured against.

See ``bench/README.md`` for how to run them and what each number is measured from and to.
"""
