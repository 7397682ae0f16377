"""UpstreamClient: one pooled aiohttp session per upstream, and the connect phase of a request.

Owns the connection pool, the timeouts (connect and idle-read, never a total that would kill long
streams) and the pre-first-byte retry. Responses are returned open; the caller reads and closes
them inside ``async with`` (see :meth:`UpstreamClient.open`).

A backend that closes its connection after a response without saying so (llama.cpp's server after
every streamed answer: no ``Connection: close``) leaves a dead connection in the pool. Two
defences (docs/reliability.md, "Backends that close after a response"):

- **resend, unsent only**: a request whose first write found the pooled connection already closed
  by the peer (aiohttp: :class:`aiohttp.ClientOSError` caused by
  :class:`aiohttp.ClientConnectionResetError`, "cannot write to closing transport") had not one
  byte handed to the socket, so the backend cannot have seen it: it is sent once more on a fresh
  connection. Only a replayable body (bytes or none) and no ``Expect: 100-continue`` (which sends
  the headers first);
- **known or learned, then never pool**: a backend of kind ``llamacpp`` is known to close
  (``closes_connections``); otherwise that failure, or a connection dropped before any response byte
  (:class:`aiohttp.ServerDisconnectedError`), marks the backend as one that closes; from then on
  every request to it goes on a connection of its own (a ``force_close`` connector), so no
  request is ever written to a connection the backend may be closing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from gateway.retry import connect_retrying
from gateway.settings import UpstreamSettings

log = logging.getLogger(__name__)

# Backend kinds whose servers close the connection after every streamed response, unannounced
# (llama.cpp's): their clients never pool.
CLOSING_KINDS = frozenset({"llamacpp"})


def never_sent(exc: BaseException) -> bool:
    """True when aiohttp failed a request at its first write because the pooled connection was
    already closing (the peer closed it): nothing of the request reached the socket."""
    return (
        isinstance(exc, aiohttp.ClientOSError)
        and not isinstance(exc, aiohttp.ClientConnectorError)
        and isinstance(exc.__cause__, aiohttp.ClientConnectionResetError)
    )


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    name: str
    base_url: str

    @property
    def server_address(self) -> str:
        url = URL(self.base_url)
        return f"{url.host}:{url.port}"

    def url_for(self, path_qs: str) -> URL:
        # The client's path is appended as sent (``/v1/...``), so a base with a prefix works too.
        return URL(self.base_url.rstrip("/") + path_qs, encoded=True)


class UpstreamClient:
    """A named upstream with its own pool. Create with :meth:`create`, close with :meth:`close`."""

    def __init__(
        self,
        target: UpstreamTarget,
        settings: UpstreamSettings,
        *,
        closes_connections: bool = False,
    ) -> None:
        """``closes_connections``: the backend is known to close after each response (a
        ``llamacpp`` backend): never pooled, from the first request on."""
        self.target = target
        self.settings = settings
        connector = aiohttp.TCPConnector(
            limit=settings.max_connections,
            limit_per_host=0,
            keepalive_timeout=settings.keepalive_s,
            ttl_dns_cache=300,
            enable_cleanup_closed=False,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=None,
                sock_connect=settings.connect_timeout_s,
                sock_read=settings.idle_timeout_s,
            ),
            # Compressed bodies are relayed as they are, never decoded and re-sent.
            auto_decompress=False,
            # Only what the client sent: no invented User-Agent / Accept-Encoding.
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # Upstream headers larger than aiohttp's 8 KiB default must still pass.
            max_line_size=65536,
            max_field_size=65536,
            read_bufsize=2**16,
            raise_for_status=False,
            trust_env=False,
        )
        # The session without a pool (force_close), made when first needed: the one resend of an
        # unsent request, and every request once the backend was seen closing connections.
        self._unpooled: aiohttp.ClientSession | None = None
        self.closes_connections = closes_connections  # known, or learned (module doc)
        self.resent = 0  # requests sent again because the first try provably never left

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self._unpooled is None:
            s = self.session
            self._unpooled = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.settings.max_connections,
                    limit_per_host=0,
                    force_close=True,
                    ttl_dns_cache=300,
                    enable_cleanup_closed=False,
                ),
                timeout=s.timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                max_line_size=65536,
                max_field_size=65536,
                read_bufsize=2**16,
                raise_for_status=False,
                trust_env=False,
            )
        return self._unpooled

    def _learn_closes(self, why: str) -> None:
        if not self.closes_connections:
            self.closes_connections = True
            log.info(
                "upstream %s closes connections after a response (%s): not pooled from now on",
                self.target.name,
                why,
            )

    async def _request(
        self,
        method: str,
        url: URL,
        headers: CIMultiDict[str] | Mapping[str, str],
        data: bytes | AsyncIterable[bytes] | None,
    ) -> aiohttp.ClientResponse:
        """One request; a first write that found the pooled connection closed is sent again on a
        fresh connection (module doc), and the backend is learned as one that closes."""
        session = self._fresh_session() if self.closes_connections else self.session
        try:
            return await session.request(method, url, headers=headers, data=data)
        except aiohttp.ServerDisconnectedError:
            self._learn_closes("a connection dropped before any answer")
            raise
        except aiohttp.ClientOSError as exc:
            if not never_sent(exc):
                raise
            self._learn_closes("a pooled connection was closed when reused")
            replayable = data is None or isinstance(data, bytes)
            expects = any(k.lower() == "expect" for k in headers)
            if not replayable or expects:
                raise
            self.resent += 1
            return await self._fresh_session().request(method, url, headers=headers, data=data)

    async def close(self) -> None:
        await self.session.close()
        if self._unpooled is not None:
            await self._unpooled.close()

    @asynccontextmanager
    async def open(
        self,
        method: str,
        path_qs: str,
        *,
        headers: CIMultiDict[str] | Mapping[str, str],
        data: bytes | AsyncIterable[bytes] | None,
        retry: bool = True,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request and yield the response once its headers arrived.

        Raises :class:`UpstreamConnectError` (refused/unreachable, after retries) or
        :class:`UpstreamTimeout` (connect or header timeout) before anything is yielded. The
        response is released (or closed, when unread) on exit.
        """
        url = self.target.url_for(path_qs)
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                response = await self._request(method, url, headers, data)
            except aiohttp.ClientConnectorError:
                # The happy path builds no retry machinery; a refused connect retries (only a
                # replayable body: bytes, not a stream already half consumed).
                replayable = data is None or isinstance(data, bytes)
                if not retry or not replayable or self.settings.retry_attempts <= 1:
                    raise
                await asyncio.sleep(self.settings.retry_initial_s)
                async for attempt in connect_retrying(self.settings, first_failed=True):
                    with attempt:
                        response = await self._request(method, url, headers, data)
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(
                f"upstream {self.target.name} unreachable: {exc.os_error}"
            ) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(
                f"upstream {self.target.name} timed out before responding"
            ) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(
                f"upstream {self.target.name} failed: {type(exc).__name__}"
            ) from exc
        assert response is not None
        try:
            yield response
        finally:
            response.release()
