"""A short soak in CI: 20 s (and at least 240 requests) of mixed traffic with faulty shadows
and leaving clients against a gateway subprocess; nothing leaks (sockets, tasks, in-flight counts)
and memory does not climb. Every socket is accounted for by its peer (``/proc/net/tcp``), not by a
total with slack. The long version is ``scripts/soak.py``."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.reliability.soak import SoakConfig, run_soak

pytestmark = pytest.mark.e2e


async def test_a_short_soak_with_faulty_shadows_leaks_no_sockets_tasks_or_memory(
    tmp_path, record_property
):
    cfg = SoakConfig(duration_s=20.0, min_requests=240)
    result = await run_soak(cfg, tmp_path)
    summary = result.to_json()
    for key, value in summary.items():
        record_property(key, value)
    assert result.warm is not None and result.final is not None
    assert result.errors == []  # zero primary errors among every request that stayed
    # The traffic is a count, not a rate: at least 240 requests after the warm-up however slow
    # the machine, numbered 0..n-1; every one answered whole except the streamed ones whose client
    # left after the first chunk by design (every 17th, streamed: every 34th).
    n = result.requests - result.warmup_requests
    assert n >= cfg.min_requests
    left = len(range(0, n, 2 * cfg.disconnect_every))
    want = Counter(ok=result.requests - left, client_left=left)
    assert result.outcomes == want, result.outcomes
    # Every faulty shadow kind was exercised, and failures were contained as counts.
    events = {(c["event"], c["backend"]) for c in result.shadow_counts}
    assert {("failed", f"f_{k}") for k in ("hang", "e500", "reset", "refused")} <= events
    # After traffic and an idle moment: nothing in flight, only the policy watcher task left.
    final, warm = result.final, result.warm
    assert final.in_flight == 0 and final.primary_in_flight == 0
    assert final.tasks <= 1, final
    # Sockets: the clients left and the pools' keep-alive (1 s) passed, so every connection to
    # a backend or from a client that was open after the drain has closed — none kept, none
    # leaked; no allowance for pool sizes. (The engine probe polls on, on fresh connections.)
    assert result.still_open == 0, (result.held_at_drain, final)
    # 20 s is too short for a slope (the gateway's in-memory ring of the last 1000 exchanges is
    # still filling); scripts/soak.py measures it over minutes. Here: bounded growth.
    assert final.rss_kib - warm.rss_kib < 64 * 1024
