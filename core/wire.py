"""Names and values on the wire that several packages must agree on (headers the gateway, the
simulator, the load generator and backends all read; the keep-alive every backend session uses)."""

from __future__ import annotations

import re

REQUEST_ID_HEADER = "x-request-id"
"""The request id: kept from the client when it sent one, else minted; sent to every leg."""

BACKEND_KEEPALIVE_S = 4.0
"""How long an idle connection to a backend is kept (the default of ``--keepalive``): below the
5 s that vLLM's and SGLang's servers (uvicorn) keep one, since a request sent on a connection the
server is closing that instant fails."""

CATEGORY_HEADER = "x-specshadow-category"
"""A client-declared request category (``chat``, ``code``, …); the classifier decides otherwise."""

SERVED_BY_HEADER = "x-specshadow-served-by"
"""On responses to requests a rolling-out rule decided: ``primary`` or ``candidate``, who answered."""

SHADOW_MARKER_HEADER = "x-specshadow-shadow"
"""Set on every shadow request (value: the leg's role) so backends can exclude shadow traffic."""

WORKFLOW_HEADER = "x-specshadow-workflow"
"""The application's name for the kind of run a request belongs to (``triage-agent``, ``rag``):
the report groups runs into workflow types by it (the policy's ``workflows.type_header`` may name
another header)."""

TRACEPARENT_HEADER = "traceparent"
"""The W3C trace context header: the calls of one application run share its trace id."""


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32-hex trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``); None
    for an absent or malformed value and for the all-zero (invalid) id."""
    m = _TRACEPARENT.match(traceparent.strip()) if traceparent else None
    if m is None or m.group(1).lower() == "ff":
        return None
    tid = m.group(2).lower()
    return None if tid == "0" * 32 else tid


_TRACEPARENT = re.compile(r"([0-9a-fA-F]{2})-([0-9a-fA-F]{32})-[0-9a-fA-F]{16}-[0-9a-fA-F]{2}")
