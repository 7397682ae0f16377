"""Names on the wire that several packages must spell the same way (headers the gateway, the
simulator, the load generator and backends all read)."""

from __future__ import annotations

REQUEST_ID_HEADER = "x-request-id"
"""The request id: kept from the client when it sent one, else minted; sent to every leg."""

CATEGORY_HEADER = "x-specshadow-category"
"""A client-declared request category (``chat``, ``code``, …); the classifier decides otherwise."""

SERVED_BY_HEADER = "x-specshadow-served-by"
"""On responses to requests a rolling-out rule decided: ``primary`` or ``candidate``, who answered."""

SHADOW_MARKER_HEADER = "x-specshadow-shadow"
"""Set on every shadow request (value: the leg's role) so backends can exclude shadow traffic."""
