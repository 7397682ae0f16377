"""Benchmarks: real processes on 127.0.0.1, measured from the client's side (not timed tests).

- the plumbing every benchmark shares: ``bench.fleet`` (the process fleet on ``core.procs``: start,
  readiness, always-stop; CPU pinning), ``bench.client`` (the stamped-SSE streaming client,
  interleaved arms), ``bench.analysis`` (per-request metrics through ``core.recorder``, summaries,
  distributions) and ``bench.tables`` (targets, fixed-width tables, run context, ``run_main``).
- ``bench.proxy_overhead``: direct-to-upstream vs through the gateway, interleaved (issue 2).
- ``bench.shadow_isolation``: the primary's latency with shadows off / healthy / slow / hung /
  refusing, interleaved (issue 3).
- ``bench.raw_relay``: a minimal aiohttp relay, the floor any Python proxy is measured against.
- ``bench.suite``: the performance suite (issue 8) — every arm and target in one run; its phases
  are in ``bench.phases``, the non-streaming closed loop in ``bench.throughput``, ``/proc``
  readings in ``bench.procstat``, the LiteLLM arm in ``bench.litellm_arm`` and the timestamp
  probe in ``bench.stamp_probe``.
- ``bench.profile_gateway``: py-spy samples of a loaded gateway, summarised by thread and frame.

See ``bench/README.md`` for how to run them and what each number is measured from and to, and
``docs/benchmarks.md`` for the suite's results.
"""
