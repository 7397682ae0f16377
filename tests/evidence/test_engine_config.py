"""Engine configurations reduced and fingerprinted (:mod:`evidence.engine_config`), read by the
probe from a simulator that reports its own (:mod:`simulator.engine_info`), and declared in the
policy where no endpoint says them."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from core.exchange import CAPTURE_OFF
from evidence.engine_config import (
    FIELDS,
    SPECULATIVE,
    cache_config_info,
    diff,
    fingerprint_of,
    from_sglang,
    from_vllm,
    resolve_engine,
)
from evidence.serverinfo import InfoTarget, ServerInfoProbe
from policies.compile import parse_policy
from policies.errors import PolicyError

SGLANG = {
    "model_path": "meta-llama/Llama-3.1-8B-Instruct",
    "revision": None,
    "dtype": "auto",
    "quantization": "fp8",
    "kv_cache_dtype": "fp8_e5m2",
    "disable_radix_cache": False,
    "chunked_prefill_size": 8192,
    "max_running_requests": 256,
    "max_prefill_tokens": 16384,
    "tp_size": 2,
    "pp_size": 1,
    "dp_size": 1,
    "context_length": 8192,
    "speculative_algorithm": "EAGLE3",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "speculative_draft_model_path": "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B",
    "speculative_accept_threshold_single": 1.0,
    "speculative_accept_threshold_acc": 1.0,
    "version": "0.5.4",
    "random_seed": 42,  # not a field that changes speed or output
}


def test_sglang_server_info_reduces_to_the_fields_by_their_meaning() -> None:
    got = from_sglang(SGLANG)
    assert got is not None
    assert got["engine"] == "sglang" and got["version"] == "0.5.4"
    assert got["quantization"] == "fp8" and got["kv_cache_dtype"] == "fp8_e5m2"
    assert got["enable_prefix_caching"] is True  # radix cache on
    assert got["enable_chunked_prefill"] is True  # chunk size > 0
    assert (got["max_num_seqs"], got["tensor_parallel_size"], got["max_model_len"]) == (
        256,
        2,
        8192,
    )
    spec = got[SPECULATIVE]
    assert isinstance(spec, dict) and spec["method"] == "EAGLE3"
    assert spec["num_speculative_tokens"] == 3
    assert set(got) == set(FIELDS)
    off = from_sglang({**SGLANG, "disable_radix_cache": True, "chunked_prefill_size": -1})
    assert off is not None
    assert off["enable_prefix_caching"] is False and off["enable_chunked_prefill"] is False
    plain = from_sglang({**SGLANG, "speculative_algorithm": None})
    assert plain is not None and plain[SPECULATIVE] is None
    assert from_sglang({"version": "x"}) is None


def test_the_cache_config_info_labels_read_like_the_server_info() -> None:
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",'
        'enable_prefix_caching="False",engine="0"} 1.0\n'
    )
    assert cache_config_info(text) == {"kv_cache_dtype": "fp8", "enable_prefix_caching": False}
    assert cache_config_info("vllm:num_requests_running 0\n") == {}


def test_fingerprints_are_stable_and_only_what_matters_moves_them() -> None:
    info = {
        "vllm_config": {
            "model_config": {"model": "m", "dtype": "torch.bfloat16", "quantization": None},
            "cache_config": {"cache_dtype": "auto", "enable_prefix_caching": True},
            "scheduler_config": {"max_num_seqs": 64, "max_num_scheduled_tokens": None},
            "speculative_config": None,
            "instance_id": "1",
        }
    }
    plain = resolve_engine({"s": ("vllm_server_info", from_vllm(info) or {})})
    assert plain is not None
    # Known value, computed here: sha256 of the canonical JSON, 16 hex digits.
    import hashlib
    import json

    canonical = json.dumps(dict(plain.values), sort_keys=True, separators=(",", ":"))
    assert plain.fingerprint == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert plain.values["kv_cache_dtype"] == "bfloat16"  # auto is the model's dtype
    # Another instance, derived scheduler limits, observability: the same configuration.
    cfg = dict(info["vllm_config"])
    cfg["instance_id"] = "2"
    cfg["scheduler_config"] = {"max_num_seqs": 64, "max_num_scheduled_tokens": 2048}
    cfg["observability_config"] = {"per_request_spec_decode_metrics": "summary"}
    same = resolve_engine({"s": ("vllm_server_info", from_vllm({"vllm_config": cfg}) or {})})
    assert same is not None and same.fingerprint == plain.fingerprint
    # An fp8 KV cache is another configuration, outside the speculative block.
    cfg["cache_config"] = {"cache_dtype": "fp8", "enable_prefix_caching": True}
    fp8 = resolve_engine({"s": ("vllm_server_info", from_vllm({"vllm_config": cfg}) or {})})
    assert fp8 is not None and fp8.base_fingerprint != plain.base_fingerprint
    assert diff(plain.values, fp8.values) == ["kv_cache_dtype"]
    assert fingerprint_of({"a": 1, "b": 2}) == fingerprint_of({"b": 2, "a": 1})


def test_what_no_endpoint_says_comes_from_the_declaration_labelled_declared() -> None:
    got = resolve_engine(
        {"v": ("vllm_version", {"engine": "vllm", "version": "0.32.0"})},
        {"version": "0.31.0", "quantization": "awq"},
    )
    assert got is not None
    assert got.values["version"] == "0.32.0" and got.sources["version"] == "vllm_version"
    assert got.values["quantization"] == "awq" and got.declared == ("quantization",)
    assert resolve_engine({}, None) is None
    # Unknown is not different.
    assert diff({"version": "1"}, {"quantization": "fp8"}) == []


def test_the_policys_engine_block_is_strict_with_field_paths() -> None:
    base: dict[str, Any] = {
        "version": 1,
        "backends": {
            "prim": {"url": "http://127.0.0.1:1", "kind": "openai"},
            "cand": {"url": "http://127.0.0.1:2", "kind": "openai"},
        },
        "primary": "prim",
        "default": {"ratio": 1.0, "legs": [{"backend": "cand", "role": "candidate"}]},
    }
    base["backends"]["cand"]["engine"] = {"name": "trtllm", "version": "1.0", "quantization": "fp8"}
    policy = parse_policy(base, source="p.yaml")
    assert policy.backends["cand"].engine == {
        "engine": "trtllm",
        "version": "1.0",
        "quantization": "fp8",
    }
    base["backends"]["cand"]["engine"] = {"quantisation": "fp8"}
    with pytest.raises(PolicyError, match=r"backends\.cand\.engine\.quantisation"):
        parse_policy(base, source="p.yaml")
    base["backends"]["cand"]["engine"] = {"max_num_seqs": 0}
    with pytest.raises(PolicyError, match=r"backends\.cand\.engine\.max_num_seqs"):
        parse_policy(base, source="p.yaml")


async def test_the_probe_reads_a_simulator_and_follows_its_change_mid_run(sims: Any) -> None:
    sim = await sims(mode="speculative", engine={"quantization": "fp8"})
    probe = ServerInfoProbe(
        {
            "cand": InfoTarget(sim.base_url, "sim", engine={"revision": "abc"}),
            "api": InfoTarget("http://127.0.0.1:9", "openai", engine={"version": "2.0"}),
        }
    )
    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
        first = probe.engine("cand")
        assert first is not None
        assert first.values["quantization"] == "fp8"
        assert first.sources["quantization"] == "vllm_server_info"
        assert first.values["version"] == sim.engine.version
        assert first.sources["version"] == "vllm_version"
        assert first.sources["kv_cache_dtype"] == "vllm_server_info"
        assert first.values["revision"] is None  # the engine said: none (it wins)
        sim.engine.update(version="0.33.0", kv_cache_dtype="fp8")
        await probe.poll_once(session)
        second = probe.engine("cand")
        assert second is not None
        assert diff(first.values, second.values, speculative=True) == [
            "version",
            "kv_cache_dtype",
        ]
    declared = probe.engine("api")  # never asked: an OpenAI-compatible API says nothing
    assert declared is not None and declared.declared == ("version",)


def test_the_compare_span_carries_each_legs_fingerprints() -> None:
    import dataclasses

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from evidence.worker import backend_facts, build_evidence
    from otel import semconv as sc
    from otel.settings import TelemetrySettings
    from otel.setup import build_telemetry
    from records.writer import build_record
    from tests.evidence.legs import exchange, leg

    spans = InMemorySpanExporter()
    telemetry = build_telemetry(TelemetrySettings(), span_exporter=spans)
    request = telemetry.start_request_span(route="/v1/chat/completions", method="POST", carrier={})
    traceparent = telemetry.traceparent(request)
    telemetry.end_request_span(request, status_code=200)
    words = ["Hello", " world"]
    ex = dataclasses.replace(
        exchange(primary=leg("primary", words), shadows=[leg("candidate", words)]),
        traceparent=traceparent,
    )
    engines = {
        "primary": resolve_engine({}, {"version": "1", "quantization": None}),
        "candidate": resolve_engine({}, {"version": "1", "speculative": {"method": "ngram"}}),
    }
    facts = dataclasses.replace(
        backend_facts(),
        engine=lambda leg: engines[leg.role].to_json(),  # type: ignore[union-attr]
    )
    evidence = build_evidence(ex)
    evidence = type(evidence)(
        evidence.exchange,
        category=evidence.category,
        category_source=evidence.category_source,
        greedy=evidence.greedy,
        comparisons=evidence.comparisons,
        acceptance=evidence.acceptance,
        record=lambda e: build_record(e, capture=ex.capture or CAPTURE_OFF, facts=facts),
    )
    telemetry.record_comparisons(evidence)
    (compare,) = [s for s in spans.get_finished_spans() if s.name == "compare"]
    attributes = dict(compare.attributes or {})
    for role, engine in engines.items():
        assert engine is not None
        assert attributes[f"{sc.ENGINE_FINGERPRINT}.{role}"] == engine.fingerprint
        assert attributes[f"{sc.ENGINE_BASE_FINGERPRINT}.{role}"] == engine.base_fingerprint
    assert (
        attributes[f"{sc.ENGINE_BASE_FINGERPRINT}.primary"]
        == attributes[f"{sc.ENGINE_BASE_FINGERPRINT}.candidate"]
    )
    assert telemetry.shutdown(timeout_s=5.0)


async def test_the_probe_falls_back_to_inference_config_and_reads_sglang(servers: Any) -> None:
    """A vLLM without ``/server_info`` but with the newer ``/inference/v1/config``; an SGLang that
    moved ``/get_server_info`` to ``/server_info``: real sockets, scripted answers."""
    from aiohttp import web

    from tests.conftest import start_server

    vllm_config = {
        "model_config": {"model": "m", "dtype": "torch.float16", "quantization": "awq"},
        "cache_config": {"cache_dtype": "auto", "enable_prefix_caching": False},
        "speculative_config": None,
    }

    async def config(_: web.Request) -> web.Response:
        return web.json_response({"vllm_config": vllm_config})

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.40.0"})

    async def sglang(_: web.Request) -> web.Response:
        return web.json_response(SGLANG)

    vllm_app, sglang_app = web.Application(), web.Application()
    vllm_app.router.add_get("/inference/v1/config", config)
    vllm_app.router.add_get("/version", version)
    sglang_app.router.add_get("/server_info", sglang)
    urls = {}
    for name, app in (("vllm", vllm_app), ("sglang", sglang_app)):
        server = await start_server(app)
        servers.append(server)
        urls[name] = str(server.make_url("")).rstrip("/")
    probe = ServerInfoProbe({k: InfoTarget(u, k) for k, u in urls.items()})
    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
    v, s = probe.engine("vllm"), probe.engine("sglang")
    assert v is not None and s is not None
    assert v.sources["quantization"] == "vllm_inference_config"
    assert (v.values["quantization"], v.values["kv_cache_dtype"]) == ("awq", "float16")
    assert v.values["version"] == "0.40.0" and v.values["enable_prefix_caching"] is False
    assert s.sources["version"] == "sglang_server_info" and s.values["version"] == "0.5.4"
    assert s.values["quantization"] == "fp8" and s.values["tensor_parallel_size"] == 2


async def test_a_record_carries_the_engine_its_legs_ran_on_when_the_worker_lags(
    servers: Any,
) -> None:
    """The evidence worker builds records behind the event loop; a configuration polled after
    an exchange was submitted must not reach that exchange's record (a report splits its
    evidence at a change). Deterministic: the worker's thread is not started until after the
    backend was upgraded and polled, so the first exchange is built with the worker "lagging"."""
    from aiohttp import web

    from evidence.worker import EvidenceWorker
    from records.reader import read
    from tests.conftest import start_server
    from tests.evidence.legs import exchange, leg

    answer = {"version": "0.40.0"}

    async def version(_: web.Request) -> web.Response:
        return web.json_response(answer)

    async def config(_: web.Request) -> web.Response:
        return web.json_response({"vllm_config": {"model_config": {"model": "m"}}})

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/inference/v1/config", config)
    server = await start_server(app)
    servers.append(server)
    url = str(server.make_url("")).rstrip("/")
    probe = ServerInfoProbe({"primary": InfoTarget(url, "vllm")})
    seen: list[Any] = []
    worker = EvidenceWorker([seen.append], probe=probe)

    def one() -> Any:
        return exchange(primary=leg("primary", backend="primary"), shadows=[])

    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
        worker.submit(one())  # ran on 0.40.0; the worker thread is not running yet
        answer["version"] = "0.41.0"
        await probe.poll_once(session)
        worker.submit(one())  # ran on 0.41.0
    await worker.start()  # the worker gets to both only now
    assert await worker.flush(timeout_s=30.0)
    await worker.stop()
    versions = []
    for evidence in seen:
        primary = read(evidence.record).primary
        engine = primary.engine if primary is not None else None
        assert engine is not None and engine.settings is not None
        versions.append(engine.settings["version"])
    assert versions == ["0.40.0", "0.41.0"]
    fingerprints = [e.engines["primary"] for e in seen]
    assert fingerprints[0] != fingerprints[1]
