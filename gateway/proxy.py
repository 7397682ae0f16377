"""The request path of one completion: receive → decide → serve → mirror → hand off.

:func:`serve_completion` reads the body once, checks only that it is a JSON object (the upstream
validates the rest), asks the policy what to do and the rollout controller who answers. The
primary answers (:func:`serve_primary`) unless a rule's canary or live stage picks the candidate
(:func:`serve_candidate`, which fails over to the primary before its first byte). The shadow
legs the policy admits start with the answering leg (or after its response with
``mirror.timing: after_primary``); the answer reaches the client byte for byte while the
recorder times every chunk, and — once every leg has ended — one
:class:`~core.exchange.Exchange` goes to the gateway's sinks. Nothing after the last byte delays
the client: the exchange is assembled in a tracked task.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span

from core import jsonx
from core.classify import classify_request
from core.exchange import OPERATION_NAMES, ExchangeDraft, LegResult, Role, Route
from core.ids import new_id
from core.timings import StreamOutcome
from core.wire import REQUEST_ID_HEADER, SERVED_BY_HEADER
from gateway.errors import (
    BodyTooLargeError,
    ClientRequestError,
    GatewayError,
    UpstreamError,
    error_response,
)
from gateway.forward import relay
from gateway.headers import candidate_request_headers, upstream_request_headers
from gateway.legs import LegRun
from gateway.shadow import ShadowBatch, ShadowRequest, backend_verdict, failure_text
from gateway.state import Gateway
from policies.compiled import BackendSpec, CompiledPolicy, LegPlan, RequestFacts
from rollout.controller import ServePlan


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


@dataclass(slots=True)
class Call:
    """One completion request in flight: what every step of its serving path needs."""

    gw: Gateway
    request: web.Request
    route: Route
    body: bytes
    payload: dict[str, Any]
    draft: ExchangeDraft
    span: Span
    request_id: str
    policy: CompiledPolicy
    capture_text: bool
    shadows: ShadowBatch | None = None
    mirrored_ns: int | None = None  # when :meth:`mirror` started shadow legs (``perf_counter_ns``)

    @property
    def operation(self) -> str:
        return OPERATION_NAMES[self.route]

    def mirror(self, legs: tuple[LegPlan, ...]) -> None:
        """Start ``legs`` as shadow legs of this exchange (admission may drop some)."""
        if not legs:
            return
        self.mirrored_ns = time.perf_counter_ns()
        shadow_request = ShadowRequest(
            path_qs=self.request.path_qs,
            payload=self.payload,
            client_headers=self.request.headers,
            request_id=self.request_id,
            parent_span=self.span,
            stream=self.draft.stream,
            operation=self.operation,
            route=self.route,
            mirrored_ns=self.mirrored_ns,
        )
        self.shadows, drop_reason = self.gw.shadows.launch(self.policy, legs, shadow_request)
        self.draft.drop_reason = self.draft.drop_reason or drop_reason
        self.draft.dropped = tuple(self.shadows.dropped)

    def leg(self, role: Role, backend: BackendSpec | None, model: str | None) -> LegRun:
        gw = self.gw
        return LegRun(
            gw.telemetry,
            self.span,
            role=role,
            backend=backend.name if backend is not None else gw.primary.target.name,
            server_address=backend.server_address
            if backend is not None
            else gw.primary.target.server_address,
            operation=self.operation,
            model=model,
            stream=self.draft.stream,
            capture_text=self.capture_text,
            chunk_events=self.policy.chunk_events,
            speculative=backend.speculative if backend is not None else None,
        )


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
    wf = policy.workflows
    draft.joined(request.headers, session_header=wf.session_header, type_header=wf.type_header)
    category = draft.category
    if category is None and policy.uses_categories:  # only rules that route by category pay
        category = classify_request(payload)
    facts = RequestFacts(
        route=route,
        model=draft.requested_model,
        stream=draft.stream,
        headers=request.headers,
        prompt_bytes=len(body),
        category=category,
        request_id=request_id,
        retry_count=retry_count(request),
        body_bytes=len(body),
    )
    decision = policy.decide(facts)
    draft.decided(
        policy.generation,
        rule=decision.rule,
        sampled=decision.sampled,
        capture=decision.capture,
        skip_reason=decision.skip_reason,
        sweep_step=decision.sweep_step,
        candidates=decision.candidates,
    )
    call = Call(
        gw, request, route, body, payload, draft, span, request_id, policy,
        capture_text=decision.capture.text == "full",
    )  # fmt: skip
    rollout = gw.rollout
    plan = rollout.plan(policy, decision, facts) if rollout is not None else None
    if rollout is not None:
        draft.rollout_episode = rollout.episode_of(decision.rule)
    if plan is not None:
        return await serve_candidate(call, plan)
    served_by: tuple[tuple[str, str], ...] = ()
    if rollout is not None and (stage := rollout.stage_of(decision.rule)) is not None:
        draft.rollout_stage = stage
        served_by = ((SERVED_BY_HEADER, "primary"),)
    return await serve_primary(call, decision.legs, served_by)


async def serve_primary(
    call: Call,
    legs: tuple[LegPlan, ...],
    extra_headers: tuple[tuple[str, str], ...] = (),
    failed: tuple[LegResult, ...] = (),
) -> web.StreamResponse:
    """The primary answers; ``legs`` are mirrored; ``failed``: a candidate attempt that failed
    over to here (it joins the exchange as a candidate leg, so the guards count it)."""
    gw, request, draft, span, policy = call.gw, call.request, call.draft, call.span, call.policy
    request_id = call.request_id
    at_ns: int | None = None  # the primary meets its load now, unless mirrored with it:
    if policy.mirror.timing == "with_primary":
        call.mirror(legs)
        # every leg of the exchange meets its backend's load at the one instant it mirrored: the
        # primary's set-up after it (milliseconds on a loaded machine) would read as a load
        # difference between the legs
        at_ns = call.mirrored_ns
    leg = call.leg("primary", None, draft.requested_model)
    headers = upstream_request_headers(
        request.headers, request_id=request_id, extra=leg.trace_headers().items()
    )
    gw.in_flight += 1
    primary_load = gw.loads[leg.backend]
    replicas = policy.primary.replicas if policy.primary is not None else 1
    leg.dispatch(primary_load.dispatch(replicas, at_ns), primary_load)
    try:
        async with gw.primary.open("POST", request.path_qs, headers=headers, data=call.body) as up:
            tee = leg.attach(up)
            downstream, outcome, error_type = await relay(
                request, up, request_id=request_id, tee=tee, extra_headers=extra_headers
            )
    except UpstreamError as exc:
        outcome = "upstream_timeout" if exc.status == 504 else "upstream_error"
        done = end_primary(gw, leg, span, draft, outcome, type(exc).__name__, exc.status)
        hand_off(gw, draft, done, call.shadows, policy, failed)
        return error_response(exc, headers={REQUEST_ID_HEADER: request_id, **dict(extra_headers)})
    except asyncio.CancelledError:
        _client_left(call, leg, failed)
        raise
    finally:
        gw.in_flight -= 1
        primary_load.done()
    if policy.mirror.timing == "after_primary" and outcome == "completed":
        call.mirror(legs)
    _finish(call, leg, outcome, error_type, failed)
    return downstream


async def serve_candidate(call: Call, plan: ServePlan) -> web.StreamResponse:
    """The candidate answers (canary or live). It may fail over to the primary until its first
    byte: refused, timed out, breaker open, or a 5xx/429 status — the client then gets the
    primary's answer and no error, and the attempt counts against the guards. After the first
    byte nothing can be hidden: the client sees what the candidate did."""
    gw, request, draft, policy = call.gw, call.request, call.draft, call.policy
    draft.served_by, draft.rollout_stage = "candidate", plan.stage
    backend = plan.candidate.backend
    model = plan.candidate.model
    try:
        data = call.body if model is None else jsonx.dumps({**call.payload, "model": model})
    except TypeError:  # nested deeper than orjson re-encodes: the candidate never saw it
        return await _fail_over(call, plan, None, "unencodable_body")
    leg = call.leg("candidate", backend, model or draft.requested_model)
    breaker = gw.shadows.breaker(backend, policy.budgets.breaker)
    if not breaker.allow():
        return await _fail_over(
            call, plan, leg.finish("upstream_error", "BreakerOpen"), "breaker_open"
        )
    headers = candidate_request_headers(
        request.headers, request_id=call.request_id, auth=backend.auth_header(),
        extra=leg.trace_headers().items(),
    )  # fmt: skip
    load = gw.loads[backend.name]
    leg.dispatch(load.dispatch(backend.replicas), load)
    failure: str | None = None
    downstream: web.StreamResponse | None = None
    outcome: StreamOutcome = "upstream_error"
    error_type: str | None = None
    try:
        async with gw.shadows.client(backend).open(
            "POST", request.path_qs, headers=headers, data=data, retry=False
        ) as up:
            tee = leg.attach(up)
            if up.status >= 500 or up.status == 429:
                failure = f"status_{up.status}"
                outcome, error_type = "upstream_status", f"HTTP {up.status}"
            else:
                if policy.mirror.timing == "with_primary":
                    call.mirror(plan.shadows)  # now: a failover must not double the primary
                downstream, outcome, error_type = await relay(
                    request, up, request_id=call.request_id, tee=tee,
                    extra_headers=((SERVED_BY_HEADER, "candidate"),),
                )  # fmt: skip
    except UpstreamError as exc:
        outcome = "upstream_timeout" if exc.status == 504 else "upstream_error"
        failure, error_type = outcome, type(exc).__name__
    except asyncio.CancelledError:
        breaker.observe(None)
        _client_left(call, leg, ())
        raise
    finally:
        load.done()
    verdict = backend_verdict(outcome, leg.status)
    breaker.observe(
        verdict, None if verdict is not False else failure_text(outcome, leg.status, error_type)
    )
    if failure is not None or downstream is None:
        return await _fail_over(call, plan, leg.finish(outcome, error_type), failure or outcome)
    gw.telemetry.rollout_served(plan.rule, backend.name, "candidate")
    if policy.mirror.timing == "after_primary" and outcome == "completed":
        call.mirror(plan.shadows)
    _finish(call, leg, outcome, error_type, ())
    return downstream


async def _fail_over(
    call: Call, plan: ServePlan, failed: LegResult | None, reason: str
) -> web.StreamResponse:
    """The primary answers instead; ``failed`` (the candidate's attempt, if it made one) joins
    the exchange and counts against the guards."""
    draft = call.draft
    draft.served_by, draft.failover = "primary", reason
    rollout = call.gw.rollout
    if rollout is not None:
        rollout.failovers += 1
    call.gw.telemetry.rollout_failover(plan.rule, plan.candidate.backend.name, reason)
    others = tuple(leg for leg in plan.shadows if leg.role != "primary")
    attempts = (failed,) if failed is not None else ()
    return await serve_primary(call, others, ((SERVED_BY_HEADER, "primary"),), attempts)


def _client_left(call: Call, leg: LegRun, failed: tuple[LegResult, ...]) -> None:
    """The client went away mid-answer (the handler is being cancelled). If it had the terminal
    event it had the whole answer (the official SDKs close the moment they read data: [DONE]):
    that leg is complete."""
    gw, policy = call.gw, call.policy
    if leg.tee is not None and leg.tee.recorder.done:
        hand_off(gw, call.draft, end_primary(gw, leg, call.span, call.draft, "completed", None),
                 call.shadows, policy, failed)  # fmt: skip
        return
    if call.shadows is not None and policy.mirror.on_client_disconnect == "cancel":
        call.shadows.cancel("cancelled")
    done = end_primary(gw, leg, call.span, call.draft, "client_disconnected", "CancelledError")
    hand_off(gw, call.draft, done, call.shadows, policy, failed)


def _finish(call: Call, leg: LegRun, outcome: StreamOutcome, error_type: str | None,
            failed: tuple[LegResult, ...]) -> None:  # fmt: skip
    disconnected = outcome == "client_disconnected"
    if (
        disconnected
        and call.shadows is not None
        and call.policy.mirror.on_client_disconnect == "cancel"
    ):
        call.shadows.cancel("cancelled")
    done = end_primary(call.gw, leg, call.span, call.draft, outcome, error_type)
    hand_off(call.gw, call.draft, done, call.shadows, call.policy, failed)


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
    extra: tuple[LegResult, ...] = (),
) -> None:
    """Submit the exchange now, or once its shadow legs end (a tracked task) — never blocking.
    ``primary`` is the leg that answered; ``extra`` legs (a failed-over candidate) join it."""
    if shadows is None or not shadows.tasks:
        gw.submit(draft.build(primary, extra))
        return

    async def assemble() -> None:
        elapsed_s = (time.time_ns() - draft.started_unix_ns) / 1e9
        results = await shadows.results(policy.timeouts.total_s - elapsed_s)
        gw.submit(draft.build(primary, (*extra, *results)))

    _task = gw.tasks.spawn(assemble(), name=f"exchange:{draft.request_id}")
