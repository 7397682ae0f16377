"""What the log says about failing shadow legs: the backend, its URL (no secrets), the error —
rate-limited per backend — and every breaker transition with the last error. Real sockets: a
closed loopback port and the scripted fake upstream as shadows."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from gateway.shadow import FailureLog, safe_url
from tests.fakes.upstream import Script, sse
from tests.gateway.test_shadow import CHAT, policy_yaml, raw_stream

BREAKER = "budgets: {breaker: {failures: 3, window_s: 30, cooldown_s: 0.3}}\n"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.shadow" and needle in r.getMessage()
    ]


async def one_exchange(gw, n: int) -> None:  # type: ignore[no-untyped-def]
    assert (await raw_stream(gw.url, {**CHAT, "max_tokens": 2}))[0] == 200
    await gw.sink.wait_for(lambda _e: len(gw.sink.exchanges) >= n)


async def test_a_shadow_on_a_closed_port_is_logged_by_name_url_and_error(
    sims, gateway, write_policy, caplog
):
    caplog.set_level(logging.INFO, logger="gateway.shadow")
    primary, dead = await sims(), closed_port_url()
    gw = await gateway(
        None, policy_path=write_policy(policy_yaml(primary.base_url, dead, extra=BREAKER))
    )
    for n in range(1, 4):
        await one_exchange(gw, n)
    failed = lines(caplog, "failed:")
    # Three failures within the interval: the first logged, the next two counted for later.
    assert len(failed) == 1, failed
    assert "backend cand" in failed[0] and dead in failed[0] and "candidate" in failed[0]
    assert "UpstreamConnectError" in failed[0]
    opened = lines(caplog, "closed → open")
    assert len(opened) == 1, caplog.text
    assert "cand" in opened[0] and dead in opened[0] and "UpstreamConnectError" in opened[0]
    assert "3 failures within 30 s" in opened[0]
    # The cooldown passes: one probe goes out, fails, and the breaker opens again.
    await asyncio.sleep(0.35)
    await one_exchange(gw, 4)
    assert len(lines(caplog, "open → half-open")) == 1, caplog.text
    reopened = lines(caplog, "half-open → open")
    assert len(reopened) == 1 and "UpstreamConnectError" in reopened[0] and dead in reopened[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_5xx_shadow_is_logged_as_its_status_and_a_good_probe_closes_the_breaker(
    sims, gateway, write_policy, fake_upstream, caplog
):
    caplog.set_level(logging.INFO, logger="gateway.shadow")
    primary = await sims()
    fake, url = await fake_upstream(Script(status=503, chunks=sse('{"error": "overloaded"}')))
    gw = await gateway(
        None, policy_path=write_policy(policy_yaml(primary.base_url, url, extra=BREAKER))
    )
    for n in range(1, 4):
        await one_exchange(gw, n)
    failed = lines(caplog, "failed:")
    assert len(failed) == 1 and "HTTP 503" in failed[0] and url in failed[0]
    opened = lines(caplog, "closed → open")
    assert len(opened) == 1 and "last error: HTTP 503" in opened[0]
    fake.script = Script(chunks=sse('{"choices": []}', "[DONE]"))  # the backend recovers
    await asyncio.sleep(0.35)
    await one_exchange(gw, 4)
    closed = lines(caplog, "half-open → closed")
    assert len(closed) == 1 and "cand" in closed[0] and url in closed[0], caplog.text
    legs = [r for r in fake.received if r.method == "POST"]  # (its /metrics are scraped too)
    assert len(legs) == 4  # three failures and the probe; nothing while open


def test_failures_are_rate_limited_per_backend_with_a_count_of_those_not_logged(caplog):
    caplog.set_level(logging.INFO, logger="gateway.shadow")
    now = [0]
    flog = FailureLog(interval_s=10.0, clock=lambda: now[0])
    assert flog.failed("a", "http://a:1", "candidate", "HTTP 503")
    assert flog.failed("b", "http://b:1", "baseline", "HTTP 502")  # another backend: its own line
    for _ in range(4):
        now[0] += int(1e9)
        assert not flog.failed("a", "http://a:1", "candidate", "HTTP 503")
    now[0] += int(7e9)  # 11 s after a's first line
    assert flog.failed("a", "http://a:1", "candidate", "UpstreamTimeout")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "4 more failures" in messages[2] and "UpstreamTimeout" in messages[2]
    assert "more failure" not in messages[0]


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("http://user:secret@llm:8000/v1?api_key=secret#x", "http://llm:8000/v1"),
        ("https://llm.example", "https://llm.example"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_urls_in_log_lines_carry_no_credentials_or_query(url: str, logged: str) -> None:
    assert safe_url(url) == logged
