"""The confound gate through the real gateway (issue 30): simulators that report their engine
configuration (:mod:`simulator.engine_info`), the gateway's probe, its record store, the report.

Ground truth is the simulators' own settings: a candidate that adds n-gram speculation *and* an fp8
quantization is ``confounded`` naming ``quantization``; one that differs only in its speculative
block is judged exactly as the report judged it before the gate existed (the same records with
their engine configurations taken out); a baseline with the candidate's fp8 but no speculation
isolates the speculation, and the candidate is judged against it — on the same speed-up the
primary gives, since in the simulator quantization changes no timing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from core.sinks import MemorySink
from gateway.settings import Settings
from policies.compile import parse_policy
from records.reader import read
from records.sqlite_store import query_records
from report import build_report
from report.analysis import ALL, analyze
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

PLAIN = {"prefill_base_s": 0.002, "step_s": 0.004}
SPEC = {**PLAIN, "mode": "speculative", "acceptance": 0.8}
REQUESTS = 40


def policy(urls: dict[str, str], baseline: bool) -> str:
    legs = "[{backend: cand, role: candidate}" + (
        ", {backend: base, role: baseline}]" if baseline else "]"
    )
    backends = "".join(f"  {n}: {{url: '{u}', kind: sim}}\n" for n, u in urls.items())
    return (
        f"version: 1\nbackends:\n{backends}primary: prim\ndefault:\n  ratio: 1.0\n  legs: {legs}\n"
    )


async def run(
    sims: Any, servers: list[Any], tmp_path: Path, write_policy: Any, **configs: dict[str, Any]
) -> list[dict[str, Any]]:
    """``REQUESTS`` chats through a gateway in front of ``configs`` (prim, cand[, base]); the
    records its store holds."""
    started = {name: await sims(**c) for name, c in configs.items()}
    store = tmp_path / "r.sqlite"
    settings = Settings(
        policy_path=write_policy(policy({n: s.base_url for n, s in started.items()}, "base" in configs)),
        store_path=str(store), shutdown_timeout_s=2.0, scrape_interval_s=0.05, upstream=FAST_UPSTREAM,
    )  # fmt: skip
    sink = MemorySink()
    server = await start_server(build_app(settings, sinks=[sink]))
    url = str(server.make_url("")).rstrip("/")
    await asyncio.sleep(0.3)  # the probe's first answers (it asks at start)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": f"question {i}"}],
                "max_tokens": 48,
                "stream": True,
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()

        gate = asyncio.Semaphore(4)

        async def bounded(i: int) -> None:
            async with gate:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))
    await sink.wait_for(lambda e: len(sink.exchanges) >= REQUESTS)
    await server.close()
    records = list(query_records(store))
    assert len(records) == REQUESTS
    return records


def without_engines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as the report read them before the gate: no engine configuration."""
    return [
        {**r, "legs": [{k: v for k, v in leg.items() if k != "engine"} for leg in r["legs"]]}
        for r in records
    ]


@pytest.fixture
def ctx(sims, servers, tmp_path, write_policy):
    return lambda **configs: run(sims, servers, tmp_path, write_policy, **configs)


async def test_speculation_plus_fp8_is_confounded_naming_quantization(ctx, tmp_path):
    records = await ctx(prim=PLAIN, cand={**SPEC, "engine": {"quantization": "fp8"}})
    for r in map(read, records):
        prim, cand = r.primary, r.candidate_leg("cand")
        assert prim is not None and cand is not None
        assert prim.engine is not None and cand.engine is not None
        assert (prim.engine.settings or {})["quantization"] is None
        assert (cand.engine.settings or {})["quantization"] == "fp8"
        assert prim.engine.base_fingerprint != cand.engine.base_fingerprint
    before = analyze(without_engines(records)).candidates["cand"].overall
    assert before is not None and before.decision != "confounded"  # the speed-up it credited
    paths = build_report(records, None, tmp_path / "report")
    c = paths.analysis.candidates["cand"]
    assert c.confound is not None and c.confound.fields == ("quantization",)
    assert {v.decision for v in c.verdicts} == {"confounded"}
    assert "quantization (production unset, candidate fp8)" in c.verdicts[0].reasons[0]
    assert paths.analysis.recommendations[ALL].backend is None
    md = paths.markdown.read_text()
    assert "## Confounded" in md and "cand-nospec" in md  # the fragment, ready to copy
    js = json.loads(paths.json.read_text())
    assert js["verdict"] == "confounded"
    gate = js["candidates"]["cand"]["confound"]
    assert gate["fields"] == ["quantization"] and gate["confounded"] is True
    # The fragment adds the isolating leg: a policy that parses, with a baseline leg.
    fragment = yaml.safe_load(gate["policy_fragment"])
    legs = fragment["default"]["legs"]
    assert {"backend": "cand-nospec", "role": "baseline"} in legs
    assert "quantization=fp8" in gate["policy_fragment"]
    known = {
        n: {"url": f"http://127.0.0.1:{i + 1}", "kind": "sim"}
        for i, n in enumerate(("prim", "cand"))
    }
    whole = {
        "version": 1,
        "primary": "prim",
        **fragment,
        "backends": {**known, **fragment["backends"]},
    }
    assert parse_policy(whole, source="fragment").backends.keys() >= {"cand-nospec"}


async def test_a_candidate_that_differs_only_in_speculation_is_judged_as_before(ctx):
    records = await ctx(prim=PLAIN, cand=SPEC)
    for r in map(read, records):
        prim, cand = r.primary, r.candidate_leg("cand")
        assert prim is not None and cand is not None
        assert prim.engine is not None and cand.engine is not None
        assert prim.engine.base_fingerprint == cand.engine.base_fingerprint
        assert prim.engine.config_fingerprint != cand.engine.config_fingerprint
    now, before = analyze(records), analyze(without_engines(records))
    c = now.candidates["cand"]
    assert c.confound is not None and c.confound.fields == () and not c.confound.confounded
    assert [(v.category, v.decision, v.reasons) for v in c.verdicts] == [
        (v.category, v.decision, v.reasons) for v in before.candidates["cand"].verdicts
    ]


async def test_a_baseline_with_the_candidates_settings_isolates_speculation(ctx):
    fp8 = {"engine": {"quantization": "fp8"}}
    records = await ctx(prim=PLAIN, cand={**SPEC, **fp8}, base={**PLAIN, **fp8})
    c = analyze(records).candidates["cand"]
    assert c.confound is not None and c.confound.isolated and c.confound.fields == ("quantization",)
    v = c.overall
    assert v is not None and v.decision != "confounded"
    assert v.reasons[0].startswith("judged against baseline base")
    # The speed-up judged against the baseline is measured on the same exchanges as the one over
    # the primary (how close the two read is the machine's timing, not a functional fact).
    raw = analyze(without_engines(records)).candidates["cand"].speedups[ALL].e2e
    assert v.e2e is not None and raw is not None
    assert v.e2e.n == raw.n > 0
