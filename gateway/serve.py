"""Running the gateway process: uvloop, aiohttp's ``run_app``, handler cancellation, the GIL
switch interval — the one way an application is served, by ``specshadow serve`` and by benchmarks
that must measure the process a user runs — and :func:`check_listen`, which says in one line why
an address cannot be listened on before anything starts."""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from gateway.settings import Settings


class ListenError(OSError):
    """The gateway cannot listen where it was told to; the message is one line for an operator."""


def listen_problem(host: str, port: int, exc: OSError) -> str:
    """One line for an ``OSError`` from binding ``host:port``."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        why = "the port is already in use (another gateway, or another server?)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine"
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    else:
        why = exc.strerror or str(exc)
    return f"cannot listen on {where}: {why}"


def check_listen(host: str, port: int) -> None:
    """Bind every address ``host`` resolves to at ``port`` (as ``run_app`` will, with
    ``SO_REUSEADDR``) and let go at once; raises :class:`ListenError` with one line naming
    the address and the reason (in use, not local, not permitted, unresolvable)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"--host: cannot resolve {host!r}: {exc.strerror}") from None
    seen: set[tuple[int, object]] = set()
    unavailable: OSError | None = None
    bound = 0
    for family, kind, proto, _name, addr in infos:
        if (family, addr) in seen:
            continue
        seen.add((family, addr))
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # the family is not enabled here: asyncio skips it too
            unavailable = exc
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                # asyncio's create_server skips an address that is not available (an IPv6
                # "localhost" without IPv6, bpo-30945); anything else fails the start.
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise ListenError(listen_problem(host, port, exc)) from None
                unavailable = exc
                continue
            bound += 1
    if not bound and unavailable is not None:
        raise ListenError(listen_problem(host, port, unavailable))


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve_app(
    app: web.Application,
    settings: Settings,
    *,
    print_: Callable[[str], None] | None = None,
    sock: Sequence[socket.socket] | None = None,
) -> None:
    """Run ``app`` the way ``specshadow serve`` does: the process's GIL switch interval, uvloop,
    handler cancellation, no access log. Benchmarks that wrap the gateway use this too, so they
    measure the process a user runs. ``sock``: listening sockets bound already (a worker of
    ``serve --workers N``, :mod:`gateway.workers`) instead of ``settings.host``/``port``."""
    if settings.gil_switch_interval_s is not None:
        sys.setswitchinterval(settings.gil_switch_interval_s)
    where: dict[str, Any] = (
        {"sock": list(sock)} if sock is not None else {"host": settings.host, "port": settings.port}
    )
    web.run_app(
        app,
        **where,
        loop=new_event_loop(),
        shutdown_timeout=settings.shutdown_timeout_s,
        # Cancel the handler the moment the client disconnects: the upstream request is closed
        # at once even while the upstream is silent (no write would notice otherwise).
        handler_cancellation=True,
        access_log=None,
        print=print_,
    )
