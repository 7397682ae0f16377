"""Telemetry from a running gateway, checked at real receivers: OTLP protobuf and Prometheus."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from tests.fakes.upstream import Script, sse
from tests.receivers.otlp import OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan
from tests.receivers.prometheus import promtool_check_metrics

CHUNK = (
    '{"id":"c1","object":"chat.completion.chunk","model":"sim-model","choices":[{"index":0,'
    '"delta":{"content":"%s"},"finish_reason":null}]}'
)
USAGE = '{"id":"c1","object":"chat.completion.chunk","model":"sim-model","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}'
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def policy(primary: str, candidate: str, *, baseline: str | None = None) -> str:
    legs = "[{backend: cand, role: candidate}" + (
        ", {backend: base, role: baseline}]" if baseline else "]"
    )
    extra = f"  base: {{url: '{baseline}', kind: sim}}\n" if baseline else ""
    return (
        "version: 1\n"
        f"backends:\n  cand: {{url: '{candidate}', kind: sim, metrics_url: '{candidate}/metrics'}}\n{extra}"
        f"default:\n  ratio: 1\n  legs: {legs}\n"
    )


def sim_policy(primary: str, candidate: str) -> str:
    """A simulated primary with every request mirrored to a simulated candidate."""
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\ndefault:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
    )


async def stream_chat(
    session: aiohttp.ClientSession, url: str, prompt: str, *, max_tokens: int
) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()


@pytest.fixture(params=["http", "grpc"])
def receiver(request: pytest.FixtureRequest) -> Iterator[OtlpHttpReceiver | OtlpGrpcReceiver]:
    """Set up before (so torn down after) the gateway, which flushes into it at shutdown."""
    cls = OtlpHttpReceiver if request.param == "http" else OtlpGrpcReceiver
    with cls() as rx:
        yield rx


async def test_spans_reach_an_otlp_receiver_with_the_trace_shape_and_genai_attributes(
    receiver, fake_upstream, sims, gateway, write_policy, tmp_path
):
    telemetry = build_telemetry(
        TelemetrySettings.from_env(receiver.env(OTEL_BSP_SCHEDULE_DELAY="50"))
    )
    primary, primary_url = await fake_upstream(
        Script(chunks=sse(CHUNK % "a", CHUNK % "b", CHUNK % "c", USAGE, "[DONE]"))
    )
    candidate = await sims(mode="speculative")
    gw = await gateway(
        primary_url,
        telemetry=telemetry,
        policy_path=write_policy(policy(primary_url, candidate.base_url)),
        store_path=str(tmp_path / "records.sqlite"),
    )
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gw.url}/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}
        ) as resp,
    ):
        assert resp.status == 200
        await resp.read()

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = [s.name for s in spans if s.trace_id == CLIENT_TRACE]
        return "compare" in names and sum(n.startswith("chat ") for n in names) == 2

    spans = [
        s
        for s in await receiver.collected.wait_for_spans(complete, timeout_s=15)
        if s.trace_id == CLIENT_TRACE
    ]
    by_kind: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_kind.setdefault(span.kind, []).append(span)
    (server,) = by_kind["SERVER"]
    assert server.parent_span_id == "00f067aa0ba902b7"  # continues the client's trace
    assert server.attributes["http.route"] == "/v1/chat/completions"
    legs = {s.attributes["specshadow.leg.role"]: s for s in by_kind["CLIENT"]}
    assert set(legs) == {"primary", "candidate"}
    for role, leg in legs.items():
        assert leg.parent_span_id == server.span_id
        assert leg.name == "chat sim-model"
        assert leg.attributes["gen_ai.operation.name"] == "chat"
        assert leg.attributes["gen_ai.request.model"] == "sim-model"
        assert leg.attributes["gen_ai.request.stream"] is True
        assert leg.attributes["gen_ai.response.time_to_first_chunk"] > 0
        assert "server.address" in leg.attributes
        assert leg.end_unix_ns >= leg.start_unix_ns, role
    assert legs["primary"].attributes["gen_ai.usage.output_tokens"] == 3
    assert legs["candidate"].attributes["specshadow.timing.tokens_per_event"] >= 1
    # the primary's CLIENT span is what the upstream saw as its parent
    sent = primary.received[0].headers["traceparent"]
    assert sent.split("-")[1] == CLIENT_TRACE
    assert sent.split("-")[2] == legs["primary"].span_id
    compare = next(s for s in spans if s.name == "compare")
    assert compare.parent_span_id == server.span_id
    evaluations = [e for e in compare.events if e.name == "gen_ai.evaluation.result"]
    assert any(e.attributes["gen_ai.evaluation.name"] == "exact_match" for e in evaluations)
    # no prompt or output text on spans unless the policy allows capture
    assert not any(v == "hi" for s in spans for v in s.attributes.values())


async def test_metrics_endpoint_passes_promtool_and_carries_roles(sims, gateway, write_policy):
    primary = await sims()
    candidate = await sims(mode="speculative")
    gw = await gateway(
        None,
        policy_path=write_policy(sim_policy(primary.base_url, candidate.base_url)),
    )
    async with aiohttp.ClientSession() as session:
        for i in range(4):
            await stream_chat(session, gw.url, f"q{i}", max_tokens=8)
        await gw.sink.wait_for(
            lambda e: len(gw.sink.exchanges) >= 4 and all(x.shadows for x in gw.sink.exchanges)
        )
        # The evidence worker records the legs' instruments after the exchanges reach the sink:
        # scrape until every series asserted below is there (a slow machine takes a while).
        expected = (
            "gen_ai_client_operation_time_to_first_chunk_seconds_bucket{",
            'specshadow_leg_role="primary"',
            'specshadow_leg_role="candidate"',
            "specshadow_shadow_requests_total",
            "specshadow_policy_generation",
        )
        text, exposition = "", b""
        for _ in range(200):
            async with session.get(f"{gw.url}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                exposition = await resp.read()
            text = exposition.decode()
            if all(series in text for series in expected):
                break
            await asyncio.sleep(0.05)
    ok, output = promtool_check_metrics(exposition)
    assert ok, output
    assert "gen_ai_client_operation_time_to_first_chunk_seconds_bucket{" in text
    assert 'specshadow_leg_role="primary"' in text and 'specshadow_leg_role="candidate"' in text
    assert "specshadow_shadow_requests_total" in text
    assert "specshadow_policy_generation" in text
    assert "request_id" not in text and "q0" not in text
    json.dumps(text)  # exposition is plain text


@pytest.mark.prometheus
async def test_a_real_prometheus_scrapes_the_gateway_and_answers_promql_by_role(
    sims, gateway, write_policy, prometheus_server
):
    primary = await sims(step_s=0.002)
    candidate = await sims(mode="speculative", step_s=0.002)
    gw = await gateway(
        None,
        policy_path=write_policy(sim_policy(primary.base_url, candidate.base_url)),
    )
    server = prometheus_server([gw.url.removeprefix("http://")], interval_s=0.5)
    query = (
        "histogram_quantile(0.5, sum by (le, specshadow_leg_role) "
        "(rate(gen_ai_client_operation_time_to_first_chunk_seconds_bucket[1m])))"
    )
    roles: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for i in range(200):
            await stream_chat(session, gw.url, f"p{i}", max_tokens=6)
            if i % 10 == 9:
                result = await server.query(query)
                roles = {
                    r["metric"].get("specshadow_leg_role"): float(r["value"][1]) for r in result
                }
                if {"primary", "candidate"} <= set(roles) and all(v == v for v in roles.values()):
                    break
            await asyncio.sleep(0.05)
    assert {"primary", "candidate"} <= set(roles), roles
    assert all(0 < v < 5 for v in roles.values()), roles


async def test_per_chunk_span_events_are_bounded_by_the_policy(sims, gateway, write_policy):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    telemetry = build_telemetry(TelemetrySettings(), span_exporter=spans)
    primary = await sims()
    text = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        "primary: prim\ntelemetry: {chunk_events: 3}\n"
    )
    gw = await gateway(None, telemetry=telemetry, policy_path=write_policy(text))
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gw.url}/v1/chat/completions",
            json={
                "model": "sim-model",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 20,
                "stream": True,
            },
        ) as resp,
    ):
        await resp.read()
    await gw.sink.wait_for()
    (leg,) = [s for s in spans.get_finished_spans() if s.name == "chat sim-model"]
    assert len(leg.events) == 3  # 20 output chunks, 3 allowed


def _strings(value: object) -> Iterator[str]:
    """Every string value in a JSON document."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


async def test_with_no_trace_exporter_the_clients_traceparent_reaches_every_leg_unchanged(
    fake_upstream, gateway, write_policy
):
    primary, primary_url = await fake_upstream(Script(chunks=sse(CHUNK % "a", USAGE, "[DONE]")))
    shadow, shadow_url = await fake_upstream(Script(chunks=sse(CHUNK % "a", USAGE, "[DONE]")))
    text = (
        "version: 1\n"
        f"backends:\n  cand: {{url: '{shadow_url}', kind: openai}}\n"
        "default:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
    )
    # Default telemetry: /metrics only; no span is built, so every leg carries the client's own.
    gw = await gateway(primary_url, policy_path=write_policy(text))
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "sim-model", "messages": [], "stream": True},
            headers={"traceparent": TRACEPARENT},
        ) as resp,
    ):
        await resp.read()
    assert primary.received[0].headers["traceparent"] == TRACEPARENT
    await gw.sink.wait_for(lambda e: bool(e.shadows))
    assert shadow.received[0].headers["traceparent"] == TRACEPARENT
