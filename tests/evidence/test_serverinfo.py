"""What a backend says it runs: vLLM's and SGLang's server info, merged with the policy's
declaration into each leg's ``speculative`` record — and a lossy mode never called lossless."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from core.exchange import SpeculativeSpec
from evidence.serverinfo import (
    InfoTarget,
    ReportedSpec,
    ServerInfoProbe,
    from_sglang,
    from_vllm,
    mismatches,
    resolve,
)
from records.sqlite_store import query_records
from tests.gateway.test_shadow import CHAT, raw_stream

DATA = Path(__file__).parent.parent / "data" / "server_info"


def vllm_info(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA / f"vllm-0.32-{name}.json").read_text())
    return loaded


def test_real_vllm_server_info_for_each_configuration() -> None:
    ngram = from_vllm(vllm_info("ngram"))
    assert ngram == ReportedSpec(
        "vllm_server_info",
        speculative=True,
        method="ngram",
        num_speculative_tokens=4,
        verification="lossless",
        verification_detail="rejection_sample_method=standard",
        prompt_lookup_min=2,
        prompt_lookup_max=4,
        adaptive_verification=False,
        draft_sample_method="greedy",
        cross_vocabulary=False,
    )
    draft = from_vllm(vllm_info("draft"))
    assert draft is not None and (draft.method, draft.num_speculative_tokens) == ("draft_model", 4)
    assert from_vllm(vllm_info("plain")) == ReportedSpec("vllm_server_info", speculative=False)


def test_lossy_vllm_modes_and_the_batch_size_schedule() -> None:
    info = vllm_info("ngram")
    spec = info["vllm_config"]["speculative_config"]
    synthetic = {**spec, "rejection_sample_method": "synthetic"}
    reported = from_vllm({"vllm_config": {"speculative_config": synthetic}})
    assert reported is not None and reported.verification == "lossy"
    assert reported.verification_detail == "rejection_sample_method=synthetic"
    block = from_vllm(
        {"vllm_config": {"speculative_config": {**spec, "rejection_sample_method": "block"}}}
    )
    assert block is not None and block.verification == "lossless"
    v0 = {
        "method": "eagle",
        "num_speculative_tokens": 3,
        "acceptance_method": "typical_acceptance_sampler",
    }
    old = from_vllm({"vllm_config": {"speculative_config": v0}})
    assert old is not None and old.verification == "lossy"
    scheduled = {**spec, "num_speculative_tokens_per_batch_size": [[1, 64, 4], [65, 512, 0]]}
    dynamic = from_vllm({"vllm_config": {"speculative_config": scheduled}})
    assert dynamic is not None and dynamic.schedule == ((1, 64, 4), (65, 512, 0))
    assert from_vllm({"no": "config"}) is None  # not vLLM's shape


def with_spec(name: str, **changes: Any) -> dict[str, Any]:
    """A captured vLLM 0.32 /server_info with its speculative block changed (vLLM 0.32.0 serves
    neither ``fly`` nor adaptive verification outside ``dspark``: the rest is the real shape)."""
    info = vllm_info(name)
    spec = info["vllm_config"]["speculative_config"]
    info["vllm_config"]["speculative_config"] = {**spec, **changes}
    return info


def test_fly_is_lossy_and_an_unknown_method_is_never_lossless() -> None:
    fly = from_vllm(with_spec("ngram", rejection_sample_method="fly"))
    assert fly is not None and fly.verification == "lossy"
    assert fly.verification_detail == "rejection_sample_method=fly"
    merged = resolve(SpeculativeSpec("ngram", 4, verification="lossless"), fly)
    assert merged is not None and (merged["verification"], merged["verification_source"]) == (
        "lossy",
        "vllm_server_info",
    )
    novel = from_vllm(with_spec("draft", rejection_sample_method="speculative_magic"))
    assert novel is not None and novel.verification == "unknown"
    assert novel.verification_detail is not None
    assert novel.verification_detail.startswith("rejection_sample_method=speculative_magic")
    # The policy's "lossless" does not make an unknown mode lossless; its "lossy" wins.
    said = resolve(SpeculativeSpec(verification="lossless"), novel)
    assert said is not None and said["verification"] == "unknown"
    assert "speculative_magic" in said["verification_detail"]
    lossy = resolve(SpeculativeSpec(verification="lossy"), novel)
    assert lossy is not None and lossy["verification"] == "lossy"
    v0 = from_vllm({"vllm_config": {"speculative_config": {"acceptance_method": "odd_sampler"}}})
    assert v0 is not None and v0.verification == "unknown"


def test_adaptive_verification_sampling_and_cross_vocabulary_are_recorded() -> None:
    plain_draft = resolve(None, from_vllm(vllm_info("draft")))
    assert plain_draft is not None
    assert (
        plain_draft["adaptive_verification"],
        plain_draft["draft_sample_method"],
        plain_draft["cross_vocabulary"],
    ) == (False, "greedy", False)
    adaptive = from_vllm(
        with_spec("draft", enable_adaptive_verification=True, draft_sample_method="probabilistic")
    )
    merged = resolve(None, adaptive)
    assert merged is not None
    assert (merged["adaptive_verification"], merged["draft_sample_method"]) == (
        True,
        "probabilistic",
    )
    assert merged["verification"] == "lossless"  # adaptive budgets keep verification exact
    hetero = resolve(None, from_vllm(with_spec("draft", use_heterogeneous_vocab=True)))
    assert hetero is not None and hetero["cross_vocabulary"] is True
    # The policy declares it for an engine that does not say (or a silent backend).
    declared = resolve(SpeculativeSpec("draft_model", 3, cross_vocabulary=True), None)
    assert declared is not None and declared["cross_vocabulary"] is True
    assert declared["declared"]["cross_vocabulary"] is True
    over = resolve(
        SpeculativeSpec("draft_model", 4, cross_vocabulary=True), from_vllm(vllm_info("draft"))
    )
    assert over is not None and over["cross_vocabulary"] is True
    assert resolve(SpeculativeSpec("ngram", 4), None)["cross_vocabulary"] is None  # type: ignore[index]


def test_sglang_server_info_thresholds() -> None:
    base = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}
    strict = from_sglang(
        {
            **base,
            "speculative_accept_threshold_single": 1.0,
            "speculative_accept_threshold_acc": 1.0,
        }
    )
    assert strict is not None and (strict.method, strict.num_speculative_tokens) == ("eagle3", 3)
    assert strict.verification == "lossless"
    relaxed = from_sglang(
        {
            **base,
            "speculative_accept_threshold_single": 0.7,
            "speculative_accept_threshold_acc": 1.0,
        }
    )
    assert relaxed is not None and relaxed.verification == "lossy"
    assert relaxed.verification_detail == "speculative_accept_threshold_single=0.7"
    off = from_sglang({"speculative_algorithm": None})
    assert off == ReportedSpec("sglang_server_info", speculative=False)
    unknown = from_sglang(base)  # an older build without the threshold keys
    assert unknown is not None and unknown.verification is None


def test_resolution_prefers_the_backend_and_lossy_from_anyone() -> None:
    declared = SpeculativeSpec("n-gram", 3, "n-gram k=3", "lossless")
    lossy = ReportedSpec(
        "vllm_server_info", True, "ngram", 4, "lossy", "rejection_sample_method=synthetic"
    )
    merged = resolve(declared, lossy)
    assert merged is not None
    assert (merged["method"], merged["num_speculative_tokens"], merged["label"]) == (
        "ngram",
        4,
        "n-gram k=3",
    )
    assert (merged["verification"], merged["verification_source"]) == ("lossy", "vllm_server_info")
    assert merged["mismatches"] == [
        "num_speculative_tokens: the policy says 3, the backend 4",
        "verification: the policy says lossless, the backend reports lossy "
        "(rejection_sample_method=synthetic)",
    ]  # "n-gram" and "ngram" are one method
    # Declared lossy, backend silent about verification: still lossy.
    silent = ReportedSpec("vllm_server_info", True, "ngram", 4)
    said = resolve(SpeculativeSpec(verification="lossy"), silent)
    assert said is not None and (said["verification"], said["verification_source"]) == (
        "lossy",
        "policy",
    )
    # Nothing known: no block; a plain backend: depth 0; policy only: the declaration.
    assert resolve(None, None) is None
    plain = resolve(None, ReportedSpec("vllm_server_info", speculative=False))
    assert plain is not None and plain["num_speculative_tokens"] == 0 and plain["method"] is None
    only = resolve(SpeculativeSpec("eagle3", 5), None)
    assert only is not None and (
        only["method"],
        only["num_speculative_tokens"],
        only["verification"],
    ) == ("eagle3", 5, None)
    assert mismatches(SpeculativeSpec("ngram", 4), ReportedSpec("sglang_server_info", False)) == [
        "the policy declares speculative decoding; the backend reports none"
    ]  # fmt: skip


async def serve(routes: dict[str, Any]) -> TestServer:
    app = web.Application()
    for path, body in routes.items():

        async def handle(request: web.Request, body: Any = body) -> web.StreamResponse:
            if isinstance(body, int):
                return web.Response(status=body)
            return web.json_response(body)

        app.router.add_get(path, handle)
    server = TestServer(app)
    await server.start_server()
    return server


def url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_the_probe_asks_each_kind_and_warns_once_per_disagreement(caplog):
    sglang_info = {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 5,
        "speculative_accept_threshold_single": 0.5,
        "speculative_accept_threshold_acc": 1.0,
    }
    sglang = await serve({"/get_server_info": sglang_info})
    vllm_dev = await serve({"/server_info": vllm_info("ngram")})
    vllm_prod = await serve({"/server_info": 404})  # no VLLM_SERVER_DEV_MODE
    probe = ServerInfoProbe(
        {
            "sg": InfoTarget(
                url(sglang), "sglang", SpeculativeSpec("eagle", 5, verification="lossless")
            ),
            "dev": InfoTarget(url(vllm_dev), "vllm"),
            "prod": InfoTarget(url(vllm_prod), "vllm", SpeculativeSpec("ngram", 4)),
            "gone": InfoTarget("http://127.0.0.1:9", "vllm"),
            "api": InfoTarget("http://127.0.0.1:9", "openai"),  # nothing to ask
        }
    )
    assert probe.names == ("sg", "dev", "prod", "gone")
    with caplog.at_level(logging.WARNING, logger="evidence.serverinfo"):
        async with aiohttp.ClientSession() as session:
            await probe.poll_once(session)
            await probe.poll_once(session)
    sg = probe.reported("sg")
    assert sg is not None and sg.verification == "lossy"
    dev = probe.reported("dev")
    assert dev is not None and dev.method == "ngram"
    assert [probe.status(n) for n in probe.names] == [
        "reported",
        "reported",
        "not_served",
        "unreachable",
    ]
    assert probe.reported("prod") is None
    # only the probe's own: an exporter an earlier test left retrying logs on its own thread
    warnings = [r.getMessage() for r in caplog.records if r.name == "evidence.serverinfo"]
    assert warnings == [
        "backend sg: verification: the policy says lossless, the backend reports lossy "
        "(speculative_accept_threshold_single=0.5)"
    ]  # once, though asked twice
    for server in (sglang, vllm_dev, vllm_prod):
        await server.close()


async def test_records_carry_each_legs_speculation_from_policy_and_backend(
    sims, gateway, write_policy, tmp_path
):
    primary = await sims()
    candidate = await sims(
        mode="speculative",
        num_speculative_tokens=3,
        rejection_sample_method="synthetic",
        divergence_at=2,
    )
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  cand: {{url: '{candidate.base_url}', kind: sim, speculative: "
        "{method: ngram, num_speculative_tokens: 3, label: 'n-gram k=3', verification: lossless}}\n"
        "primary: prim\ndefault: {ratio: 1.0, legs: [{backend: cand, role: candidate}]}\n"
    )
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy), store_path=str(store))
    await asyncio.sleep(0.3)  # the probe asks at start: a loopback round trip of milliseconds
    for i in range(3):
        status, _ = await raw_stream(gw.url, {**CHAT, "temperature": 0}, {"x-request-id": f"s{i}"})
        assert status == 200
        await gw.sink.wait_for(lambda e, i=i: e.request_id == f"s{i}")
    await gw.server.close()
    records = list(query_records(store))
    assert len(records) == 3
    primary_leg, candidate_leg = records[-1]["legs"]
    assert primary_leg["speculative"]["num_speculative_tokens"] == 0  # a plain server says so
    spec = candidate_leg["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["label"]) == (
        "ngram",
        3,
        "n-gram k=3",
    )
    assert (spec["verification"], spec["verification_source"]) == ("lossy", "vllm_server_info")
    assert spec["declared"]["verification"] == "lossless"
    assert spec["mismatches"] == [
        "verification: the policy says lossless, the backend reports lossy "
        "(rejection_sample_method=synthetic)"
    ]
    assert records[-1]["comparisons"][0]["exact_match"] is False  # and it shows


@pytest.mark.parametrize("kind", ["openai"])
async def test_a_backend_that_cannot_say_keeps_the_policys_word(
    kind, sims, gateway, write_policy, tmp_path
):
    primary = await sims()
    candidate = await sims(mode="speculative")
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  cand: {{url: '{candidate.base_url}', kind: {kind}, speculative: {{method: eagle3, num_speculative_tokens: 2}}}}\n"
        "primary: prim\ndefault: {ratio: 1.0, legs: [{backend: cand, role: candidate}]}\n"
    )
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy), store_path=str(store))
    await raw_stream(gw.url, CHAT, {"x-request-id": "o1"})
    await gw.sink.wait_for()
    await gw.server.close()
    (record,) = query_records(store)
    spec = record["legs"][1]["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["reported"]) == ("eagle3", 2, None)
    assert spec["verification"] is None  # unknown: never assumed lossless
