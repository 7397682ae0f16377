"""Bad input: hypothesis drives random bytes, wrong JSON types, invalid UTF-8, huge numbers and
deep nesting through the real gateway (a clean 400 or the primary's relayed answer — never a 500,
never a crash, never a background failure), and arbitrary bytes through the SSE decoder and the
stream recorder (no exception, ever). Oversize bodies get 413 however they arrive.

The gateway under fuzz runs on its own event-loop thread (hypothesis drives synchronous tests),
with a fake primary and a fake shadow at ratio 1, so shaping and recording see every input too.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings, strategies as st

from core.recorder import StreamRecorder
from core.sinks import MemorySink
from core.sse import SSEDecoder
from gateway.settings import Settings, UpstreamSettings
from gateway.state import GATEWAY, Gateway
from specshadow.app import build_app
from tests.fakes.upstream import FakeUpstream, Script
from tests.gateway.test_shadow import strip_stamps
from tests.reliability.helpers import chat, fetch, shadow_policy, wait_for_exchanges

PRIMARY_ANSWER = b'{"id":"x","object":"chat.completion","choices":[]}'
LIMIT = 64 * 1024
UNSHAPEABLE = "TypeError('Recursion limit reached')"
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class _Errors(logging.Handler):
    """Collects every WARNING+ record from the gateway's loggers (a failure anywhere shows up)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(
            ("core", "evidence", "gateway", "rollout", "policies", "otel", "specshadow", "aiohttp")
        ):
            self.records.append(record)


