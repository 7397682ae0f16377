"""Header rules for relaying (pure): what crosses the proxy in each direction.

- Hop-by-hop headers (RFC 9110 §7.6.1) and any header named in ``Connection`` are dropped in both
  directions; everything else is end-to-end and relayed unchanged.
- ``Content-Encoding`` is relayed together with the still-encoded body (the gateway never decodes
  and re-sends with a stale encoding). ``Content-Length`` is recomputed by aiohttp for requests and
  preserved for responses whose length is known.
- Credentials (``Authorization``, API keys, cookies) go to the primary, which the client addressed,
  but never to a shadow unless a policy allow-list says so (the rules: ``policies.headers``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from core.wire import REQUEST_ID_HEADER
from policies.headers import is_credential

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Recomputed or owned by the transport, never copied from the other side.
_REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length"}
_RESPONSE_SKIP = HOP_BY_HOP | {"content-length"}


def _connection_tokens(headers: Mapping[str, str] | CIMultiDictProxy[str]) -> frozenset[str]:
    value = headers.get("connection")
    if not value:
        return frozenset()
    return frozenset(t.strip().lower() for t in value.split(",") if t.strip())


def _filtered(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], skip: frozenset[str]
) -> CIMultiDict[str]:
    drop = skip | _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def upstream_request_headers(
    client_headers: CIMultiDictProxy[str], *, request_id: str, extra: Iterable[tuple[str, str]] = ()
) -> CIMultiDict[str]:
    """Headers for the primary: the client's end-to-end headers, the request id, and ``extra``."""
    out = _filtered(client_headers, _REQUEST_SKIP)
    out[REQUEST_ID_HEADER] = request_id
    for name, value in extra:
        out[name] = value
    return out


def candidate_request_headers(
    client_headers: CIMultiDictProxy[str],
    *,
    request_id: str,
    auth: tuple[str, str] | None,
    extra: Iterable[tuple[str, str]] = (),
) -> CIMultiDict[str]:
    """Headers for a candidate that *answers* the client (canary, live): the client's end-to-end
    headers without its credentials — the candidate gets its own key (``auth``), never the
    client's — plus the request id and ``extra``."""
    out = upstream_request_headers(client_headers, request_id=request_id, extra=extra)
    for name in [n for n in out if is_credential(n.lower())]:
        del out[name]
    if auth is not None:
        out[auth[0]] = auth[1]
    return out


def client_response_headers(
    upstream_headers: CIMultiDictProxy[str],
    *,
    request_id: str,
    extra: Iterable[tuple[str, str]] = (),
) -> CIMultiDict[str]:
    """Headers for the client: the upstream's end-to-end headers plus ``x-request-id`` and
    ``extra`` (``x-specshadow-served-by`` during a rollout)."""
    out = _filtered(upstream_headers, _RESPONSE_SKIP)
    out[REQUEST_ID_HEADER] = request_id
    for name, value in extra:
        out[name] = value
    return out


def known_content_length(upstream_headers: CIMultiDictProxy[str]) -> int | None:
    """The upstream's body length when it declared one (and is not chunked)."""
    if "transfer-encoding" in upstream_headers:
        return None
    value = upstream_headers.get("content-length")
    if value is None or not value.isdigit():
        return None
    return int(value)
