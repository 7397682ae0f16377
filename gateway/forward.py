"""Forwarding: relay one upstream response to the client byte for byte, and tee it to a recorder.

The tee takes the arrival timestamp first, writes the bytes to the client second, and only then
feeds the recorder — parsing never delays a byte, and the timestamp is the read time. Nothing here
buffers a stream or limits line length: ``readany()`` hands over whatever the socket delivered.

Also here: reading a leg without a client (shadows) with the same recorder, so every leg is
measured by one definition.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Iterable

import aiohttp
from aiohttp import web

from core.recorder import StreamRecorder
from core.timings import StreamOutcome
from gateway.headers import client_response_headers, known_content_length


class RecorderTee:
    """Feeds the recorder a decoded copy when the upstream body is gzip/deflate encoded.

    The client always gets the encoded bytes; only the recorder's copy is decoded.
    """

    __slots__ = ("_decoder", "recorder")

    def __init__(self, recorder: StreamRecorder, content_encoding: str | None) -> None:
        self.recorder = recorder
        encoding = (content_encoding or "identity").strip().lower()
        # wbits 47 = 32 + 15: accept both gzip and zlib headers.
        self._decoder = (
            zlib.decompressobj(47) if encoding in {"gzip", "x-gzip", "deflate"} else None
        )

    def feed(self, chunk: bytes, received_ns: int, written_ns: int | None) -> None:
        if self._decoder is not None:
            try:
                chunk = self._decoder.decompress(chunk)
            except zlib.error:
                self._decoder = None
                return
        self.recorder.feed(chunk, received_ns, written_ns)


def recorder_for(response: aiohttp.ClientResponse, t0_ns: int) -> RecorderTee:
    recorder = StreamRecorder(t0_ns=t0_ns, content_type=response.headers.get("content-type"))
    return RecorderTee(recorder, response.headers.get("content-encoding"))


def base_outcome(status: int) -> StreamOutcome:
    return "completed" if status < 400 else "upstream_status"


class UpstreamEnded(Exception):
    """The upstream's body ended in an error; ``outcome`` says how."""

    def __init__(self, outcome: StreamOutcome, error_type: str) -> None:
        super().__init__(outcome)
        self.outcome, self.error_type = outcome, error_type


async def next_chunk(content: aiohttp.StreamReader) -> bytes:
    """Whatever the socket delivered next (b"" at the end); failures as :class:`UpstreamEnded`.

    ``readany`` has no line-length limit and never waits for more than what has arrived.
    """
    try:
        return await content.readany()
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamEnded("upstream_timeout", type(exc).__name__) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamEnded("upstream_error", type(exc).__name__) from exc


async def relay(
    request: web.Request,
    response: aiohttp.ClientResponse,
    *,
    request_id: str,
    tee: RecorderTee | None,
    extra_headers: Iterable[tuple[str, str]] = (),
) -> tuple[web.StreamResponse, StreamOutcome, str | None]:
    """Relay ``response`` to the client unchanged; return the client response and the outcome.

    ``tee`` (None for untimed routes) sees every chunk after it was written. An upstream that
    fails mid-stream ends the client's connection without a terminating chunk (no invented
    ``[DONE]``), exactly as a direct client would have seen it. A client that goes away closes the
    upstream response at once; ``CancelledError`` (aiohttp cancels the handler when the client
    disconnects) propagates after the upstream is closed — the caller finishes the recorder.
    """
    downstream = web.StreamResponse(
        status=response.status,
        reason=response.reason,
        headers=client_response_headers(
            response.headers, request_id=request_id, extra=extra_headers
        ),
    )
    length = known_content_length(response.headers)
    if length is not None:
        downstream.content_length = length
    outcome: StreamOutcome = base_outcome(response.status)
    error_type: str | None = None
    try:
        await downstream.prepare(request)
        content = response.content
        perf_ns = time.perf_counter_ns
        while chunk := await next_chunk(content):
            received_ns = perf_ns()
            await downstream.write(chunk)
            if tee is not None:
                tee.feed(chunk, received_ns, perf_ns())
        # End the client's response now: recording and telemetry happen after it has everything.
        await downstream.write_eof()
    except UpstreamEnded as ended:
        outcome, error_type = ended.outcome, ended.error_type
        # End the client's stream the way the upstream ended ours: abruptly.
        response.close()
        if request.transport is not None:
            request.transport.abort()
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        response.close()
        if tee is not None and tee.recorder.done:
            # The client had the terminal event, i.e. the whole answer (the official SDKs close
            # as soon as they read it): the leg is complete, whatever happened to the rest.
            return downstream, outcome, None
        outcome, error_type = "client_disconnected", type(exc).__name__
    except asyncio.CancelledError:
        response.close()
        raise
    return downstream, outcome, error_type


async def drain(
    response: aiohttp.ClientResponse, tee: RecorderTee
) -> tuple[StreamOutcome, str | None]:
    """Read ``response`` to its very end into ``tee`` with no client (a shadow leg)."""
    content = response.content
    perf_ns = time.perf_counter_ns
    try:
        while chunk := await next_chunk(content):
            tee.feed(chunk, perf_ns(), None)
    except UpstreamEnded as ended:
        return ended.outcome, ended.error_type
    return base_outcome(response.status), None
