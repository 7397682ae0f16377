"""Shadow request shaping: the body and headers one shadow leg is sent (pure).

The primary's request is never touched: both functions build new objects from the client's and
never mutate their inputs. What a leg gets:

- body: the client's JSON with the leg's model rewrite, streaming forced with usage reporting
  (so every leg is timed the same way), vLLM's ``include_metrics`` for ``vllm``/``sim`` backends,
  vLLM's ``return_token_ids`` for them while the policy scores counterfactuals (``logprobs``
  with one top entry for ``llamacpp`` chat legs: llama.cpp sends ids only there), and the policy's
  seed/temperature overrides. Responses API bodies get ``stream: true`` (usage
  comes in ``response.completed``; no ``stream_options``) and always ``store: false``: a shadow
  never persists a conversation upstream. (Requests continuing one with ``previous_response_id``
  are not mirrored at all — see :class:`~policies.compiled.RequestFacts`.);
- headers: only allow-listed client headers, never the client's credentials; the backend's own
  key; and the gateway's own ``content-type``, ``x-request-id``, ``traceparent`` and the
  ``x-specshadow-shadow: <role>`` marker so backends can exclude shadow traffic from billing/logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core import jsonx
from core.exchange import Route
from core.wire import SHADOW_MARKER_HEADER
from policies.compiled import CompiledPolicy, LegPlan, Shaping
from policies.headers import is_credential, is_gateway_owned

# Backends that accept vLLM's extra request fields; strict OpenAI-compatible servers reject them.
_VLLM_LIKE = frozenset({"vllm", "sim"})


def shape_shadow_body(
    body: Mapping[str, Any], leg: LegPlan, shaping: Shaping, *, route: Route = "chat"
) -> bytes:
    """The JSON bytes to send to ``leg``; ``body`` (the client's parsed JSON) is not modified."""
    out = dict(body)
    if leg.model is not None:
        out["model"] = leg.model
    vllm_like = leg.backend.kind in _VLLM_LIKE
    if route == "responses":
        # Usage arrives in response.completed whether or not it streams; no stream_options needed.
        # A shadow never persists a conversation upstream (OpenAI's default is store: true).
        if shaping.force_stream:
            out["stream"] = True
        out["store"] = False
    elif shaping.force_stream:
        out["stream"] = True
        previous = body.get("stream_options")
        options = dict(previous) if isinstance(previous, Mapping) else {}
        options["include_usage"] = True
        if vllm_like:
            options["continuous_usage_stats"] = True
        out["stream_options"] = options
    if shaping.include_metrics and vllm_like:
        out["include_metrics"] = True
    if shaping.token_ids and vllm_like and route != "responses":
        out["return_token_ids"] = True
    llamacpp_ids = shaping.token_ids and leg.backend.kind == "llamacpp" and route == "chat"
    if llamacpp_ids and not out.get("logprobs"):
        # llama.cpp sends generated ids only inside logprobs (``content[].id``).
        out["logprobs"] = True
        out["top_logprobs"] = 1
    if shaping.override_seed is not None:
        out["seed"] = shaping.override_seed
    if shaping.override_temperature is not None:
        out["temperature"] = shaping.override_temperature
    return jsonx.dumps(out)


def shadow_headers(
    client_headers: Mapping[str, str],
    leg: LegPlan,
    policy: CompiledPolicy,
    *,
    request_id: str,
    traceparent: str | None,
) -> dict[str, str]:
    """Headers for one shadow request: allow-list ∪ own credentials ∪ the gateway's own headers.

    Client header names may be in any case (aiohttp's CIMultiDict or a plain dict). A credential
    header is copied only when the policy both lists it and sets ``allow_credentials_to_shadows``;
    even then the backend's own key (``api_key_env``) replaces a client Authorization.
    """
    allow = policy.header_allow
    out: dict[str, str] = {}
    if allow:
        for name, value in client_headers.items():
            lower = name.lower()
            if lower not in allow or is_gateway_owned(lower):
                continue  # checked again here: a policy object may not have been validated
            if is_credential(lower) and not policy.allow_credentials:
                continue
            out[lower] = value
    auth = leg.backend.auth_header()
    if auth is not None:
        out[auth[0]] = auth[1]
    out["content-type"] = "application/json"
    out["x-request-id"] = request_id
    if traceparent is not None:
        out["traceparent"] = traceparent
    out[SHADOW_MARKER_HEADER] = leg.role
    return out
