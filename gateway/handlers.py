"""Request handlers: thin I/O shells around receive → decide → forward → hand off.

``completions`` serves ``POST /v1/chat/completions`` and ``POST /v1/completions``: it reads the
body once, validates only that it is a JSON object, relays the primary's answer byte for byte
(timing every chunk) and, when every leg has ended, hands one :class:`~gateway.exchange.Exchange`
to the sink. ``passthrough`` relays any other ``/v1/*`` request untouched and untimed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span

from gateway import jsonx
from gateway.errors import (
    BodyTooLargeError,
    ClientRequestError,
    GatewayError,
    UpstreamError,
    error_response,
)
from gateway.exchange import (
    OPERATION_NAMES,
    ROUTE_PATHS,
    Exchange,
    LegResult,
    ModelName,
    RequestId,
    Route,
)
from gateway.forward import RecorderTee, recorder_for, relay
from gateway.headers import REQUEST_ID, upstream_request_headers
from gateway.ids import new_id
from gateway.shadow import ShadowBatch
from gateway.state import GATEWAY, Gateway
from gateway.timings import StreamOutcome
from policies.compiled import CaptureSpec, CompiledPolicy, Decision, RequestFacts


def request_id_of(request: web.Request) -> str:
    """The client's ``x-request-id`` when it sent one, else a new one."""
    return request.headers.get(REQUEST_ID) or new_id()


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


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    tel = gw.telemetry
    route: Route = ROUTE_PATHS[request.path]
    span = tel.start_request_span(route=request.path, method="POST", carrier=request.headers)
    request_id = request_id_of(request)
    try:
        body = await read_body(request, gw.settings.max_body_bytes)
        payload = parse_payload(body)
    except GatewayError as exc:
        tel.end_request_span(span, status_code=exc.status, error_type=type(exc).__name__)
        raise
    draft = ExchangeDraft.from_request(request, payload, route=route, request_id=request_id)
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
            retry_count=_retry_count(request),
            body_bytes=len(body),
        )
    )
    draft.decided(policy.generation, decision)
    shadows: ShadowBatch | None = None

    def mirror() -> None:
        nonlocal shadows
        shadows, drop_reason = gw.shadows.launch(
            policy,
            decision.legs,
            path_qs=request.path_qs,
            payload=payload,
            client_headers=request.headers,
            request_id=request_id,
            parent_span=span,
            stream=draft.stream,
        )
        draft.drop_reason = draft.drop_reason or drop_reason

    if decision.legs and policy.mirror.timing == "with_primary":
        mirror()
    leg = PrimaryLeg(gw, span, draft, chunk_events=policy.chunk_events)
    headers = upstream_request_headers(
        request.headers, request_id=request_id, extra=leg.trace_headers()
    )
    gw.in_flight += 1
    leg.start(gw.in_flight)
    try:
        async with gw.primary.open("POST", request.path_qs, headers=headers, data=body) as up:
            leg.status = up.status
            leg.tee = recorder_for(up, leg.t0_ns)
            downstream, outcome, error_type = await relay(
                request, up, request_id=request_id, tee=leg.tee
            )
    except UpstreamError as exc:
        outcome = "upstream_timeout" if exc.status == 504 else "upstream_error"
        done = leg.finish(outcome, type(exc).__name__, None, response_status=exc.status)
        _finish(gw, draft, done, shadows, policy)
        return error_response(exc, headers={REQUEST_ID: request_id})
    except asyncio.CancelledError:
        if shadows is not None and policy.mirror.on_client_disconnect == "cancel":
            shadows.cancel("cancelled")
        done = leg.finish("client_disconnected", "CancelledError", leg.status)
        _finish(gw, draft, done, shadows, policy)
        raise
    finally:
        gw.in_flight -= 1
    if decision.legs and policy.mirror.timing == "after_primary" and outcome == "completed":
        mirror()
    disconnected = outcome == "client_disconnected"
    if disconnected and shadows is not None and policy.mirror.on_client_disconnect == "cancel":
        shadows.cancel("cancelled")
    _finish(gw, draft, leg.finish(outcome, error_type, leg.status), shadows, policy)
    return downstream


def _retry_count(request: web.Request) -> int:
    value = request.headers.get("x-stainless-retry-count", "0")
    # str.isdigit() is true for "²" and other Unicode digits that int() rejects, and int() refuses
    # more than 4300 digits: either would be a 500. A count that long just means "retried".
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value) if len(value) <= 18 else 2**63 - 1


