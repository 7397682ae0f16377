"""The simulator's I/O shell: an aiohttp app that paces and writes :class:`~simulator.plan.Plan`\\ s.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not),
``POST /v1/responses``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's, over
:mod:`simulator.tokens`), ``GET /v1/models``, ``GET /server_info``, ``GET /health``, ``GET /version``, ``GET /metrics`` (Prometheus text),
``GET /sim/requests[?id=…]`` (ground truth as JSON), ``POST /sim/engine`` (change what the server
says it runs, mid-run: :mod:`simulator.engine_info`).

Per request: parse and validate (pure) → plan the answer (pure) → record the plan as ground truth →
apply faults → queue for an engine slot → sleep the prefill, emit the first token → one
``asyncio.sleep(step)`` per engine step, emitting that step's tokens as one chunk. Streaming
headers go out before the queue and the prefill, as uvicorn/starlette do for vLLM. Every SSE event
is preceded by a ``: sent_ns=<perf_counter_ns>`` comment stamped immediately before the write.

Size: the simulator's HTTP shell — one handler per route and the engine runner that paces a plan;
everything pure is elsewhere (``request``, ``plan``, ``render``, ``responses``, ``engine``,
``metrics``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from core import jsonx
from core.wire import CATEGORY_HEADER, REQUEST_ID_HEADER
from simulator.acceptance import Step
from simulator.config import (
    FAULT_HEADER,
    Faults,
    FaultSyntaxError,
    SimConfig,
    parse_faults,
)
from simulator.engine import BatchEngine
from simulator.engine_info import SimEngine
from simulator.metrics import METRICS_CONTENT_TYPE, SimMetrics
from simulator.plan import Plan, plan_completion
from simulator.render import (
    error_body,
    full_body,
    request_metrics,
    stream_chunk,
    tool_call_id,
    usage,
    usage_chunk,
)
from simulator.request import (
    Route,
    SimRequest,
    SimRequestError,
    classify,
    parse_detokenize,
    parse_request,
    parse_tokenize,
)
from simulator.responses import ResponsesRender, response_id_for
from simulator.state import EventKindSent, RecordOutcome, RequestRecord, SentEvent, SimState
from simulator.tokens import decode, decode_piece

CONFIG = web.AppKey("sim_config", SimConfig)
BATCH = web.AppKey("sim_batch", BatchEngine)
STATE = web.AppKey("sim_state", SimState)
METRICS = web.AppKey("sim_metrics", SimMetrics)
ENGINE = web.AppKey("sim_engine", SimEngine)

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class _StreamStopped(Exception):
    """A fault ended the response early (hang or drop); ``outcome`` says which."""

    def __init__(self, outcome: RecordOutcome) -> None:
        super().__init__(outcome)
        self.outcome: RecordOutcome = outcome


def _json_response(
    obj: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=jsonx.dumps(obj), status=status, content_type="application/json", headers=headers
    )


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return _json_response(error_body(status, message, err_type, param), status=status)


async def _hang(request: web.Request, state: SimState, config: SimConfig) -> None:
    """Send nothing until the client leaves, the server shuts down or ``hang_max_s`` passes."""
    deadline_ns = time.perf_counter_ns() + int(config.hang_max_s * 1e9)
    while not state.closing.is_set() and time.perf_counter_ns() < deadline_ns:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(0.02)


class _EventWriter:
    """Writes SSE events with their send stamps and applies the per-event faults."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        record: RequestRecord,
        faults: Faults,
        state: SimState,
        config: SimConfig,
    ) -> None:
        self._request = request
        self._response = response
        self._record = record
        self._faults = faults
        self._state = state
        self._config = config
        self.sent = 0

    async def send(
        self, kind: EventKindSent, data: bytes, tokens: int = 0, event: str | None = None
    ) -> None:
        faults = self._faults
        if faults.drop_after is not None and self.sent >= faults.drop_after:
            if self._request.transport is not None:
                self._request.transport.abort()
            raise _StreamStopped("dropped")
        if faults.hang_after is not None and self.sent >= faults.hang_after:
            await _hang(self._request, self._state, self._config)
            raise _StreamStopped("hung")
        payload = b"data: " + data + b"\n\n"
        if event is not None:
            payload = b"event: " + event.encode() + b"\n" + payload
        sent_ns = time.perf_counter_ns()
        if self._config.stamp_events:
            payload = b": sent_ns=%d\n" % sent_ns + payload
        await self._response.write(payload)
        self._record.events.append(SentEvent(kind, sent_ns, tokens))
        self.sent += 1


