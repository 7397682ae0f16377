"""UpstreamClient: one pooled aiohttp session per upstream, and the connect phase of a request.

Owns the connection pool, the timeouts (connect and idle-read, never a total that would kill long
streams) and the pre-first-byte retry. Responses are returned open; the caller reads and closes
them inside ``async with`` (see :meth:`UpstreamClient.open`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from gateway.retry import connect_retrying
from gateway.settings import UpstreamSettings


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

    def __init__(self, target: UpstreamTarget, settings: UpstreamSettings) -> None:
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

    async def close(self) -> None:
        await self.session.close()

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
                response = await self.session.request(method, url, headers=headers, data=data)
            except aiohttp.ClientConnectorError:
                # The happy path builds no retry machinery; a refused connect retries (only a
                # replayable body: bytes, not a stream already half consumed).
                replayable = data is None or isinstance(data, bytes)
                if not retry or not replayable or self.settings.retry_attempts <= 1:
                    raise
                await asyncio.sleep(self.settings.retry_initial_s)
                async for attempt in connect_retrying(self.settings, first_failed=True):
                    with attempt:
                        response = await self.session.request(
                            method, url, headers=headers, data=data
                        )
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
