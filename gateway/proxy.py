"""The request path of one completion: receive → decide → mirror → relay the primary → hand off.

:func:`serve_completion` reads the body once, checks only that it is a JSON object (the upstream
validates the rest), asks the policy what to do, starts the shadow legs it admits (before the
primary's request, or after its response with ``mirror.timing: after_primary``), relays the
primary's answer to the client byte for byte while the recorder times every chunk, and — once
every leg has ended — hands one :class:`~core.exchange.Exchange` to the gateway's sinks. Nothing
after the primary's last byte delays the client: the exchange is assembled in a tracked task.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span

from core import jsonx
from core.exchange import OPERATION_NAMES, ExchangeDraft, LegResult, Route
from core.ids import new_id
from core.timings import StreamOutcome
from core.wire import REQUEST_ID_HEADER
from gateway.errors import (
    BodyTooLargeError,
    ClientRequestError,
    GatewayError,
    UpstreamError,
    error_response,
)
from gateway.forward import relay
from gateway.headers import upstream_request_headers
from gateway.legs import LegRun
from gateway.shadow import ShadowBatch, ShadowRequest
from gateway.state import Gateway
from policies.compiled import CompiledPolicy, RequestFacts


def request_id_of(request: web.Request) -> str:
    """The client's ``x-request-id`` when it sent one, else a new one."""
    return request.headers.get(REQUEST_ID_HEADER) or new_id()


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLargeError(
            f"request body is {request.content_length} bytes; the limit is {limit} bytes"
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLargeError(f"request body exceeds the limit of {limit} bytes") from exc


def parse_payload(body: bytes) -> dict[str, Any]:
    """The request as a dict; only JSON-object-ness is checked — the upstream validates the rest."""
    try:
        payload = jsonx.loads(body)
    except jsonx.JSONDecodeError as exc:
        raise ClientRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ClientRequestError(
            f"request body must be a JSON object, got {type(payload).__name__}"
        )
    return payload


def retry_count(request: web.Request) -> int:
    """The official SDKs' ``x-stainless-retry-count`` (0 when absent or unreadable)."""
    value = request.headers.get("x-stainless-retry-count", "0")
    # str.isdigit() is true for "²" and other Unicode digits that int() rejects, and int() refuses
    # more than 4300 digits: either would be a 500. A count that long just means "retried".
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value) if len(value) <= 18 else 2**63 - 1