@dataclass(slots=True)
class _Engine:
    """Runs one plan through the queue and the engine steps, keeping metrics and the record.

    Independent mode (the default): the request sleeps through its own steps, ``step_s`` each,
    whatever else runs. Continuous batching: the server's :class:`~simulator.engine.BatchEngine`
    times the steps of every running request together (``batch``).
    """

    config: SimConfig
    state: SimState
    metrics: SimMetrics
    plan: Plan
    record: RequestRecord
    batch: BatchEngine | None = None

    async def run(self, on_step: Callable[[int, int, int, Step], Awaitable[None]]) -> None:
        """Calls ``on_step(index, start, end, step)`` as each step's tokens [start, end) exist."""
        if self.batch is not None:
            await self._run_batched(self.batch, on_step)
            return
        config, plan, record, metrics = self.config, self.plan, self.record, self.metrics
        metrics.queued()
        try:
            await self.state.slots.acquire()
        except BaseException:
            metrics.waiting.dec()
            raise
        record.started_ns = time.perf_counter_ns()
        metrics.started((record.started_ns - record.arrival_ns) / 1e9, plan.prompt_tokens)
        kv_tokens = plan.prompt_tokens
        completed = False
        step_s = config.step_s + (config.spec_step_overhead_s if config.speculative else 0.0)
        try:
            prefill_s = config.prefill_base_s + config.prefill_per_token_s * plan.prompt_tokens
            await asyncio.sleep(prefill_s)
            prev_ns = record.arrival_ns
            pos = 0
            for index, step in enumerate(plan.steps):
                if index:
                    await asyncio.sleep(step_s)
                now_ns = time.perf_counter_ns()
                record.step_ns.append(now_ns)
                record.step_cost_s.append(step_s if index else prefill_s)
                if index == 0:
                    record.first_token_ns = now_ns
                record.last_token_ns = now_ns
                metrics.step(step, first=index == 0, elapsed_s=(now_ns - prev_ns) / 1e9)
                kv_tokens += step.emitted
                prev_ns = now_ns
                await on_step(index, pos, pos + step.emitted, step)
                pos += step.emitted
            completed = True
        finally:
            self.state.slots.release()
            e2e_s = None
            if completed and record.last_token_ns is not None:
                e2e_s = (record.last_token_ns - record.arrival_ns) / 1e9
            reason = "stop" if plan.finish_reason == "tool_calls" else plan.finish_reason
            metrics.finished(
                kv_tokens=kv_tokens, finish_reason=reason if completed else None, e2e_s=e2e_s
            )

    async def _run_batched(
        self, batch: BatchEngine, on_step: Callable[[int, int, int, Step], Awaitable[None]]
    ) -> None:
        queue = await batch.submit(self.plan, self.record)
        steps = len(self.plan.steps)
        try:
            for _ in range(steps):
                item = await queue.get()
                if item is None:
                    raise ConnectionResetError("engine stopped")
                await on_step(*item)
        except BaseException:
            batch.abandon(queue)
            raise


def _metrics_object(engine: _Engine) -> dict[str, Any]:
    record = engine.record
    return request_metrics(
        engine.plan,
        k=engine.config.num_speculative_tokens,
        speculative=engine.config.speculative,
        arrival_ns=record.arrival_ns,
        started_ns=record.started_ns or record.arrival_ns,
        step_ns=record.step_ns,
    )