def _finish(
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


class PrimaryLeg:
    """The primary leg in flight: its spans, its recorder tee, and its end as a LegResult.

    The request span (SERVER) ends with the primary, when the client's response ends; shadow leg
    spans may end later in the same trace.
    """

    __slots__ = (
        "chunk_events",
        "draft",
        "gw",
        "inflight",
        "request_span",
        "span",
        "started_unix_ns",
        "status",
        "t0_ns",
        "tee",
    )

    def __init__(
        self, gw: Gateway, request_span: Span, draft: ExchangeDraft, *, chunk_events: int = 0
    ) -> None:
        self.gw = gw
        self.chunk_events = chunk_events
        self.draft = draft
        self.request_span = request_span
        self.started_unix_ns = time.time_ns()
        self.t0_ns = time.perf_counter_ns()
        self.inflight = 0
        self.status: int | None = None
        self.tee: RecorderTee | None = None
        target = gw.primary.target
        self.span = gw.telemetry.start_leg_span(
            request_span,
            operation=OPERATION_NAMES[draft.route],
            model=draft.requested_model,
            role="primary",
            backend=target.name,
            server_address=target.server_address,
            stream=draft.stream,
        )

    def trace_headers(self) -> list[tuple[str, str]]:
        return list(self.gw.telemetry.traceparent_headers(self.span).items())

    def start(self, inflight: int) -> None:
        self.inflight = inflight
        self.started_unix_ns, self.t0_ns = time.time_ns(), time.perf_counter_ns()

    def finish(
        self,
        outcome: StreamOutcome,
        error_type: str | None,
        status: int | None,
        *,
        response_status: int | None = None,
    ) -> LegResult:
        """End the leg: its LegResult, its CLIENT span, and the request's SERVER span.

        ``status`` is the upstream's; ``response_status`` what the client got when the gateway
        answered itself (502/504).
        """
        tee = self.tee
        recording = tee.recorder.finish(outcome=outcome, status=status) if tee is not None else None
        end_ns = time.perf_counter_ns()
        target = self.gw.primary.target
        leg = LegResult(
            role="primary",
            backend=target.name,
            server_address=target.server_address,
            upstream_model=self.draft.requested_model,
            status=status,
            outcome=outcome,
            error_type=error_type,
            recording=recording,
            started_unix_ns=self.started_unix_ns,
            t0_ns=self.t0_ns,
            end_ns=end_ns,
            inflight_at_dispatch=self.inflight,
        )
        tel = self.gw.telemetry
        end_unix_ns = self.started_unix_ns + (end_ns - self.t0_ns)
        capture = self.draft.capture is not None and self.draft.capture.text == "full"
        tel.finish_leg_span(
            self.span,
            leg,
            end_unix_ns=end_unix_ns,
            capture_text=capture,
            max_chunk_events=self.chunk_events,
        )
        if self.request_span.is_recording():
            tel.annotate_request_span(self.request_span, self.draft.build(leg, ()))
        tel.end_request_span(
            self.request_span,
            status_code=response_status or status,
            error_type=None if outcome == "completed" else (error_type or outcome),
            end_unix_ns=end_unix_ns,
        )
        return leg


class ExchangeDraft:
    """What is known about an exchange before its legs end."""

    __slots__ = (
        "capture",
        "category",
        "drop_reason",
        "exchange_id",
        "policy_generation",
        "policy_rule",
        "request_body",
        "request_id",
        "request_json",
        "requested_model",
        "route",
        "sampled",
        "seed",
        "started_unix_ns",
        "stream",
        "temperature",
        "traceparent",
    )

    def __init__(
        self,
        *,
        request_id: RequestId,
        route: Route,
        requested_model: ModelName | None,
        stream: bool,
        temperature: float | None,
        seed: int | None,
        category: str | None,
    ) -> None:
        self.exchange_id = new_id()
        self.request_id = request_id
        self.route = route
        self.requested_model = requested_model
        self.stream = stream
        self.started_unix_ns = time.time_ns()
        self.temperature = temperature
        self.seed = seed
        self.category = category
        self.policy_generation: int | None = None
        self.policy_rule: str | None = None
        self.sampled = False
        self.drop_reason: str | None = None
        self.request_body: bytes | None = None
        self.request_json: dict[str, Any] | None = None
        self.capture: CaptureSpec | None = None
        self.traceparent: str | None = None

    @classmethod
    def from_request(
        cls, request: web.Request, payload: dict[str, Any], *, route: Route, request_id: str
    ) -> ExchangeDraft:
        model = payload.get("model")
        seed = payload.get("seed")
        draft = cls(
            request_id=RequestId(request_id),
            route=route,
            requested_model=ModelName(model) if isinstance(model, str) else None,
            stream=payload.get("stream") is True,
            temperature=_number(payload.get("temperature")),
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
            category=request.headers.get("x-specshadow-category"),
        )
        draft.request_json = payload
        return draft

    def decided(self, generation: int, decision: Decision) -> None:
        self.policy_generation = generation
        self.policy_rule = decision.rule
        self.sampled = decision.sampled
        self.capture = decision.capture
        if decision.sampled and decision.skip_reason is not None:
            self.drop_reason = decision.skip_reason

    def build(self, primary: LegResult, shadows: tuple[LegResult, ...]) -> Exchange:
        return Exchange(
            exchange_id=self.exchange_id,
            request_id=self.request_id,
            route=self.route,
            requested_model=self.requested_model,
            stream=self.stream,
            started_unix_ns=self.started_unix_ns,
            temperature=self.temperature,
            seed=self.seed,
            category=self.category,
            policy_generation=self.policy_generation,
            policy_rule=self.policy_rule,
            sampled=self.sampled,
            drop_reason=self.drop_reason,
            primary=primary,
            shadows=shadows,
            request_body=self.request_body,
            request_json=self.request_json,
            capture=self.capture,
            traceparent=self.traceparent,
        )


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other ``/v1/*`` request: relayed to the primary untouched and untimed."""
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    headers = upstream_request_headers(request.headers, request_id=request_id)
    data = request.content.iter_any() if request.body_exists else None
    try:
        async with gw.primary.open(
            request.method,
            request.path_qs,
            headers=headers,
            data=data,
            retry=False,
        ) as up:
            downstream, _outcome, _error = await relay(request, up, request_id=request_id, tee=None)
    except UpstreamError as exc:
        return error_response(exc, headers={REQUEST_ID: request_id})
    return downstream


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"}, dumps=lambda o: jsonx.dumps(o).decode())


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    ok, detail = await gw.ready.check()
    return web.json_response(
        {"status": "ready" if ok else "not_ready", "primary": detail},
        status=200 if ok else 503,
        dumps=lambda o: jsonx.dumps(o).decode(),
    )


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition of the gateway's OTel metrics (rendered off the event loop)."""
    body, content_type = await asyncio.to_thread(request.app[GATEWAY].telemetry.render_prometheus)
    return web.Response(body=body, headers={"Content-Type": content_type})
