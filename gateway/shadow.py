"""Shadow mirroring: admission (budgets, rate, breaker), tracked leg tasks, and exchange assembly.

The one promise: a shadow never slows, changes or breaks what the client gets.

- Every shadow backend has its own connection pool (an :class:`UpstreamClient` per backend), never
  the primary's.
- Admission never queues: a leg over the in-flight budget, over the rate, or to a backend whose
  breaker is open is **dropped** and counted by reason — as is every leg of a request no shadow
  can answer (a Responses API ``previous_response_id``: :attr:`ShadowRequest.unanswerable`).
- Legs run as tracked tasks (:class:`~core.tasks.TaskSet`); the body is shaped inside the task,
  so the primary's handler pays nothing for it. Any exception is contained at the task boundary
  and becomes the leg's outcome.
- A shadow stream is read to its end; an exchange deadline (``timeouts.total_s``) bounds the wait,
  after which the remaining legs are cancelled and recorded as ``deadline``.

What the log says: a failing shadow leg is logged with its backend, the backend's URL (no
credentials, no query string) and the error (``UpstreamConnectError: …``, ``HTTP 503``,
``timeout (UpstreamTimeout)``) — the first failure at once, then at most one line per backend per
:data:`FAILURE_LOG_INTERVAL_S` with the count of those not logged (:class:`FailureLog`); every
breaker transition (closed → open, open → half-open, half-open → closed or open) is logged with
the backend, its URL and the last error.

Size: the one promise above in one place — admission (the breaker, the rate limiter, the failure
log) is small and used by the dispatcher alone, which runs the legs and assembles the exchange.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.trace import Span

from core.exchange import LegResult, Route
from core.tasks import TaskSet
from core.timings import StreamOutcome
from core.wire import CATEGORY_HEADER
from gateway.errors import UpstreamError
from gateway.forward import drain
from gateway.legs import LegRun
from gateway.load import LoadBook
from gateway.settings import UpstreamSettings
from gateway.upstream import CLOSING_KINDS, UpstreamClient, UpstreamTarget
from otel.telemetry import Telemetry
from policies.compiled import BackendSpec, BreakerSpec, Budgets, CompiledPolicy, LegPlan
from policies.shape import shadow_headers, shape_shadow_body

log = logging.getLogger(__name__)

# Breaker states, also the value of the ``specshadow.shadow.breaker.state`` gauge.
CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half-open", OPEN: "open"}
FAILURE_LOG_INTERVAL_S = 10.0  # after a backend's first logged failure, one line per this long


def safe_url(url: str) -> str:
    """``url`` fit for a log line: scheme, host, port and path — no user, password, query or
    fragment (a policy's URLs carry no credentials, but a log line must not depend on that)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def failure_text(
    outcome: str, status: int | None, error_type: str | None, detail: str | None = None
) -> str:
    """One leg's failure in a few words: ``HTTP 503``, ``timeout (UpstreamTimeout)``,
    ``UpstreamConnectError: …``."""
    if outcome == "upstream_status":
        return f"HTTP {status}"
    text = error_type or outcome
    if outcome == "upstream_timeout" and "timeout" not in text.lower():
        text = f"timeout ({text})"
    return f"{text}: {detail}" if detail else text