async def _stream(
    request: web.Request, sim: SimRequest, engine: _Engine, faults: Faults, response_id: str
) -> web.StreamResponse:
    record, plan, config = engine.record, engine.plan, engine.config
    created = int(time.time())
    call_id = tool_call_id(response_id)
    response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: record.request_id})
    await response.prepare(request)
    writer = _EventWriter(request, response, record, faults, engine.state, config)
    chunk_kw: dict[str, Any] = {
        "response_id": response_id,
        "created": created,
        "model": sim.model,
        "plan": plan,
        "call_id": call_id,
    }
    malformed_at = len(plan.steps) // 2 if faults.malformed else -1
    responses = (
        ResponsesRender(sim, response_id=response_id, created=created, model=sim.model, plan=plan)
        if sim.route == "responses"
        else None
    )

    def with_usage(chunk: dict[str, Any], completion_tokens: int) -> bytes:
        if sim.include_usage and sim.continuous_usage:
            prompt_ids = chunk.pop("prompt_token_ids", None)  # vLLM writes it after usage
            chunk["usage"] = usage(plan.prompt_tokens, completion_tokens)
            if prompt_ids is not None:
                chunk["prompt_token_ids"] = prompt_ids
        return jsonx.dumps(chunk)

    async def on_responses_step(index: int, start: int, end: int, step: Step) -> None:
        assert responses is not None
        if index == 0:
            for name, data in responses.opening():
                await writer.send("other", data, event=name)
        event = responses.delta(start, end)
        if event is None:
            return
        if index == malformed_at:
            await writer.send("malformed", event[1][: len(event[1]) // 2], event=event[0])
        await writer.send("output", event[1], tokens=end - start, event=event[0])

    async def on_step(index: int, start: int, end: int, step: Step) -> None:
        if index == 0 and sim.route == "chat":
            role = stream_chunk(sim, start=0, end=0, finish_reason=None, role_only=True, **chunk_kw)
            await writer.send("role", with_usage(role, 0))
        if index == malformed_at:
            broken = jsonx.dumps(
                stream_chunk(sim, start=start, end=end, finish_reason=None, **chunk_kw)
            )
            await writer.send("malformed", broken[: len(broken) // 2])
        last = end == len(plan.tokens)
        chunk = stream_chunk(
            sim,
            start=start,
            end=end,
            finish_reason=plan.finish_reason if last else None,
            **chunk_kw,
        )
        await writer.send("output", with_usage(chunk, end), tokens=end - start)

    try:
        if responses is not None:
            await engine.run(on_responses_step)
            metrics = _metrics_object(engine) if sim.include_metrics else None
            *middle, terminal = responses.closing(metrics)
            for name, data in middle:
                await writer.send("other", data, event=name)
            await writer.send("usage", terminal[1], event=terminal[0])  # no [DONE] follows
            await response.write_eof()
            record.outcome = "completed"
            return response
        await engine.run(on_step)
        if sim.include_usage:
            final = usage_chunk(
                sim, response_id=response_id, created=created, model=sim.model, plan=plan
            )
            if sim.include_metrics:
                final["metrics"] = _metrics_object(engine)
            await writer.send("usage", jsonx.dumps(final))
        await writer.send("done", b"[DONE]")
        await response.write_eof()
        record.outcome = "completed"
    except _StreamStopped as stop:
        record.outcome = stop.outcome
    except (ConnectionResetError, OSError):
        record.outcome = "client_disconnected"
    except asyncio.CancelledError:
        # Servers started with handler_cancellation=True (aiohttp's TestServer) cancel the
        # handler when the client leaves instead of failing the next write.
        record.outcome = "client_disconnected"
        raise
    finally:
        record.finished_ns = time.perf_counter_ns()
    return response


async def _respond_whole(
    request: web.Request, sim: SimRequest, engine: _Engine, faults: Faults, response_id: str
) -> web.StreamResponse:
    record, plan = engine.record, engine.plan

    async def on_step(index: int, start: int, end: int, step: Step) -> None:
        return None

    try:
        await engine.run(on_step)
    finally:
        record.finished_ns = time.perf_counter_ns()
    metrics = _metrics_object(engine) if sim.include_metrics else None
    if sim.route == "responses":
        render = ResponsesRender(
            sim, response_id=response_id, created=int(time.time()), model=sim.model, plan=plan
        )
        body = render.response(done=True, metrics=metrics)
    else:
        body = full_body(
            sim,
            response_id=response_id,
            created=int(time.time()),
            model=sim.model,
            plan=plan,
            call_id=tool_call_id(response_id),
        )
        if metrics is not None:
            body["metrics"] = metrics
    data = jsonx.dumps(body)
    headers = {REQUEST_ID_HEADER: record.request_id}
    if faults.hang_after is not None or faults.drop_after is not None:
        response = web.StreamResponse(headers={**headers, "Content-Type": "application/json"})
        response.content_length = len(data)
        await response.prepare(request)
        if faults.drop_after is not None:
            if request.transport is not None:
                request.transport.abort()
            record.outcome = "dropped"
        else:
            await _hang(request, engine.state, engine.config)
            record.outcome = "hung"
        return response
    if faults.malformed:
        data = data[: len(data) // 2]
    record.outcome = "completed"
    return web.Response(body=data, content_type="application/json", headers=headers)


def _completions_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        arrival_ns = time.perf_counter_ns()
        config, state, metrics = request.app[CONFIG], request.app[STATE], request.app[METRICS]
        state.received += 1
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        faults = config.faults
        fault_header = request.headers.get(FAULT_HEADER)
        if fault_header:
            try:
                faults = faults.merged(parse_faults(fault_header))
            except FaultSyntaxError as exc:
                return _error(400, f"{FAULT_HEADER}: {exc}", "BadRequestError", FAULT_HEADER)
        try:
            sim = parse_request(route, await request.read(), config)
        except SimRequestError as exc:
            return _error(exc.status, exc.message, exc.error_type, exc.param)
        plan = plan_completion(config, sim, classify(sim, request.headers.get(CATEGORY_HEADER)))
        record = RequestRecord.from_plan(
            request_id=request_id,
            route=route,
            model=sim.model,
            stream=sim.stream,
            plan=plan,
            faults=repr(faults) if faults.any else "",
            arrival_ns=arrival_ns,
        )
        state.add(record)

        if faults.slow_headers_s > 0:
            await asyncio.sleep(faults.slow_headers_s)
        if faults.hang_before_headers:
            record.outcome = "hung"
            await _hang(request, state, config)
            record.finished_ns = time.perf_counter_ns()
            return _error(503, "simulator shutting down", "ServiceUnavailableError")
        if faults.status is not None:
            record.status = faults.status
            record.outcome = "error_status"
            record.finished_ns = time.perf_counter_ns()
            return _error(
                faults.status, f"simulated fault: status {faults.status}", "SimulatedFault"
            )

        if route == "responses":
            response_id = response_id_for(request_id)
        else:
            response_id = f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{request_id}"
        engine = _Engine(config, state, metrics, plan, record, request.app.get(BATCH))
        if sim.stream:
            return await _stream(request, sim, engine, faults, response_id)
        return await _respond_whole(request, sim, engine, faults, response_id)

    return handle


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    created = int(time.time())
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [],
        }
        for name in config.served_names
    ]
    return _json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return _json_response({"version": request.app[ENGINE].version})


async def _server_info(request: web.Request) -> web.Response:
    """vLLM's development endpoint (``VLLM_SERVER_DEV_MODE=1``): :mod:`simulator.engine_info`."""
    if not request.app[CONFIG].server_info:
        return _error(404, "Not Found", "NotFoundError")
    return _json_response(request.app[ENGINE].server_info())


async def _set_engine(request: web.Request) -> web.Response:
    """``POST /sim/engine`` ``{"version": "0.33.0", …}``: what the server says it runs, from now."""
    try:
        changes = await request.json()
        if not isinstance(changes, dict):
            raise ValueError("expected a JSON object")
        request.app[ENGINE].update(**changes)
    except ValueError as exc:
        return _error(400, str(exc), "BadRequestError")
    return _json_response(request.app[ENGINE].settings)


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: the ids a request with that prompt is served with."""
    config = request.app[CONFIG]
    try:
        parsed = parse_tokenize(await request.read(), config)
    except SimRequestError as exc:
        return _error(exc.status, exc.message, exc.error_type, exc.param)
    strs = [decode_piece(i) or "" for i in parsed.ids] if parsed.return_token_strs else None
    return _json_response(
        {
            "count": len(parsed.ids),
            "max_model_len": config.max_model_len,
            "tokens": list(parsed.ids),
            "token_strs": strs,
        }
    )


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /detokenize``; an id this server never tokenized is a 400."""
    config = request.app[CONFIG]
    try:
        ids = parse_detokenize(await request.read(), config)
        text = decode(ids)
    except SimRequestError as exc:
        return _error(exc.status, exc.message, exc.error_type, exc.param)
    except KeyError as exc:
        return _error(400, f"unknown token id {exc.args[0]}", "BadRequestError", "tokens")
    return _json_response({"prompt": text})


async def _metrics(request: web.Request) -> web.Response:
    response = web.Response(
        body=request.app[METRICS].render() + request.app[ENGINE].cache_config_info()
    )
    response.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return response


async def _sim_requests(request: web.Request) -> web.Response:
    state = request.app[STATE]
    request_id = request.query.get("id")
    if request_id is None:
        return _json_response({"ids": list(state.requests), "received": state.received})
    record = state.get(request_id)
    if record is None:
        return _error(404, f"no record for request id {request_id!r}", "NotFoundError", "id")
    return _json_response(record.to_json())


async def _on_shutdown(app: web.Application) -> None:
    app[STATE].closing.set()


def create_sim_app(config: SimConfig) -> web.Application:
    """A simulated vLLM OpenAI server for ``config``; its ground truth is ``app[STATE]``."""
    app = web.Application()
    app[CONFIG] = config
    app[STATE] = SimState(config.max_records, config.max_num_seqs)
    app[METRICS] = SimMetrics(config)
    app[ENGINE] = SimEngine(config)
    if config.batching == "continuous":
        app[BATCH] = BatchEngine(config, app[METRICS])

        async def stop_engine(app: web.Application) -> None:
            await app[BATCH].close()

        app.on_shutdown.append(stop_engine)
    app.router.add_post("/v1/chat/completions", _completions_handler("chat"))
    app.router.add_post("/v1/completions", _completions_handler("completions"))
    app.router.add_post("/v1/responses", _completions_handler("responses"))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/server_info", _server_info)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/sim/requests", _sim_requests)
    app.router.add_post("/sim/engine", _set_engine)
    app.on_shutdown.append(_on_shutdown)
    return app


@dataclass(frozen=True, slots=True)
class SimServer:
    """A running simulator: ``base_url`` is ``http://host:port`` (append ``/v1`` for OpenAI)."""

    base_url: str
    host: str
    port: int
    app: web.Application
    state: SimState
    config: SimConfig

    @property
    def metrics(self) -> SimMetrics:
        return self.app[METRICS]

    @property
    def engine(self) -> SimEngine:
        """What the server says it runs; ``engine.update(version=…)`` changes it mid-run."""
        return self.app[ENGINE]


@asynccontextmanager
async def run_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout_s: float = 1.0
) -> AsyncIterator[SimServer]:
    """Serve ``config`` on a real socket (``port=0``: a free one) for the ``async with`` body."""
    app = create_sim_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        yield SimServer(
            base_url=f"http://{host}:{bound_port}",
            host=host,
            port=bound_port,
            app=app,
            state=app[STATE],
            config=config,
        )
    finally:
        await runner.cleanup()
