"""The word *lossless*: earned only by a reported lossless verification with outputs inside the
noise floor; refused to a backend reporting a lossy mode even when its outputs match. Records
come from the real gateway in front of simulators that report their verification mode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from records.sqlite_store import query_records
from report import build_report
from report.analysis import analyze
from tests.gateway.test_shadow import CHAT, raw_stream

REQUESTS = 12


async def gather_records(
    sims: Any, gateway: Any, write_policy: Any, tmp_path: Path, **candidate: Any
) -> list[dict[str, Any]]:
    primary = await sims()
    cand = await sims(mode="speculative", num_speculative_tokens=3, **candidate)
    base = await sims()
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  cand: {{url: '{cand.base_url}', kind: sim}}\n"
        f"  base: {{url: '{base.base_url}', kind: sim}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: cand, role: candidate}, {backend: base, role: baseline}]}\n"
    )
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy), store_path=str(store))
    await asyncio.sleep(0.3)  # the server-info probe's first answer (loopback, milliseconds)
    for i in range(REQUESTS):
        body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
        status, _ = await raw_stream(gw.url, body, {"x-request-id": f"q{i}"})
        assert status == 200
        await gw.sink.wait_for(lambda e, i=i: e.request_id == f"q{i}")
    await gw.server.close()
    return list(query_records(store))


@pytest.mark.parametrize(
    ("candidate", "claim", "because"),
    [
        ({}, "lossless", "verification reported lossless (rejection_sample_method=standard)"),
        (
            {"rejection_sample_method": "synthetic"},
            "not_lossless",
            "the backend reports a lossy verification mode (rejection_sample_method=synthetic)",
        ),
        (
            {"rejection_sample_method": "synthetic", "divergence_at": 3},
            "not_lossless",
            "the backend reports a lossy verification mode",
        ),
        ({"divergence_at": 3}, "not_lossless", "outputs diverge from the primary beyond the noise"),
        ({"server_info": False}, "unverified", "does not report how it verifies drafts"),
        (
            {"rejection_sample_method": "fly"},
            "not_lossless",
            "the backend reports a lossy verification mode (rejection_sample_method=fly)",
        ),
        (
            {"rejection_sample_method": "speculative_magic"},
            "unverified",
            "a verification mode specshadow does not know (rejection_sample_method="
            "speculative_magic",
        ),
    ],
    ids=[
        "standard",
        "synthetic-identical-outputs",
        "synthetic-diverging",
        "diverging",
        "silent",
        "fly",
        "unknown-method",
    ],
)
async def test_the_lossless_claim(candidate, claim, because, sims, gateway, write_policy, tmp_path):
    records = await gather_records(sims, gateway, write_policy, tmp_path, **candidate)
    identical = all(r["comparisons"][0]["exact_match"] for r in records)
    assert identical == ("divergence_at" not in candidate)  # the ground truth of the outputs
    analysis = analyze(records)
    cand = analysis.candidates["cand"]
    assert cand.lossless is not None
    assert cand.lossless.claim == claim and because in cand.lossless.reason
    assert cand.label == "ngram k=3" if candidate.get("server_info", True) else cand.label == "cand"
    method = candidate.get("rejection_sample_method")
    lossy = method in ("synthetic", "fly")
    for verdict in cand.verdicts:
        assert any(r.startswith("not lossless") for r in verdict.reasons) == lossy
    out = tmp_path / "report"
    build_report(records, None, out)
    report = json.loads((out / "report.json").read_text())
    entry = report["candidates"]["cand"]
    assert entry["lossless"]["claim"] == claim
    assert entry["speculative"]["verification"] == (
        "lossy"
        if lossy
        else "unknown"
        if method == "speculative_magic"
        else None
        if candidate.get("server_info") is False
        else "lossless"
    )
    if method == "speculative_magic":  # named, in the record and the report
        assert all(
            "speculative_magic" in r["legs"][1]["speculative"]["verification_detail"]
            for r in records
        )
        assert "speculative_magic" in entry["speculative"]["verification_detail"]
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {cand.label} | cand |"))
    assert {
        "lossless": "| lossless |",
        "not_lossless": "| not lossless |",
        "unverified": "| not verified |",
    }[claim] in row


async def test_a_cross_vocabulary_drafter_is_gated_on_the_checklist(
    sims, gateway, write_policy, tmp_path
):
    """vLLM's use_heterogeneous_vocab in /server_info → legs[].speculative.cross_vocabulary in
    every record, candidates.<backend>.speculative.cross_vocabulary in the report, and the gate
    on the release checklist; a candidate without it has neither."""
    records = await gather_records(
        sims,
        gateway,
        write_policy,
        tmp_path,
        proposer="draft_model",
        speculative_settings={"use_heterogeneous_vocab": True, "draft_sample_method": "greedy"},
    )
    assert all(r["legs"][1]["speculative"]["cross_vocabulary"] is True for r in records)
    assert all(r["legs"][2]["speculative"]["cross_vocabulary"] is None for r in records)
    out = tmp_path / "report"
    build_report(records, None, out)
    report = json.loads((out / "report.json").read_text())
    spec = report["candidates"]["cand"]["speculative"]
    assert (spec["cross_vocabulary"], spec["draft_sample_method"]) == (True, "greedy")
    gate = [line for line in analyze(records).checklist if "Cross-vocabulary gate" in line]
    assert len(gate) == 3
    assert "greedy only" in gate[0] and "intersection" in gate[1] and "acceptance" in gate[2]
    plain = await gather_records(sims, gateway, write_policy, tmp_path / "plain")
    assert not [line for line in analyze(plain).checklist if "Cross-vocabulary" in line]


# A measured speed-up decides the pick: the timing tier (docs/testing.md), run alone, once.
@pytest.mark.timing
async def test_two_candidates_through_the_gateway_the_faster_one_is_named(
    sims, gateway, write_policy, tmp_path
):
    """Same text, more tokens per target pass: named for every category, pairwise CI above 1.

    The bound: both candidates take the same 4 ms per target pass, "fast" accepts 0.9 per drafted
    position and "slow" 0.3 (k = 4: about 4.1 and 1.4 tokens per pass), so "fast" is about 2.9×
    faster by the simulators' schedule; the assumption is that the machine's own delays, shared
    by every leg of an exchange, leave a paired CI of slow/fast below 1 over 48 exchanges."""
    primary = await sims(step_s=0.004)
    fast = await sims(mode="speculative", step_s=0.004, acceptance=0.9, proposer="ngram")
    slow = await sims(mode="speculative", step_s=0.004, acceptance=0.3, proposer="draft_model")
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  fast: {{url: '{fast.base_url}', kind: sim}}\n"
        f"  slow: {{url: '{slow.base_url}', kind: sim}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: fast, role: candidate}, {backend: slow, role: candidate}]}\n"
    )
    store = tmp_path / "r.sqlite"
    gw = await gateway(None, policy_path=write_policy(policy), store_path=str(store))
    await asyncio.sleep(0.3)
    for i in range(48):  # 24 per category: 5+ pairs in each of the 4 load strata
        cat = ("chat", "code")[i % 2]
        body = {**CHAT, "messages": [{"role": "user", "content": f"{cat} question {i}"}]}
        headers = {"x-request-id": f"t{i}", "x-specshadow-category": cat}
        status, _ = await raw_stream(gw.url, body, headers)
        assert status == 200
        await gw.sink.wait_for(lambda e, i=i: e.request_id == f"t{i}")
    await gw.server.close()
    records = list(query_records(store))
    for r in records:  # the ground truth: the same text from both, fewer events from "fast"
        legs = {leg["backend"]: leg for leg in r["legs"]}
        assert all(c["exact_match"] for c in r["comparisons"])
        assert legs["fast"]["tokens_per_event"] > legs["slow"]["tokens_per_event"]
    a = analyze(records)
    assert {cat: rec.backend for cat, rec in a.recommendations.items()} == {
        "chat": "fast", "code": "fast", "all": "fast",
    }  # fmt: skip
    for h in a.head_to_head:
        assert (h.a, h.b) == ("fast", "slow") and h.a_faster  # CI of slow/fast below 1
    assert ("candidate", "all") not in a.latency  # each candidate has its own row
    assert (
        a.candidates["slow"].label == "draft_model k=4"
        and a.candidates["fast"].label == "ngram k=4"
    )
    out = tmp_path / "report"
    build_report(records, None, out)
    report = json.loads((out / "report.json").read_text())
    assert report["recommendation"] == {"chat": "fast", "code": "fast", "all": "fast"}
    assert set(report["candidates"]) == {"fast", "slow"}
    assert report["candidates"]["slow"]["overall"]["verdict"] in (
        "adopt",
        "not_enough_data",
        "do_not_adopt",
    )
    html = (out / "report.html").read_text()
    assert (
        "Head to head" in html and "Speed: paired candidate-vs-primary speedups — ngram k=4" in html
    )