async def serve_completion(gw: Gateway, request: web.Request, route: Route) -> web.StreamResponse:
    """Serve one ``POST /v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``."""
    tel = gw.telemetry
    span = tel.start_request_span(route=request.path, method="POST", carrier=request.headers)
    request_id = request_id_of(request)
    try:
        body = await read_body(request, gw.settings.max_body_bytes)
        payload = parse_payload(body)
    except GatewayError as exc:
        tel.end_request_span(span, status_code=exc.status, error_type=type(exc).__name__)
        raise
    draft = ExchangeDraft.from_payload(payload, request.headers, route=route, request_id=request_id)
    draft.traceparent = tel.traceparent(span)
    policy = gw.policy.current
    decision = policy.decide(
        RequestFacts(
            route=route,
            model=draft.requested_model,
            stream=draft.stream,
            headers=request.headers,
            prompt_bytes=len(body),
            category=draft.category,
            request_id=request_id,
            retry_count=retry_count(request),
            body_bytes=len(body),
        )
    )
    draft.decided(
        policy.generation,
        rule=decision.rule,
        sampled=decision.sampled,
        capture=decision.capture,
        skip_reason=decision.skip_reason,
        sweep_step=decision.sweep_step,
    )
    shadows: ShadowBatch | None = None
    operation = OPERATION_NAMES[route]

    def mirror() -> None:
        nonlocal shadows
        shadow_request = ShadowRequest(
            path_qs=request.path_qs,
            payload=payload,
            client_headers=request.headers,
            request_id=request_id,
            parent_span=span,
            stream=draft.stream,
            operation=operation,
            route=route,
        )
        shadows, drop_reason = gw.shadows.launch(policy, decision.legs, shadow_request)
        draft.drop_reason = draft.drop_reason or drop_reason
        draft.dropped = tuple(shadows.dropped)

    if decision.legs and policy.mirror.timing == "with_primary":
        mirror()
    capture_text = decision.capture.text == "full"
    leg = LegRun(
        tel,
        span,
        role="primary",
        backend=gw.primary.target.name,
        server_address=gw.primary.target.server_address,
        operation=operation,
        model=draft.requested_model,
        stream=draft.stream,
        capture_text=capture_text,
        chunk_events=policy.chunk_events,
        speculative=policy.primary.speculative if policy.primary is not None else None,
    )
    headers = upstream_request_headers(
        request.headers, request_id=request_id, extra=leg.trace_headers().items()
    )
    gw.in_flight += 1
    primary_load = gw.loads[leg.backend]
    replicas = policy.primary.replicas if policy.primary is not None else 1
    leg.dispatch(gw.in_flight, primary_load.dispatch(replicas))
    try:
        async with gw.primary.open("POST", request.path_qs, headers=headers, data=body) as up:
            tee = leg.attach(up)
            downstream, outcome, error_type = await relay(
                request, up, request_id=request_id, tee=tee
            )
    except UpstreamError as exc:
        outcome = "upstream_timeout" if exc.status == 504 else "upstream_error"
        done = end_primary(gw, leg, span, draft, outcome, type(exc).__name__, exc.status)
        hand_off(gw, draft, done, shadows, policy)
        return error_response(exc, headers={REQUEST_ID_HEADER: request_id})
    except asyncio.CancelledError:
        # Cancelled because the client left. If it had the terminal event it had the whole
        # answer (the official SDKs close the moment they read data: [DONE]): that leg is complete.
        if leg.tee is not None and leg.tee.recorder.done:
            hand_off(
                gw, draft, end_primary(gw, leg, span, draft, "completed", None), shadows, policy
            )
            raise
        if shadows is not None and policy.mirror.on_client_disconnect == "cancel":
            shadows.cancel("cancelled")
        done = end_primary(gw, leg, span, draft, "client_disconnected", "CancelledError")
        hand_off(gw, draft, done, shadows, policy)
        raise
    finally:
        gw.in_flight -= 1
        primary_load.done()
    if decision.legs and policy.mirror.timing == "after_primary" and outcome == "completed":
        mirror()
    disconnected = outcome == "client_disconnected"
    if disconnected and shadows is not None and policy.mirror.on_client_disconnect == "cancel":
        shadows.cancel("cancelled")
    hand_off(gw, draft, end_primary(gw, leg, span, draft, outcome, error_type), shadows, policy)
    return downstream


def end_primary(
    gw: Gateway,
    leg: LegRun,
    request_span: Span,
    draft: ExchangeDraft,
    outcome: StreamOutcome,
    error_type: str | None,
    response_status: int | None = None,
) -> LegResult:
    """End the primary leg and, with it, the request's SERVER span (the client has its answer).

    ``response_status`` is what the client got when the gateway answered itself (502/504).
    Shadow leg spans may end later in the same trace.
    """
    result = leg.finish(outcome, error_type)
    tel = gw.telemetry
    if request_span.is_recording():
        capture = draft.capture is not None and draft.capture.text == "full"
        tel.annotate_request_span(request_span, draft.build(result, ()), capture_text=capture)
    tel.end_request_span(
        request_span,
        status_code=response_status or result.status,
        error_type=None if outcome == "completed" else (error_type or outcome),
        end_unix_ns=result.started_unix_ns + (result.end_ns - result.t0_ns),
    )
    return result


def hand_off(
    gw: Gateway,
    draft: ExchangeDraft,
    primary: LegResult,
    shadows: ShadowBatch | None,
    policy: CompiledPolicy,
) -> None:
    """Submit the exchange now, or once its shadow legs end (a tracked task) — never blocking."""
    if shadows is None or not shadows.tasks:
        gw.submit(draft.build(primary, ()))
        return

    async def assemble() -> None:
        elapsed_s = (time.time_ns() - draft.started_unix_ns) / 1e9
        results = await shadows.results(policy.timeouts.total_s - elapsed_s)
        gw.submit(draft.build(primary, results))

    _task = gw.tasks.spawn(assemble(), name=f"exchange:{draft.request_id}")
