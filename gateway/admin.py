"""Admin endpoints: the active policy and the shadow counters.

Served only to loopback peers, or to anyone presenting ``Authorization: Bearer <admin_token>``
when the operator configured a token (``SPECSHADOW_ADMIN_TOKEN``). Everything else gets 403.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from core import jsonx
from gateway.errors import GatewayError
from gateway.state import GATEWAY


class AdminForbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "admin_forbidden"


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    # A dual-stack listener ("::") reports an IPv4 peer as ::ffff:a.b.c.d, which Python 3.11
    # does not call loopback even for 127.0.0.1.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def authorize(request: web.Request) -> None:
    token = request.app[GATEWAY].settings.admin_token
    if token:
        presented = request.headers.get("authorization", "")
        if hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            return
    if _is_loopback(request.remote):
        return
    raise AdminForbidden("admin endpoints are served to loopback or with the admin bearer token")


def _json(body: object) -> web.Response:
    return web.Response(body=jsonx.dumps(body, indent=True), content_type="application/json")


async def policy_status(request: web.Request) -> web.Response:
    authorize(request)
    return _json(request.app[GATEWAY].policy.status_dict())


async def shadow_status(request: web.Request) -> web.Response:
    authorize(request)
    gw = request.app[GATEWAY]
    shadows = gw.shadows
    return _json(
        {
            "in_flight": shadows.in_flight,
            "primary_in_flight": gw.in_flight,
            "tasks": len(gw.tasks),  # live background tasks: shadow legs, exchange assembly, ...
            "breakers": {name: b.state for name, b in shadows.breakers.items()},
            "counts": [
                {"event": e, "role": r, "backend": b, "reason": reason or None, "count": n}
                for (e, r, b, reason), n in sorted(shadows.counts.items())
            ],
        }
    )