class FailureLog:
    """Failing shadow legs, logged per backend without flooding: a backend's first failure at
    once, then at most one line per ``interval_s``, which counts the failures not logged since."""

    def __init__(
        self,
        interval_s: float = FAILURE_LOG_INTERVAL_S,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.clock = clock
        self._last_ns: dict[str, int] = {}
        self._suppressed: Counter[str] = Counter()

    def failed(self, backend: str, url: str, role: str, error: str) -> bool:
        """Log (or count) one failed leg; True when a line was written."""
        now = self.clock()
        last = self._last_ns.get(backend)
        if last is not None and now - last < self.interval_ns:
            self._suppressed[backend] += 1
            return False
        self._last_ns[backend] = now
        suppressed = self._suppressed.pop(backend, 0)
        more = (
            f" ({suppressed} more failure{'s' if suppressed != 1 else ''} of this backend not "
            f"logged in the last {self.interval_ns / 1e9:g} s)"
            if suppressed
            else ""
        )
        log.warning(
            "shadow leg to backend %s (%s, %s) failed: %s%s",
            backend,
            safe_url(url),
            role,
            error,
            more,
        )
        return True


class CircuitBreaker:
    """Opens after ``failures`` failed legs within ``window_s``; probes once after ``cooldown_s``.

    ``name`` and ``url`` name the backend in the log line of every transition, with the last
    error a leg reported (:meth:`observe`'s ``error``).
    """

    def __init__(
        self,
        spec: BreakerSpec,
        clock: Callable[[], int] = time.perf_counter_ns,
        on_change: Callable[[int], None] | None = None,
        *,
        name: str = "",
        url: str = "",
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.on_change = on_change
        self.name = name or "?"
        self.url = safe_url(url) if url else "no URL"
        self.last_error: str | None = None
        self._state = CLOSED
        self._failures: list[int] = []
        self._opened_ns = 0
        self._probing = False

    @property
    def state(self) -> int:
        return self._state

    @state.setter
    def state(self, value: int) -> None:
        if value != self._state:
            old, self._state = self._state, value
            self._log_transition(old, value)
            if self.on_change is not None:
                self.on_change(value)

    def _log_transition(self, old: int, new: int) -> None:
        where = f"shadow breaker for backend {self.name} ({self.url})"
        last = self.last_error or "none recorded"
        if new == OPEN and old == CLOSED:
            log.warning(
                "%s: closed → open after %d failures within %g s; last error: %s; "
                "no legs for %g s, then one probe",
                where, self.spec.failures, self.spec.window_s, last, self.spec.cooldown_s,
            )  # fmt: skip
        elif new == OPEN:
            log.warning(
                "%s: half-open → open, the probe failed: %s; next probe in %g s",
                where, last, self.spec.cooldown_s,
            )  # fmt: skip
        elif new == HALF_OPEN:
            log.info("%s: open → half-open, the next leg probes; last error: %s", where, last)
        else:
            log.info("%s: %s → closed, the probe succeeded", where, STATE_NAMES[old])

    def allow(self) -> bool:
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self.clock() - self._opened_ns >= self.spec.cooldown_s * 1e9:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def observe(self, ok: bool | None, error: str | None = None) -> None:
        """A leg's verdict on its backend (:func:`backend_verdict`); ``None`` (the leg said
        nothing about the backend: cancelled, deadline, client gone, never sent) only hands back
        a half-open probe, so that the next leg may probe — a probe that never reports would keep
        the breaker half-open, and the backend unused, for good. ``error`` (a failure's
        :func:`failure_text`) is kept for the transition log lines."""
        if ok is None:
            self._probing = False
        else:
            self.record(ok, error)

    def record(self, ok: bool, error: str | None = None) -> None:
        now = self.clock()
        if ok:
            self.state, self._probing, self._failures = CLOSED, False, []
            return
        if error is not None:
            self.last_error = error
        if self.state == HALF_OPEN:
            self._open(now)
            return
        horizon = now - int(self.spec.window_s * 1e9)
        self._failures = [t for t in self._failures if t >= horizon]
        self._failures.append(now)
        if self.state == CLOSED and len(self._failures) >= self.spec.failures:
            self._open(now)

    def _open(self, now: int) -> None:
        self._opened_ns, self._probing, self._failures = now, False, []
        self.state = OPEN


def backend_verdict(outcome: str, status: int | None) -> bool | None:
    """What a leg's outcome says of its backend, for its breaker: answered (completed, or a
    status below 500 — a 4xx or 429 is the backend working as designed) → True; refused, timed
    out, 5xx → False; outcomes that are not the backend's doing → None."""
    if outcome in ("cancelled", "deadline", "client_disconnected"):
        return None
    return outcome == "completed" or (outcome == "upstream_status" and (status or 0) < 500)


class RateLimiter:
    """A token bucket: ``rate`` tokens per second, ``burst`` capacity. Never waits."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self._tokens = 0.0
        self._last_ns = clock()
        self._rate: float | None = None

    def try_take(self, rate: float | None, burst: int) -> bool:
        if rate is None:
            return True
        now = self.clock()
        if rate != self._rate:  # a reload changed the rate: start full
            self._rate, self._tokens = rate, float(burst)
        self._tokens = min(float(burst), self._tokens + (now - self._last_ns) / 1e9 * rate)
        self._last_ns = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class ShadowRequest:
    """What every shadow leg of one exchange is derived from (read-only; shaped per leg)."""

    path_qs: str
    payload: Mapping[str, Any]  # the client's parsed JSON body
    client_headers: Mapping[str, str]  # case-insensitive (aiohttp's CIMultiDictProxy)
    request_id: str
    parent_span: Span  # the exchange's SERVER span
    stream: bool  # the client asked for a stream
    operation: str  # GenAI operation name of the route (``chat``, ``text_completion``)
    route: Route = "chat"
    # When the exchange mirrored its legs (``perf_counter_ns``): each leg's load is stamped with
    # it, not with when its task got to run, so both legs of an exchange measure their rates at
    # one instant (on a starved event loop a leg's task can run hundreds of ms later, and its
    # rate over a young window read up to a quarter off the primary's: not load-matched). None:
    # stamped when dispatched.
    mirrored_ns: int | None = None

    @property
    def unanswerable(self) -> str | None:
        """Why no shadow can answer this request, or None. A Responses API request continuing a
        stored response (``previous_response_id``) has its context only on the backend that
        stored it — the primary; another backend would answer a different question (vLLM: 404)."""
        if self.route == "responses" and self.payload.get("previous_response_id") is not None:
            return "previous_response_id"
        return None


@dataclass
class ShadowBatch:
    """The shadow legs of one exchange, in flight."""

    tasks: list[asyncio.Task[LegResult]] = field(default_factory=list)
    cancel_reason: list[StreamOutcome] = field(default_factory=lambda: ["cancelled"])
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (backend, role, reason)

    def cancel(self, reason: StreamOutcome) -> None:
        self.cancel_reason[0] = reason
        for task in self.tasks:
            task.cancel()

    async def results(self, deadline_s: float) -> tuple[LegResult, ...]:
        """Wait for every leg, up to ``deadline_s``; cancel the rest as ``deadline``."""
        if not self.tasks:
            return ()
        _done, pending = await asyncio.wait(self.tasks, timeout=max(0.0, deadline_s))
        if pending:
            self.cancel("deadline")
            await asyncio.wait(pending)
        return tuple(t.result() for t in self.tasks if not t.cancelled())


class ShadowDispatcher:
    """Owns the shadow pools, the budgets' live state, and the shadow counters."""

    def __init__(
        self,
        tasks: TaskSet,
        upstream_defaults: UpstreamSettings,
        telemetry: Telemetry,
        loads: LoadBook | None = None,
    ) -> None:
        self.tasks = tasks
        self.loads = loads if loads is not None else LoadBook()
        self.telemetry = telemetry
        self.defaults = upstream_defaults
        self.in_flight = 0
        self.rate = RateLimiter()
        self.breakers: dict[str, CircuitBreaker] = {}
        self.failure_log = FailureLog()
        self.clients: dict[tuple[str, str, float, float, int], UpstreamClient] = {}
        # (event, role, backend, reason) → count; events: sampled, sent, completed, failed, dropped
        self.counts: Counter[tuple[str, str, str, str]] = Counter()

    def count(self, event: str, role: str, backend: str, reason: str = "") -> None:
        self.counts[(event, role, backend, reason)] += 1
        # completed/failed are counted from the finished exchange (record_exchange_metrics).
        if event in ("sampled", "sent", "dropped"):
            self.telemetry.count_shadow(event, role=role, backend=backend, reason=reason or None)

    def breaker(self, backend: BackendSpec, spec: BreakerSpec) -> CircuitBreaker:
        breaker = self.breakers.get(backend.name)
        if breaker is None or breaker.spec != spec:
            name = backend.name

            def report(state: int) -> None:
                self.telemetry.set_breaker_state(name, state)

            breaker = self.breakers[name] = CircuitBreaker(
                spec, on_change=report, name=name, url=backend.url
            )
        elif breaker.url != safe_url(backend.url):  # a reload moved the backend
            breaker.url = safe_url(backend.url)
        return breaker

    def client(self, backend: BackendSpec) -> UpstreamClient:
        key = (
            backend.name,
            backend.url,
            backend.connect_s,
            backend.idle_s,
            backend.max_connections,
        )
        client = self.clients.get(key)
        if client is None:
            settings = UpstreamSettings(
                max_connections=backend.max_connections,
                connect_timeout_s=backend.connect_s,
                idle_timeout_s=backend.idle_s,
                keepalive_s=self.defaults.keepalive_s,
                retry_attempts=1,  # a shadow is never retried: it would skew its own timing
            )
            client = self.clients[key] = UpstreamClient(
                UpstreamTarget(backend.name, backend.url),
                settings,
                closes_connections=backend.kind in CLOSING_KINDS,
            )
        return client

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        self.clients.clear()

    def _admit(self, leg: LegPlan, budgets: Budgets) -> str | None:
        """None when ``leg`` may start now, else why it is dropped (in this order: the in-flight
        budget, the backend's breaker — which may take a half-open probe — then the rate)."""
        if self.in_flight >= budgets.max_in_flight:
            return "budget"
        breaker = self.breaker(leg.backend, budgets.breaker)
        if not breaker.allow():
            return "breaker_open"
        if not self.rate.try_take(budgets.max_rps, budgets.rps_burst):
            breaker.observe(None)  # a probe it took goes back: this leg never reaches the backend
            return "rate"
        return None

    def launch(
        self, policy: CompiledPolicy, legs: tuple[LegPlan, ...], request: ShadowRequest
    ) -> tuple[ShadowBatch, str | None]:
        """Admit and start ``legs``; returns the batch and the first drop reason (if any)."""
        batch = ShadowBatch()
        drop_reason: str | None = None
        budgets = policy.budgets
        unanswerable = request.unanswerable
        for leg in legs:
            backend = leg.backend.name
            self.count("sampled", leg.role, backend)
            reason = unanswerable or self._admit(leg, budgets)
            if reason is not None:
                self.count("dropped", leg.role, backend, reason)
                batch.dropped.append((backend, leg.role, reason))
                drop_reason = drop_reason or reason
                continue
            self.in_flight += 1
            coro = self._run_leg(policy, leg, batch, request)
            name = f"shadow:{leg.role}:{request.request_id}"
            batch.tasks.append(self.tasks.spawn(coro, name=name))
        return batch, drop_reason

    async def _run_leg(
        self,
        policy: CompiledPolicy,
        leg: LegPlan,
        batch: ShadowBatch,
        request: ShadowRequest,
    ) -> LegResult:
        backend = leg.backend
        requested = request.payload.get("model")
        run = LegRun(
            self.telemetry,
            request.parent_span,
            role=leg.role,
            backend=backend.name,
            server_address=backend.server_address,
            operation=request.operation,
            model=leg.model or (requested if isinstance(requested, str) else None),
            stream=policy.shaping.force_stream or request.stream,
            capture_text=policy.capture.text == "full",
            chunk_events=policy.chunk_events,
            share=leg.share,
            speculative=backend.speculative,
        )
        outcome: StreamOutcome = "upstream_error"
        error_type: str | None = None
        detail: str | None = None  # what the error said, for the log
        shaped = False  # a request the gateway could not shape is no fault of the backend's
        backend_load = None
        try:
            # Let the primary's request leave first. launch() runs before the primary is sent, and
            # aiohttp writes a request's headers and body from a task it queues as it sends
            # (CPython < 3.12 has no eager tasks): one yield puts this leg's set-up behind it.
            await asyncio.sleep(0)
            body = shape_shadow_body(request.payload, leg, policy.shaping, route=request.route)
            shaped = True
            headers = shadow_headers(
                request.client_headers,
                leg,
                policy,
                request_id=request.request_id,
                # Our leg span's context; with tracing off (no-op span) the client's own
                # traceparent, so a traced backend still joins the client's trace.
                traceparent=run.trace_headers().get("traceparent")
                or request.client_headers.get("traceparent"),
            )
            category = request.client_headers.get(CATEGORY_HEADER)
            if category:  # gateway-owned, so never in the allow-list: set here on purpose
                headers[CATEGORY_HEADER] = category
            backend_load = self.loads[backend.name]
            run.dispatch(backend_load.dispatch(backend.replicas, request.mirrored_ns), backend_load)
            client = self.client(backend)
            async with client.open(
                "POST", request.path_qs, headers=headers, data=body, retry=False
            ) as up:
                tee = run.attach(up)
                self.count("sent", leg.role, backend.name)
                outcome, error_type = await drain(up, tee)
        except UpstreamError as exc:
            outcome = "upstream_timeout" if exc.status == 504 else "upstream_error"
            error_type, detail = type(exc).__name__, exc.message
        except asyncio.CancelledError:
            outcome, error_type = batch.cancel_reason[0], None
        # The task boundary: whatever goes wrong in a shadow is contained here and recorded.
        except Exception as exc:  # noqa: BLE001
            outcome, error_type = "upstream_error", type(exc).__name__
            detail = str(exc)[:200] or None
        finally:
            self.in_flight -= 1
            if backend_load is not None:
                backend_load.done()
        ok = outcome == "completed"
        # Only what the backend did counts: a client sending JSON that cannot be re-encoded (nested
        # deeper than orjson.dumps allows) must not be able to open the breaker for everyone.
        verdict = backend_verdict(outcome, run.status) if shaped else None
        error = None
        if verdict is False:
            error = failure_text(outcome, run.status, error_type, detail)
            self.failure_log.failed(backend.name, backend.url, leg.role, error)
        elif not shaped and outcome == "upstream_error":
            # The client's request, not the backend: at DEBUG, or any client could fill the log.
            log.debug(
                "shadow leg to %s not sent: the request could not be shaped for it: %s",
                backend.name,
                failure_text(outcome, run.status, error_type, detail),
            )
        self.breaker(backend, policy.budgets.breaker).observe(verdict, error)
        self.count("completed" if ok else "failed", leg.role, backend.name, "" if ok else outcome)
        return run.finish(outcome, error_type)
