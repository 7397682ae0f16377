"""Backend kind detection (``evidence.detect``) against real sockets: the simulator, servers that
answer vLLM's and SGLang's identifying routes the way those servers do, a plain OpenAI-compatible
server, the scripted fake, a closed port and a silent one — and what the kind changes in the
policy of a policy-free start (``/metrics`` scraped, server info asked)."""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from evidence.detect import detect_kinds
from evidence.serverinfo import InfoTarget, ServerInfoProbe
from policies.compile import policy_from_flags
from policies.errors import PolicyError
from specshadow.app import info_targets, scrape_targets
from tests.conftest import start_server
from tests.fakes.upstream import Script


def app_serving(routes: dict[str, tuple[int, Any]]) -> web.Application:
    """Answers ``routes`` (path → status, JSON) and 404 elsewhere, like a real server."""
    app = web.Application()

    async def handle(request: web.Request) -> web.Response:
        found = routes.get(request.path)
        if found is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        status, body = found
        return web.json_response(body, status=status)

    app.router.add_route("GET", "/{tail:.*}", handle)
    return app


MODELS_VLLM = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}
VLLM = {"/version": (200, {"version": "0.11.0"}), "/v1/models": (200, MODELS_VLLM)}
VLLM_DEV = {
    **VLLM,
    "/server_info": (200, {"vllm_config": {"speculative_config": {"method": "ngram"}}}),
}
VLLM_API_KEY = {"/version": (200, {"version": "0.11.0"}), "/v1/models": (401, {"error": "key"})}
SGLANG_ARGS = {"model_path": "m", "tp_size": 1, "speculative_algorithm": "EAGLE"}
SGLANG = {
    "/get_model_info": (200, {"model_path": "m", "tokenizer_path": "m", "is_generation": True}),
    "/get_server_info": (200, SGLANG_ARGS),
    "/v1/models": (200, {"data": [{"id": "m", "owned_by": "sglang"}]}),
}
SGLANG_NEW = {"/server_info": (200, SGLANG_ARGS)}
OPENAI = {"/v1/models": (200, {"data": [{"id": "gpt", "owned_by": "system"}]})}


@pytest.mark.parametrize(
    ("routes", "kind", "evidence"),
    [
        (VLLM, "vllm", "/v1/models: owned_by vllm"),
        (VLLM_DEV, "vllm", "/server_info has a vllm_config"),
        (VLLM_API_KEY, "vllm", "/version answers like vLLM's"),
        (SGLANG, "sglang", "serves SGLang's /get_model_info"),
        (SGLANG_NEW, "sglang", "/server_info has SGLang's server arguments"),
        (OPENAI, "openai", "no vLLM, SGLang, llama.cpp or simulator route answered like one"),
    ],
)
async def test_servers_are_told_apart_by_what_they_serve(servers, routes, kind, evidence):
    server = await start_server(app_serving(routes))
    servers.append(server)
    url = str(server.make_url("")).rstrip("/")
    found = await detect_kinds({"b": url})
    assert found["b"].kind == kind and found["b"].reachable
    assert found["b"].evidence == evidence


async def test_the_simulator_is_sim_and_the_scripted_fake_is_openai(sims, fake_upstream):
    sim = await sims(mode="speculative")
    _fake, fake_url = await fake_upstream(Script())  # 200 to every path, never JSON
    found = await detect_kinds({"sim": sim.base_url, "fake": fake_url})
    assert found["sim"].kind == "sim" and found["sim"].evidence.startswith("serves the simul")
    assert found["fake"].kind == "openai" and found["fake"].reachable


async def test_a_closed_or_silent_backend_is_openai_unreachable_within_the_timeout(fake_upstream):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    _fake, silent = await fake_upstream(Script(hang_before_headers=True))
    # A closed port refuses at once; its timeout only turns a hang into a failure. (Asked with
    # the silent one's 0.5 s, a run under two busy loops read "no answer in time" for it too.)
    found = await detect_kinds({"closed": closed}, timeout_s=30.0)
    assert found["closed"].kind == "openai" and not found["closed"].reachable
    assert "ClientConnectorError" in (found["closed"].error or "")
    found = await detect_kinds({"silent": silent}, timeout_s=0.5)  # never answers: any bound
    assert found["silent"].kind == "openai" and not found["silent"].reachable
    assert found["silent"].error == "no answer in time"  # the timeout ended it, not an answer


def test_the_kind_decides_metrics_and_server_info_in_a_policy_free_start():
    policy = policy_from_flags(
        primary_url="http://p:8000",
        shadow_urls=["http://a:8000", "http://b:8000"],
        baseline_url="http://c:8000",
        ratio=0.25,
        primary_kind="vllm",
        shadow_kinds=["sglang", "openai"],
        baseline_kind="sim",
    )
    kinds = {name: b.kind for name, b in policy.backends.items()}
    assert kinds == {"primary": "vllm", "shadow-1": "sglang", "shadow-2": "openai",
                     "baseline": "sim"}  # fmt: skip
    assert policy.primary is not None and policy.primary.name == "primary"
    assert set(scrape_targets(policy)) == {"primary", "shadow-1", "baseline"}
    assert set(info_targets(policy)) == {"primary", "shadow-1", "baseline"}
    # Unstated: openai, as before (no /metrics, no server info).
    plain = policy_from_flags(
        primary_url="http://p:8000", shadow_urls=["http://a:8000"], baseline_url=None, ratio=1.0
    )
    assert {b.kind for b in plain.backends.values()} == {"openai"}
    assert scrape_targets(plain) == {} and info_targets(plain) == {}
    one_for_all = policy_from_flags(
        primary_url="http://p:8000",
        shadow_urls=["http://a:8000", "http://b:8000"],
        baseline_url=None,
        ratio=1.0,
        shadow_kinds=["vllm"],
    )
    assert one_for_all.backends["shadow-2"].kind == "vllm"
    with pytest.raises(PolicyError, match="--shadow-kind"):
        policy_from_flags(
            primary_url="http://p:8000",
            shadow_urls=["http://a:8000", "http://b:8000", "http://c:8000"],
            baseline_url=None,
            ratio=1.0,
            shadow_kinds=["vllm", "sim"],
        )


async def test_the_probe_asks_a_newer_sglang_at_server_info(servers):
    """SGLang renamed ``/get_server_info`` to ``/server_info``: a backend detected as ``sglang``
    by its new path is also asked there for what it runs."""
    server = await start_server(app_serving(SGLANG_NEW))
    servers.append(server)
    base = str(server.make_url("")).rstrip("/")
    assert (await detect_kinds({"b": base}))["b"].kind == "sglang"
    probe = ServerInfoProbe({"b": InfoTarget(base, "sglang")})
    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
    reported = probe.reported("b")
    assert probe.status("b") == "reported" and reported is not None
    assert reported.method == "eagle" and reported.source == "sglang_server_info"
