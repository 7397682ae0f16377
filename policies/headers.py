"""Which header names may travel from a client to a shadow leg (pure rules, no I/O).

Used twice: when a policy is validated (``headers.allow`` may not list these names) and on every
shadow request in :func:`policies.shape.shadow_headers` (defence in depth: even a policy object
built without validation cannot forward them).
"""

from __future__ import annotations

# Set by the gateway itself on every shadow request, or connection-level (hop-by-hop, framing,
# routing). Copying any of them from the client would let a client steer or break a shadow request.
GATEWAY_OWNED: frozenset[str] = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "x-request-id",
        "traceparent",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    }
)
GATEWAY_OWNED_PREFIXES: tuple[str, ...] = ("x-specshadow-",)

# Credential-bearing names: exact, and substrings that mark a custom credential header
# (x-api-key, openai-api-key, x-auth-token, x-goog-api-key, x-amz-security-token, ...).
CREDENTIAL_NAMES: frozenset[str] = frozenset(
    {"authorization", "proxy-authorization", "cookie", "cookie2", "set-cookie"}
)
CREDENTIAL_FRAGMENTS: tuple[str, ...] = (
    "api-key",
    "apikey",
    "api_key",
    "auth",
    "token",
    "secret",
    "session",
    "password",
    "credential",
    "signature",
)


def is_gateway_owned(name: str) -> bool:
    """True for a (lower-case) header name the gateway sets or that is connection-level."""
    return name in GATEWAY_OWNED or name.startswith(GATEWAY_OWNED_PREFIXES)


def is_credential(name: str) -> bool:
    """True for a (lower-case) header name that may carry a client credential."""
    return name in CREDENTIAL_NAMES or any(f in name for f in CREDENTIAL_FRAGMENTS)
