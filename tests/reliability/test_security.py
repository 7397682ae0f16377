"""Security: secrets stay with the primary, upstreams come only from configuration, admin is
closed to strangers, and no text is kept unless the policy's capture allows it."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.admin import AdminForbidden, authorize
from gateway.state import GATEWAY
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from policies.compile import load_policy
from policies.errors import PolicyError
from tests.fakes.upstream import Script
from tests.reliability.helpers import chat, fetch, shadow_policy

CANARY = "sk-CANARY-7f3a9c"
JSON_OK = Script(headers=[("Content-Type", "application/json")], chunks=[(0, b'{"ok":1}')])

SECRET_HEADERS = {
    "Authorization": f"Bearer {CANARY}",
    "Proxy-Authorization": f"Basic {CANARY}",
    "Cookie": f"session={CANARY}",
    "X-Api-Key": CANARY,
    "X-API-KEY": CANARY,
    "api-key": CANARY,
    "x-goog-api-key": CANARY,
    "anthropic-api-key": CANARY,
    "X-Auth-Token": CANARY,
    "OpenAI-Organization": f"org-{CANARY}",
    "baggage": f"user.id={CANARY},session={CANARY}",
    "tracestate": f"vendor={CANARY}",
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
}


async def test_no_client_secret_or_trace_context_baggage_reaches_a_shadow(
    fake_upstream, gateway, write_policy, monkeypatch
):
    monkeypatch.setenv("CAND_KEY", "sk-shadow-own")
    primary, primary_url = await fake_upstream(JSON_OK)
    shadow, shadow_url = await fake_upstream(JSON_OK)
    text = (
        "version: 1\n"
        f"backends:\n  cand: {{url: '{shadow_url}', kind: openai, api_key_env: CAND_KEY}}\n"
        "default:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
        "headers:\n  allow: [x-tenant]\n"
    )
    # Tracing on (an exporter configured), so the shadow leg has a span of its own.
    telemetry = build_telemetry(TelemetrySettings(), span_exporter=InMemorySpanExporter())
    gw = await gateway(primary_url, telemetry=telemetry, policy_path=write_policy(text))
    async with aiohttp.ClientSession() as session:
        for headers in (SECRET_HEADERS, {k.upper(): v for k, v in SECRET_HEADERS.items()}):
            reply = await fetch(session, gw.url, chat(stream=False), headers)
            assert reply.status == 200
    await gw.sink.wait_for(lambda e: bool(e.shadows) and len(shadow.received) == 2)
    for seen in shadow.received:
        assert CANARY not in repr(seen.raw_headers) and CANARY.encode() not in seen.body
        assert seen.headers["authorization"] == "Bearer sk-shadow-own"
        assert "baggage" not in seen.headers and "tracestate" not in seen.headers
        # The shadow continues the client's trace (a trace id is not a secret) with its own span.
        assert seen.headers["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert seen.headers["traceparent"].split("-")[2] != "00f067aa0ba902b7"
    # The primary is the client's own endpoint: it gets what the client sent.
    assert primary.received[0].headers["x-api-key"] == CANARY
    assert primary.received[0].headers["baggage"] == SECRET_HEADERS["baggage"]


@pytest.mark.parametrize("name", ["x-api-key", "authorization", "cookie", "x-auth-token"])
def test_a_policy_cannot_allow_credential_headers_to_shadows_by_accident(tmp_path, name):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\n"
        "backends:\n  cand: {url: 'http://127.0.0.1:9', kind: openai}\n"
        "default:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
        f"headers:\n  allow: [{name}]\n"
    )
    with pytest.raises(PolicyError, match="headers"):
        load_policy(path, primary_url="http://127.0.0.1:8")


# -- no upstream choice from client input --------------------------------------------------------


async def raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is on a fresh connection; the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def post_bytes(target: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {target} HTTP/1.1", "Host: 127.0.0.1", *headers]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_no_client_input_chooses_the_upstream(fake_upstream, gateway):
    primary, primary_url = await fake_upstream(JSON_OK)
    evil, evil_url = await fake_upstream(JSON_OK)
    evil_host = evil_url.removeprefix("http://")
    gw = await gateway(primary_url)
    port = gw.server.port
    assert port is not None
    body = json.dumps(
        {
            **chat(stream=False),
            "base_url": evil_url,
            "api_base": evil_url,
            "baseURL": evil_url,
            "url": evil_url,
        }
    ).encode()
    attempts = [
        post_bytes("/v1/chat/completions", body, f"X-Forwarded-Host: {evil_host}"),
        post_bytes("/v1/chat/completions", body, "Forwarded: host=" + evil_host),
        post_bytes(f"{evil_url}/v1/chat/completions", body),  # absolute-form target
        post_bytes("/v1/chat/completions", body).replace(
            b"Host: 127.0.0.1", f"Host: {evil_host}".encode()
        ),
        post_bytes(f"//{evil_host}/v1/chat/completions", body),
        post_bytes(f"/v1/models/..%2F..%2F@{evil_host}", body),
        post_bytes(f"/v1/@{evil_host}/v1/chat/completions", body),
        post_bytes(f"/v1/chat/completions?url=http://{evil_host}/", body),
    ]
    statuses = [(await raw_http(port, raw))[0] for raw in attempts]
    assert evil.received == []
    # Each attempt either reached the configured primary or was refused by the gateway itself.
    assert all(status in (200, 400, 404) for status in statuses), statuses
    assert len(primary.received) >= 5
    assert statuses[:4] == [200, 200, 200, 200]


async def test_shadows_go_only_where_the_policy_says(fake_upstream, gateway, write_policy):
    _primary, primary_url = await fake_upstream(JSON_OK)
    shadow, shadow_url = await fake_upstream(JSON_OK)
    evil, evil_url = await fake_upstream(JSON_OK)
    text = (
        "version: 1\n"
        f"backends:\n  cand: {{url: '{shadow_url}', kind: openai}}\n"
        "default:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
    )
    gw = await gateway(primary_url, policy_path=write_policy(text))
    async with aiohttp.ClientSession() as session:
        reply = await fetch(
            session,
            gw.url,
            {**chat(stream=False), "base_url": evil_url},
            {"X-Forwarded-Host": evil_url.removeprefix("http://"), "X-Specshadow-Backend": "evil"},
        )
    assert reply.status == 200
    await gw.sink.wait_for(lambda e: bool(e.shadows))
    assert len(shadow.received) == 1 and evil.received == []


# -- admin endpoints ------------------------------------------------------------------------------


def _peer(address: str | None) -> Mock:
    """An asyncio transport as the framework sees it: only its peername matters here."""
    transport = Mock()
    peer = None if address is None else (address, 40000)
    transport.get_extra_info.side_effect = lambda name, default=None: (
        peer if name == "peername" else default
    )
    return transport


@pytest.mark.parametrize(
    ("peer", "headers", "allowed"),
    [
        ("127.0.0.1", {}, True),
        ("127.0.0.2", {}, True),
        ("::1", {}, True),
        ("::ffff:127.0.0.1", {}, True),  # an IPv4 client on a dual-stack listener
        ("203.0.113.7", {}, False),
        ("10.0.0.5", {}, False),
        ("::ffff:203.0.113.7", {}, False),
        ("2001:db8::1", {}, False),
        (None, {}, False),
        ("203.0.113.7", {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}, False),
        ("203.0.113.7", {"Forwarded": "for=127.0.0.1"}, False),
        ("203.0.113.7", {"Authorization": "Bearer wrong"}, False),
        ("203.0.113.7", {"Authorization": "Bearer s3cret-admin "}, False),
        ("203.0.113.7", {"Authorization": "s3cret-admin"}, False),
        ("203.0.113.7", {"Authorization": "Bearer s3cret-admin"}, True),
    ],
)
async def test_admin_authorize_admits_only_loopback_or_the_token(
    fake_upstream, gateway, peer, headers, allowed
):
    _fake, up = await fake_upstream(JSON_OK)
    gw = await gateway(up, admin_token="s3cret-admin")
    tokenless = await gateway(up)
    for app, token_ok in ((gw.server.app, True), (tokenless.server.app, False)):
        assert app is not None and app[GATEWAY] is not None
        request = make_mocked_request(
            "GET", "/admin/shadow", headers=headers, app=app, transport=_peer(peer)
        )
        expect = allowed and (token_ok or "Authorization" not in headers)
        if expect:
            authorize(request)
        else:
            with pytest.raises(AdminForbidden):
                authorize(request)


def _non_loopback_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.e2e
async def test_admin_over_a_real_non_loopback_socket_needs_the_token(fake_upstream):
    from tests.reliability.helpers import spawn_gateway

    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    _fake, up = await fake_upstream(JSON_OK)
    async with spawn_gateway(
        ["--host", "0.0.0.0", "--primary", up], {"SPECSHADOW_ADMIN_TOKEN": "t0k"}
    ) as gp:
        port = gp.url.rsplit(":", 1)[1]
        async with aiohttp.ClientSession() as session:
            for path in ("/admin/policy", "/admin/shadow"):
                async with session.get(f"http://{address}:{port}{path}") as resp:
                    assert resp.status == 403
                    assert (await resp.json())["error"]["code"] == "admin_forbidden"
                async with session.get(
                    f"http://{address}:{port}{path}", headers={"Authorization": "Bearer t0k"}
                ) as resp:
                    assert resp.status == 200
                async with session.get(f"{gp.url}{path}") as resp:
                    assert resp.status == 200  # loopback


# -- no text unless capture allows it --------------------------------------------------------------

SECRET_PROMPT = "my-private-prompt-zebra-4711 patient record"


def _store_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


@pytest.mark.parametrize("capture", ["off", "full"])
async def test_no_prompt_or_output_text_reaches_records_or_spans_unless_capture_allows(
    sims, gateway, write_policy, tmp_path, capture
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    extra = "capture: {text: full}\n" if capture == "full" else ""
    text = shadow_policy(primary.base_url, candidate.base_url, extra=extra)
    spans = InMemorySpanExporter()
    store = tmp_path / "records.sqlite"
    gw = await gateway(
        None,
        policy_path=write_policy(text),
        store_path=str(store),
        telemetry=build_telemetry(TelemetrySettings.from_env({}), span_exporter=spans),
    )
    async with aiohttp.ClientSession() as session:
        for stream in (True, False):
            reply = await fetch(session, gw.url, chat(stream=stream, prompt=SECRET_PROMPT))
            assert reply.status == 200
    exchange = await gw.sink.wait_for(lambda e: bool(e.shadows))
    output = exchange.primary.recording.choices[0].text if exchange.primary.recording else ""
    assert len(output) > 20
    await wait_for_count(gw, 2)
    await gw.server.close()  # flushes the record store and the span processors
    stored = _store_bytes(store)
    assert len(stored) > 4096
    seen_spans = repr(
        [
            (s.attributes, [(e.name, e.attributes) for e in s.events])
            for s in spans.get_finished_spans()
        ]
    ).encode()
    for needle in (SECRET_PROMPT.encode(), b"zebra-4711", output.encode(), output[:24].encode()):
        if capture == "off":
            assert needle not in stored
            assert needle not in seen_spans
    if capture == "full":
        assert b"zebra-4711" in stored and output[:24].encode() in stored


async def wait_for_count(gw: Any, n: int) -> None:
    from tests.reliability.helpers import wait_for_exchanges

    await wait_for_exchanges(gw.sink, n)
    await asyncio.sleep(0.2)  # the record writer thread commits when its queue runs empty


async def test_a_wrong_admin_token_is_told_apart_from_a_missing_one(fake_upstream, gateway):
    """The 403 says which: no header, a header not of the Bearer form, or a wrong token — and
    never echoes what was sent."""
    _fake, up = await fake_upstream(JSON_OK)
    gw = await gateway(up, admin_token="s3cret-admin")
    app = gw.server.app
    messages = []
    for headers in ({}, {"Authorization": "s3cret-admin"}, {"Authorization": "Bearer guess-1"}):
        request = make_mocked_request(
            "GET", "/admin/shadow", headers=headers, app=app, transport=_peer("203.0.113.7")
        )
        with pytest.raises(AdminForbidden) as info:
            authorize(request)
        messages.append(str(info.value))
    assert "no Authorization header was sent" in messages[0]
    assert "not 'Bearer <token>'" in messages[1]
    assert "the token sent is not the admin token" in messages[2]
    assert not any("guess-1" in m or "s3cret" in m for m in messages)
