"""Admin endpoints: the active policy, the shadow counters, and the rollouts.

Reads are served only to loopback peers, or to anyone presenting ``Authorization: Bearer
<admin_token>`` when the operator configured a token (``SPECSHADOW_ADMIN_TOKEN``). Rollout
changes (``promote``, ``rollback``) need the token from every peer, loopback included, and are
disabled without one. Everything else gets 403.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from aiohttp import web

from core import jsonx
from gateway.errors import ClientRequestError, GatewayError, NotFoundError
from gateway.state import GATEWAY
from rollout.controller import RolloutConflict, RolloutController
from rollout.store import StoreError


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
    raise AdminForbidden(_refusal(request, "admin endpoints are served to loopback or with"))


def _refusal(request: web.Request, head: str) -> str:
    """A wrong token and a missing one are told apart (never echoing what was sent)."""
    presented = request.headers.get("authorization", "")
    if not presented:
        return f"{head} the admin bearer token: no Authorization header was sent"
    if not presented.startswith("Bearer "):
        return f"{head} the admin bearer token: the Authorization header is not 'Bearer <token>'"
    return f"{head} the admin bearer token: the token sent is not the admin token"


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


def authorize_change(request: web.Request) -> None:
    """Rollout changes need the admin token, from anywhere: loopback is not enough."""
    token = request.app[GATEWAY].settings.admin_token
    presented = request.headers.get("authorization", "")
    if token and hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
        return
    raise AdminForbidden(
        _refusal(request, "rollout changes need")
        if token
        else "rollout changes are disabled: start the gateway with SPECSHADOW_ADMIN_TOKEN set"
    )


def _controller(request: web.Request) -> RolloutController:
    controller = request.app[GATEWAY].rollout
    if controller is None:  # pragma: no cover - create_app always builds one
        raise RolloutNotFound("no rollout controller")
    return controller


class RolloutNotFound(NotFoundError):
    type = "not_found_error"
    code = "rollout_not_found"


class RolloutBadRequest(ClientRequestError):
    code = "invalid_rollout_change"


class RolloutChanged(GatewayError):
    """The fleet's state moved since this replica read it (a shared store)."""

    status = 409
    type = "conflict_error"
    code = "rollout_changed"


class RolloutStoreUnavailable(GatewayError):
    """A promotion needs the shared store (a rollback does not: it is kept and published)."""

    status = 503
    type = "service_unavailable_error"
    code = "rollout_store_unavailable"


async def rollout_status(request: web.Request) -> web.Response:
    """``GET /admin/rollout``: every rolling-out rule's stage, serve ratio, guards, last change."""
    authorize(request)
    # Off the event loop: with a shared store the fleet's sync may hold the controller's lock
    # across a store round trip.
    return _json(await asyncio.to_thread(_controller(request).status))


async def _change_body(request: web.Request) -> dict[str, object]:
    if not request.body_exists:
        return {}
    try:
        body = jsonx.loads(await request.read())
    except jsonx.JSONDecodeError as exc:
        raise RolloutBadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RolloutBadRequest("body must be a JSON object")
    return body


async def rollout_promote(request: web.Request) -> web.Response:
    """``POST /admin/rollout/{rule}/promote`` — body optional: ``{"stage": "canary"|"live",
    "serve_ratio": 0.3}``; without one, one step up. Clears a rollback."""
    authorize_change(request)
    body = await _change_body(request)
    stage, ratio = body.get("stage"), body.get("serve_ratio")
    if stage is not None and stage not in ("canary", "live"):
        raise RolloutBadRequest(f"stage: must be 'canary' or 'live', got {stage!r}")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1
    ):
        raise RolloutBadRequest(f"serve_ratio: must be a number in (0, 1], got {ratio!r}")
    name = request.match_info["rule"]
    controller = _controller(request)
    try:
        t = await asyncio.to_thread(
            controller.promote,
            name,
            stage="canary" if stage == "canary" else "live" if stage == "live" else None,
            ratio=float(ratio) if isinstance(ratio, int | float) else None,
        )
    except KeyError:
        raise RolloutNotFound(f"no rule {name!r} has a rollout") from None
    except RolloutConflict as exc:
        raise RolloutChanged(str(exc)) from None
    except StoreError as exc:
        raise RolloutStoreUnavailable(
            f"the shared rollout store is unreachable ({exc}): a promotion would not reach the "
            "fleet; a rollback would (it is kept here and published when the store returns)"
        ) from None
    return _json(t.to_json())


async def rollout_rollback(request: web.Request) -> web.Response:
    """``POST /admin/rollout/{rule}/rollback`` — body optional: ``{"reason": "…"}``."""
    authorize_change(request)
    body = await _change_body(request)
    reason = body.get("reason")
    name = request.match_info["rule"]
    controller = _controller(request)
    try:
        t = await asyncio.to_thread(
            controller.rollback, name, reason=str(reason) if reason else "operator rollback"
        )
    except KeyError:
        raise RolloutNotFound(f"no rule {name!r} has a rollout") from None
    except RolloutConflict as exc:
        raise RolloutChanged(str(exc)) from None
    return _json(t.to_json())
