"""Client-visible errors and the one middleware that renders them as OpenAI-shaped JSON.

Error tree::

    GatewayError                     every error a client can see; carries status/type/code
      ├─ ClientRequestError          400: unreadable JSON, body not an object
      │    └─ BodyTooLargeError      413: body over the configured limit
      ├─ NotFoundError               404: no such route
      └─ UpstreamError               the primary could not answer
           ├─ UpstreamConnectError   502: refused/unreachable (retried before the first byte)
           └─ UpstreamTimeout        504: connect or idle-read timeout before the headers

An upstream 4xx/5xx is not an error here: its status and body are relayed unchanged. Once a stream
has started, errors cannot change the status: the stream is ended and the outcome recorded.
``PolicyError`` lives in ``policies`` and never reaches a client.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from core import jsonx

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param


class ClientRequestError(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BodyTooLargeError(ClientRequestError):
    status = 413
    code = "request_too_large"


class NotFoundError(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamConnectError(UpstreamError):
    status = 502
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


def error_body(message: str, *, type: str, code: str | None, param: str | None = None) -> bytes:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return jsonx.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def error_response(exc: GatewayError, *, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=exc.status,
        body=error_body(exc.message, type=exc.type, code=exc.code, param=exc.param),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render :class:`GatewayError` (and aiohttp's own 404/405/413) as OpenAI-shaped JSON."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(BodyTooLargeError(exc.text or "request body too large"))
    except web.HTTPNotFound:
        return error_response(NotFoundError(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as exc:
        err = NotFoundError(f"method {request.method} not allowed for {request.path}")
        err.status = exc.status
        return error_response(err)