class ThreadedGateway:
    """Fake primary + fake shadow + the gateway (ratio 1) on one event loop in a thread."""

    def __init__(self, policy_dir: Path) -> None:
        self.policy_dir = policy_dir
        self.primary = FakeUpstream(
            Script(headers=[("Content-Type", "application/json")], chunks=[(0, PRIMARY_ANSWER)])
        )
        self.shadow = FakeUpstream(
            Script(headers=[("Content-Type", "application/json")], chunks=[(0, PRIMARY_ANSWER)])
        )
        self.sink = MemorySink(maxlen=100_000)
        self.port = 0
        self.app: web.Application | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-gateway", daemon=True)
        self._failure: BaseException | None = None

    @property
    def gw(self) -> Gateway:
        assert self.app is not None
        return self.app[GATEWAY]

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 — re-raised in __enter__
            self._failure = exc
            self._ready.set()

    async def _site(self, app: web.Application) -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, int(runner.addresses[0][1])

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        p_runner, p_port = await self._site(self.primary.app())
        s_runner, s_port = await self._site(self.shadow.app())
        policy = self.policy_dir / "policy.yaml"
        policy.write_text(
            "version: 1\n"
            f"backends:\n  cand: {{url: 'http://127.0.0.1:{s_port}', kind: sim}}\n"
            "default:\n  ratio: 1\n  legs: [{backend: cand, role: candidate}]\n"
            "budgets: {max_in_flight: 1000, breaker: {failures: 100000, window_s: 1}}\n"
        )
        settings_ = Settings(
            primary_url=f"http://127.0.0.1:{p_port}",
            policy_path=str(policy),
            max_body_bytes=LIMIT,
            shutdown_timeout_s=2.0,
            upstream=UpstreamSettings(connect_timeout_s=2.0, idle_timeout_s=5.0),
        )
        self.app = build_app(settings_, sinks=[self.sink])
        g_runner, self.port = await self._site(self.app)
        self._ready.set()
        await self._stop.wait()
        await g_runner.cleanup()
        await s_runner.cleanup()
        await p_runner.cleanup()

    def __enter__(self) -> ThreadedGateway:
        self._thread.start()
        self._ready.wait(30)
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
        self._loop.close()

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait (from the test thread) until no primary request or background task is running."""

        async def idle() -> None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while self.gw.in_flight or len(self.gw.tasks) > 1:  # 1: the policy watcher
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)

        asyncio.run_coroutine_threadsafe(idle(), self._loop).result(timeout_s + 1)

    def post(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=body,
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    errors = _Errors()
    root = logging.getLogger()
    root.addHandler(errors)
    try:
        with ThreadedGateway(tmp_path_factory.mktemp("fuzz")) as tg:
            yield tg
            tg.settle()
            gw = tg.gw
            assert gw.tasks.failed == 0
            messages = [
                f"{r.name}: {r.getMessage()}"
                for r in errors.records
                if UNSHAPEABLE not in r.getMessage()  # deep JSON: see the breaker test below
            ]
            assert messages == []  # no handler, shadow task or sink thread failed on any input
    finally:
        root.removeHandler(errors)


def check_answer(tg: ThreadedGateway, body: bytes, status: int, answer: bytes) -> None:
    assert status != 500, answer
    if status == 200:
        assert answer == PRIMARY_ANSWER
        assert isinstance(orjson.loads(body), dict)  # only JSON objects are relayed
        return
    assert status == 400, (status, answer)
    error = json.loads(answer)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"


# -- strategies -----------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_known_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": _json,
        "messages": _json,
        "stream": _json,
        "stream_options": _json,
        "temperature": _json,
        "seed": _json,
        "max_tokens": _json,
        "n": _json,
        "tools": _json,
        "response_format": _json,
        "logprobs": _json,
        "include_metrics": _json,
    },
)


def _deep(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


_raw_json_texts = st.one_of(
    st.sampled_from(
        [
            b'{"seed": 1' + b"0" * 400 + b"}",  # an integer far beyond 64 bits
            b'{"temperature": 1e999}',  # infinity when read as a double
            b'{"temperature": -0.0, "seed": 1.5e308}',
            b'{"model": "\\ud800"}',  # a lone surrogate escape
            b'{"model": "\xff\xfe"}',  # invalid UTF-8 inside a string
            b'{"model": "a\x00b"}',  # a raw control character
            b'{"a": 1, "a": 2}',  # duplicate keys
            b"\xef\xbb\xbf{}",  # a BOM
            b"{}" + b" " * 1000,
            b"{} {}",
            b"",
            _deep(100),
            _deep(1100),  # deeper than orjson's limit
            b"[" * 5000,
        ]
    ),
    st.integers(min_value=1, max_value=3000).map(_deep),
)


@FUZZ
@given(body=st.binary(max_size=512))
def test_random_bytes_get_a_clean_400_or_the_primary_answer(fuzz_gateway, body):
    status, answer = fuzz_gateway.post(body)
    check_answer(fuzz_gateway, body, status, answer)


@settings(FUZZ, max_examples=150)
@given(payload=_known_fields | st.dictionaries(st.text(max_size=12), _json, max_size=6))
def test_json_objects_with_wrong_field_types_are_relayed_and_never_break_the_gateway(
    fuzz_gateway, payload
):
    body = json.dumps(payload).encode()  # stdlib: integers beyond 64 bits too
    status, answer = fuzz_gateway.post(body)
    check_answer(fuzz_gateway, body, status, answer)
    if status == 200:
        assert fuzz_gateway.primary.received[-1].body == body  # relayed unchanged


@settings(max_examples=60, deadline=None)
@given(body=_raw_json_texts)
def test_hostile_json_texts_get_a_clean_400_or_the_primary_answer(fuzz_gateway, body):
    status, answer = fuzz_gateway.post(body)
    check_answer(fuzz_gateway, body, status, answer)


_header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=40,
)


@FUZZ
@given(
    retry=_header_values,
    request_id=_header_values,
    category=_header_values,
    traceparent=_header_values,
)
def test_hostile_header_values_never_break_the_gateway(
    fuzz_gateway, retry, request_id, category, traceparent
):
    headers = {
        "x-stainless-retry-count": retry,
        "x-request-id": request_id,
        "x-specshadow-category": category,
        "traceparent": traceparent,
        "baggage": category,
    }
    # http.client sends str header values as latin-1: every byte 0x20-0xFF arrives as sent.
    status, answer = fuzz_gateway.post(b'{"model": "m"}', headers)
    assert status == 200, answer


@pytest.mark.parametrize("value", ["²", "١", "𝟗", "٣٣", "9" * 26, "9" * 5000, "-1", " 1"])
def test_unicode_digit_and_huge_retry_counts_are_not_a_500(fuzz_gateway, value):
    # str.isdigit() is true for these, int() may not be: the header must not crash the handler.
    conn = http.client.HTTPConnection("127.0.0.1", fuzz_gateway.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("x-stainless-retry-count", value.encode())
        conn.putheader("Content-Length", "2")
        conn.endheaders(b"{}")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_the_fuzzed_gateway_recorded_every_relayed_exchange(fuzz_gateway):
    fuzz_gateway.settle()
    relayed = len(fuzz_gateway.primary.received)
    # How many of the fuzz examples the primary got depends on what hypothesis drew and which of
    # this module's tests shared the gateway on this worker; the claim is that every one of them
    # was recorded, so the floor only says the claim is not empty.
    assert relayed > 0
    assert len(fuzz_gateway.sink.exchanges) == relayed
    assert {e.primary.outcome for e in fuzz_gateway.sink.exchanges} == {"completed"}
    shadow_outcomes = {
        (s.outcome, s.error_type) for e in fuzz_gateway.sink.exchanges for s in e.shadows
    }
    # Nested deeper than orjson.dumps allows (255-1024 levels): relayed, but not mirrored.
    assert shadow_outcomes <= {("completed", None), ("upstream_error", "TypeError")}


async def test_requests_too_deep_to_mirror_do_not_open_the_shadow_breaker(
    sims, gateway, write_policy
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    text = shadow_policy(
        primary.base_url,
        candidate.base_url,
        extra="budgets: {breaker: {failures: 2, window_s: 60, cooldown_s: 60}}\n",
    )
    gw = await gateway(None, policy_path=write_policy(text))
    deep = b'{"model": "sim-model", "messages": [], "x": ' + _deep(400) + b"}"
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            reply = await fetch(session, gw.url, deep)
            assert reply.status == 400  # the simulator (the primary) refuses messages: []
        unshaped = await wait_for_exchanges(gw.sink, 4)
        assert {(s.outcome, s.error_type) for e in unshaped for s in e.shadows} == {
            ("upstream_error", "TypeError")
        }
        reply = await fetch(session, gw.url, chat(stream=False))
        assert reply.status == 200
    last = await gw.sink.wait_for(lambda e: e.primary.status == 200)
    assert [s.outcome for s in last.shadows] == ["completed"]  # not dropped: breaker_open
    assert last.drop_reason is None


# -- the SSE decoder and the recorder, with arbitrary bytes -------------------------------------


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


_sse_bytes = st.lists(
    st.sampled_from(
        [b"data: ", b"data:", b"event: x", b": ping", b"id: 1", b"retry: 9", b"\n", b"\r", b"\r\n"]
    )
    | st.binary(max_size=24)
    | _json.map(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n"),
    max_size=40,
).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(data=_sse_bytes | st.binary(max_size=2048), cuts=st.lists(st.integers(0, 4096), max_size=8))
def test_the_sse_decoder_takes_any_bytes_and_any_chunking(data, cuts):
    whole = SSEDecoder()
    expected = whole.feed(data) + whole.flush()
    split = SSEDecoder()
    got = [e for chunk in _chunks(data, cuts) for e in split.feed(chunk)] + split.flush()
    assert got == expected
    assert whole.incomplete_at_eof == split.incomplete_at_eof


def _chunk_event(choice: Any, extra: Any) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


_openai_like = st.lists(
    st.builds(
        _chunk_event,
        st.fixed_dictionaries(
            {"index": _json, "delta": _json},
            optional={"finish_reason": _json, "logprobs": _json, "message": _json, "text": _json},
        ),
        st.fixed_dictionaries({}, optional={"usage": _json, "metrics": _json, "model": _json}),
    )
    | _sse_bytes,
    max_size=12,
).map(b"".join)


@settings(max_examples=150, deadline=None)
@given(
    data=_openai_like | st.binary(max_size=2048),
    cuts=st.lists(st.integers(0, 4096), max_size=8),
    content_type=st.sampled_from(["text/event-stream", "application/json", None, "text/plain"]),
    status=st.sampled_from([None, 200, 400, 500]),
)
def test_the_recorder_never_raises_on_any_bytes(data, cuts, content_type, status):
    recorder = StreamRecorder(t0_ns=1, content_type=content_type)
    for i, chunk in enumerate(_chunks(data, cuts)):
        recorder.feed(chunk, 10 + i, 11 + i)
    recording = recorder.finish(outcome="completed", status=status)
    assert recording.bytes_received == len(data)
    assert recorder.finish() is recording


# -- oversize bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["content-length", "chunked", "chunked-lying-small-pieces"])
async def test_oversize_bodies_get_413_however_they_are_sent(fake_upstream, gateway, how):
    fake, up = await fake_upstream(Script())
    gw = await gateway(up, max_body_bytes=LIMIT)
    big = b'{"p": "' + b"a" * (LIMIT * 4) + b'"}'

    async def pieces() -> AsyncIterator[bytes]:
        step = 1024 if how == "chunked-lying-small-pieces" else 64 * 1024
        for i in range(0, len(big), step):
            yield big[i : i + step]

    async with aiohttp.ClientSession() as session:
        data: Any = big if how == "content-length" else pieces()
        try:
            async with session.post(
                f"{gw.url}/v1/chat/completions",
                data=data,
                headers={"Content-Type": "application/json"},
            ) as resp:
                status, body = resp.status, await resp.read()
        except aiohttp.ClientOSError:
            pytest.fail("the gateway reset the connection instead of answering 413")
        # exactly at the limit still passes
        reply = await fetch(session, gw.url, b'{"p": "' + b"a" * (LIMIT - 9) + b'"}')
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert reply.status == 200 and len(fake.received) == 1


def test_a_client_that_sends_less_than_its_content_length_gets_no_relay(fuzz_gateway):
    before = len(fuzz_gateway.primary.received)
    with socket.create_connection(("127.0.0.1", fuzz_gateway.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{}"
        )
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        answer = s.recv(65536)
    assert not answer.startswith(b"HTTP/1.1 5")
    fuzz_gateway.settle()
    assert len(fuzz_gateway.primary.received) == before


@pytest.mark.parametrize(
    "fields",
    [
        {"stream": "yes"},
        {"messages": 5},
        {"temperature": "hot", "seed": 1.5},
        {"seed": True, "temperature": None},
        {"model": 7},
        {"model": None, "max_tokens": "many"},
        {"stream": True, "stream_options": "usage please"},
        {"stream": 1},
        {"n": -1, "seed": 2**70},
    ],
    ids=repr,
)
async def test_wrong_types_for_known_fields_reach_the_primary_which_decides(
    sims, gateway, write_policy, fields
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    gw = await gateway(
        None, policy_path=write_policy(shadow_policy(primary.base_url, candidate.base_url))
    )
    body = json.dumps({**chat(stream=False), **fields}).encode()
    async with aiohttp.ClientSession() as session:
        direct = await fetch(session, primary.base_url, body)
        relayed = await fetch(session, gw.url, body)
    assert relayed.status == direct.status and relayed.error is None
    assert strip_stamps(relayed.body) == strip_stamps(direct.body)
    exchange = await gw.sink.wait_for(lambda e: e.primary.status == direct.status)
    assert exchange.primary.outcome in ("completed", "upstream_status")
    if not isinstance(fields.get("temperature", 0), int | float):
        assert exchange.temperature is None
    if "seed" in fields and not (type(fields["seed"]) is int and fields["seed"] < 2**63):
        assert exchange.seed is None
    assert exchange.stream is (fields.get("stream") is True)
