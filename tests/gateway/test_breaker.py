"""The shadow/candidate circuit breaker: what counts against a backend, and that a half-open probe
which never reports is handed back (else the breaker stays half-open and the backend unused)."""

from __future__ import annotations

import pytest

from gateway.shadow import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, backend_verdict
from policies.compiled import BreakerSpec

SPEC = BreakerSpec(failures=2, window_s=10.0, cooldown_s=1.0)


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def advance(self, s: float) -> None:
        self.ns += int(s * 1e9)


def half_open() -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    breaker = CircuitBreaker(SPEC, clock=clock)
    breaker.record(False)
    breaker.record(False)
    assert breaker.state == OPEN and not breaker.allow()
    clock.advance(1.5)
    assert breaker.allow()  # the probe
    assert breaker.state == HALF_OPEN and not breaker.allow()  # one probe at a time
    return breaker, clock


@pytest.mark.parametrize(
    ("outcome", "status", "verdict"),
    [
        ("completed", 200, True),
        ("upstream_status", 429, True),  # the backend answered, as designed
        ("upstream_status", 400, True),
        ("upstream_status", 503, False),
        ("upstream_error", None, False),
        ("upstream_timeout", None, False),
        ("cancelled", None, None),
        ("deadline", None, None),
        ("client_disconnected", 200, None),  # the client left: nothing about the backend
    ],
)
def test_backend_verdict_counts_only_what_the_backend_did(
    outcome: str, status: int | None, verdict: bool | None
) -> None:
    assert backend_verdict(outcome, status) is verdict


def test_a_probe_without_a_verdict_is_handed_back_and_the_next_leg_probes() -> None:
    breaker, _ = half_open()
    breaker.observe(None)
    assert breaker.state == HALF_OPEN
    assert breaker.allow()  # the next leg may probe
    breaker.observe(True)
    assert breaker.state == CLOSED


def test_a_failed_probe_opens_again_and_a_good_one_closes() -> None:
    breaker, clock = half_open()
    breaker.observe(False)
    assert breaker.state == OPEN and not breaker.allow()
    clock.advance(1.5)
    assert breaker.allow()
    breaker.observe(True)
    assert breaker.state == CLOSED and breaker.allow()
