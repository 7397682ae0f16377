"""The engine probe against real vLLM 0.32 (CPU build): ``/server_info`` read field by field, the
version from ``/version``, the KV-cache settings from ``vllm:cache_config_info`` — and the plain
server against the n-gram and draft-model servers is *not* a confound (they differ in the
speculative block, in what vLLM derives from it, in instance ids and observability flags only).

Ground truth: each server's own JSON and exposition, read here independently of the probe."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from evidence.engine_config import FIELDS, SPECULATIVE, diff
from evidence.serverinfo import InfoTarget, ServerInfoProbe
from records.reader import read
from report.confounds import confound

pytestmark = pytest.mark.vllm


async def _raw(session: aiohttp.ClientSession, url: str) -> tuple[dict[str, Any], str, str]:
    async with session.get(f"{url}/server_info?config_format=json") as r:
        info = await r.json()
    async with session.get(f"{url}/version") as r:
        version = (await r.json())["version"]
    async with session.get(f"{url}/metrics") as r:
        metrics = await r.text()
    return info, version, metrics


def _labels(metrics: str) -> dict[str, str]:
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:cache_config_info{"))
    body = line.split("{", 1)[1].split("}", 1)[0]
    return dict(pair.split("=", 1) for pair in body.replace('"', "").split(","))


async def test_the_probe_reads_real_vllm_field_by_field_and_speculation_is_no_confound(
    vllm_servers: dict[str, Any],
) -> None:
    urls = {name: f"http://127.0.0.1:{s.port}" for name, s in vllm_servers.items()}
    names = [n for n in ("plain", "ngram", "draft") if n in urls]
    probe = ServerInfoProbe({n: InfoTarget(urls[n], "vllm") for n in names})
    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
        raw = {n: await _raw(session, urls[n]) for n in names}
    engines = {n: probe.engine(n) for n in names}
    for n in names:
        engine, (info, version, metrics) = engines[n], raw[n]
        assert engine is not None, probe.status(n)
        v, src = engine.values, engine.sources
        cfg = info["vllm_config"]
        model, cache, sched, par = (
            cfg["model_config"],
            cfg["cache_config"],
            cfg["scheduler_config"],
            cfg["parallel_config"],
        )
        assert "version" not in info["vllm_config"]  # 0.32's /server_info has none …
        assert (v["version"], src["version"]) == (version, "vllm_version")  # … /version has
        assert v["engine"] == "vllm"
        assert v["model"] == model["model"] and v["revision"] == model["revision"]
        assert v["dtype"] == model["dtype"].removeprefix("torch.")
        assert v["quantization"] == model["quantization"]
        assert v["max_model_len"] == model["max_model_len"]
        # "auto" is the model's dtype (vLLM's meaning); the exposition says the same
        want_kv = cache["cache_dtype"] if cache["cache_dtype"] != "auto" else v["dtype"]
        assert v["kv_cache_dtype"] == want_kv
        labels = _labels(metrics)
        assert labels["cache_dtype"] == cache["cache_dtype"]
        assert v["enable_prefix_caching"] is cache["enable_prefix_caching"]
        assert labels["enable_prefix_caching"] == str(cache["enable_prefix_caching"])
        assert v["enable_chunked_prefill"] is sched["enable_chunked_prefill"]
        assert v["max_num_seqs"] == sched["max_num_seqs"]
        assert v["max_num_batched_tokens"] == sched["max_num_batched_tokens"]
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            assert v[k] == par[k]
        spec = cfg["speculative_config"]
        if spec is None:
            assert v[SPECULATIVE] is None
        else:
            got = v[SPECULATIVE]
            assert isinstance(got, dict)
            assert got["method"] == spec["method"]
            assert got["num_speculative_tokens"] == spec["num_speculative_tokens"]
            assert got["model"] == spec["model"]
        assert set(engine.values) == set(FIELDS)
    plain = engines["plain"]
    assert plain is not None
    for n in names[1:]:
        other, (info, _, _) = engines[n], raw[n]
        assert other is not None
        # The servers' raw configurations do differ outside the speculative block …
        cfg, base = info["vllm_config"], raw["plain"][0]["vllm_config"]
        assert cfg["instance_id"] != base["instance_id"]
        assert cfg["observability_config"] != base["observability_config"]
        assert (
            cfg["scheduler_config"]["max_num_scheduled_tokens"]
            != (base["scheduler_config"]["max_num_scheduled_tokens"])
        )
        # … but not in anything that changes speed or output but speculation.
        assert diff(plain.values, other.values) == []
        assert diff(plain.values, other.values, speculative=True) == [SPECULATIVE]
        assert other.base_fingerprint == plain.base_fingerprint
        assert other.fingerprint != plain.fingerprint
        # The report's gate reads the same from records carrying them.
        record = read(
            {
                "started_unix_ns": 1,
                "legs": [
                    {"role": "primary", "backend": "plain", "engine": plain.to_json()},
                    {"role": "candidate", "backend": n, "engine": other.to_json()},
                ],
            }
        )
        gate = confound([record], n)
        assert gate is not None and gate.fields == () and not gate.confounded
