"""Shadow shaping: body fields per backend kind, input untouched; headers never leak credentials."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from multidict import CIMultiDict

from policies import CompiledPolicy, LegPlan, parse_policy, shadow_headers, shape_shadow_body

CANARY = "sk-canary-7f3a9c1e"


def policy(**fields: Any) -> CompiledPolicy:
    backends = {
        "v": {"url": "http://127.0.0.1:9001", "kind": "vllm", "api_key_env": "SPEC_TEST_KEY"},
        "s": {"url": "http://127.0.0.1:9003", "kind": "sim"},
        "o": {"url": "http://127.0.0.1:9002", "kind": "openai"},
    }
    return parse_policy({"version": 1, "backends": backends, **fields}, source="t")


def leg(
    p: CompiledPolicy, backend: str, model: str | None = None, role: Any = "candidate"
) -> LegPlan:
    return LegPlan(role, p.backends[backend], model)


CHAT: dict[str, Any] = {
    "model": "llama",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": False,
    "stream_options": {"include_usage": False, "custom": 1},
    "temperature": 0.7,
    "seed": 42,
}


def test_vllm_leg_gets_model_rewrite_stream_usage_and_metrics() -> None:
    p = policy()
    body = json.loads(shape_shadow_body(CHAT, leg(p, "v", "llama-spec"), p.shaping))
    assert body["model"] == "llama-spec"
    assert body["stream"] is True
    assert body["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
        "custom": 1,
    }
    assert body["include_metrics"] is True
    assert body["messages"] == CHAT["messages"]
    assert (body["temperature"], body["seed"]) == (0.7, 42)


def test_sim_leg_gets_the_vllm_fields_too() -> None:
    p = policy()
    body = json.loads(shape_shadow_body(CHAT, leg(p, "s"), p.shaping))
    assert body["include_metrics"] is True and body["stream_options"]["continuous_usage_stats"]


def test_openai_leg_gets_only_standard_fields() -> None:
    p = policy()
    body = json.loads(shape_shadow_body(CHAT, leg(p, "o"), p.shaping))
    assert "include_metrics" not in body
    assert body["stream_options"] == {"include_usage": True, "custom": 1}
    assert body["model"] == "llama"


def test_shaping_never_mutates_the_client_body() -> None:
    p = policy(shaping={"override_seed": 7, "override_temperature": 0})
    original = copy.deepcopy(CHAT)
    for name in ("v", "s", "o"):
        shape_shadow_body(CHAT, leg(p, name, "other"), p.shaping)
    assert original == CHAT


def test_body_without_stream_options_gets_them() -> None:
    p = policy()
    body = json.loads(shape_shadow_body({"model": "m", "prompt": "x"}, leg(p, "o"), p.shaping))
    assert body == {
        "model": "m",
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_shaping_can_be_turned_off() -> None:
    p = policy(shaping={"force_stream": False, "include_metrics": False})
    body = json.loads(shape_shadow_body(CHAT, leg(p, "v"), p.shaping))
    assert body == CHAT


def test_seed_and_temperature_overrides() -> None:
    p = policy(shaping={"override_seed": 7, "override_temperature": 0})
    body = json.loads(shape_shadow_body(CHAT, leg(p, "v"), p.shaping))
    assert (body["seed"], body["temperature"]) == (7, 0)


def client_headers() -> CIMultiDict[str]:
    return CIMultiDict(
        {
            "Authorization": f"Bearer {CANARY}",
            "Cookie": f"session={CANARY}",
            "X-Api-Key": CANARY,
            "Api-Key": CANARY,
            "Proxy-Authorization": CANARY,
            "Host": "evil.example",
            "X-Tenant": "acme",
            "X-User-Id": "u1",
            "Content-Type": "text/plain",
            "X-Request-Id": "client-chosen",
            "X-Specshadow-Shadow": "spoofed",
            "Content-Length": "999",
        }
    )


@pytest.mark.parametrize("allow", [[], ["x-tenant"], ["x-tenant", "x-user-id"]])
def test_client_credentials_never_reach_a_shadow(
    allow: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPEC_TEST_KEY", raising=False)
    p = policy(headers={"allow": allow})
    for name in ("v", "o"):
        out = shadow_headers(
            client_headers(), leg(p, name), p, request_id="rid-1", traceparent=None
        )
        assert CANARY not in repr(out)
        assert set(out) == {*allow, "content-type", "x-request-id", "x-specshadow-shadow"}


def test_shadow_gets_its_own_key_marker_and_gateway_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPEC_TEST_KEY", "shadow-own-key")
    p = policy(headers={"allow": ["X-Tenant"]})
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = shadow_headers(
        client_headers(), leg(p, "v", role="baseline"), p, request_id="rid-9", traceparent=tp
    )
    assert out == {
        "x-tenant": "acme",
        "authorization": "Bearer shadow-own-key",
        "content-type": "application/json",
        "x-request-id": "rid-9",
        "traceparent": tp,
        "x-specshadow-shadow": "baseline",
    }


def test_allowed_credentials_are_forwarded_only_when_explicitly_permitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPEC_TEST_KEY", "shadow-own-key")
    p = policy(
        headers={"allow": ["authorization", "x-api-key"], "allow_credentials_to_shadows": True}
    )
    to_openai = shadow_headers(client_headers(), leg(p, "o"), p, request_id="r", traceparent=None)
    assert to_openai["authorization"] == f"Bearer {CANARY}" and to_openai["x-api-key"] == CANARY
    # A backend with its own key always sends it, never the client's.
    to_vllm = shadow_headers(client_headers(), leg(p, "v"), p, request_id="r", traceparent=None)
    assert to_vllm["authorization"] == "Bearer shadow-own-key"


def test_unvalidated_policy_still_cannot_forward_gateway_owned_or_credential_headers() -> None:
    import dataclasses

    p = dataclasses.replace(
        policy(), header_allow=frozenset({"host", "authorization", "x-specshadow-shadow"})
    )
    out = shadow_headers(client_headers(), leg(p, "o"), p, request_id="r", traceparent=None)
    assert "host" not in out and "authorization" not in out
    assert out["x-specshadow-shadow"] == "candidate"
