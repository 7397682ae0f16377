"""Evidence against the simulator's ground truth, end to end through the gateway's sockets:
per-category acceptance, divergence positions, and records written under concurrent load."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from core.sinks import MemorySink
from evidence.worker import EvidenceWorker
from gateway.app import create_app
from gateway.settings import Settings
from records.sqlite_store import RecordWriter, query_records
from simulator.acceptance import expected_rates
from specshadow.main import main as cli_main
from tests.conftest import FAST_UPSTREAM, start_server
from tests.gateway.test_shadow import policy_yaml

FAST = {"step_s": 0.0, "prefill_base_s": 0.0}
EXTRA = "budgets: {max_in_flight: 256}\n"

StartGateway = Callable[..., Awaitable[tuple[str, EvidenceWorker, MemorySink]]]


@pytest.fixture
async def recorded_gateway(
    servers: list[TestServer], tmp_path: Path
) -> AsyncIterator[StartGateway]:
    sinks: list[EvidenceWorker] = []

    async def start(policy_path: str, **options: Any) -> tuple[str, EvidenceWorker, MemorySink]:
        sink = EvidenceWorker([RecordWriter(tmp_path / "records.db", **options)])
        await sink.start()
        sinks.append(sink)
        memory = MemorySink()
        settings = Settings(
            primary_url=None,
            policy_path=policy_path,
            shutdown_timeout_s=2.0,
            upstream=FAST_UPSTREAM,
        )
        server = await start_server(create_app(settings, sinks=[memory, sink]))
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), sink, memory

    yield start
    for sink in sinks:
        await sink.stop()


async def send_all(
    url: str, bodies: list[tuple[dict[str, Any], dict[str, str]]], limit: int = 16
) -> None:
    gate = asyncio.Semaphore(limit)
    async with aiohttp.ClientSession() as session:

        async def one(body: dict[str, Any], headers: dict[str, str]) -> None:
            async with (
                gate,
                session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
            ):
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one(b, h) for b, h in bodies))


def chat(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
        "max_tokens": 112,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def wait_records(sink: EvidenceWorker, memory: MemorySink, n: int) -> None:
    await memory.wait_for(lambda _: len(memory.exchanges) >= n, timeout_s=60)
    assert await sink.flush(30)


# The gateway does not forward x-specshadow-category to shadows, so the simulated candidate
# classifies each request from its body: a second user message makes it multi_turn.
CATEGORY_ACCEPTANCE = {"chat": 0.8, "multi_turn": 0.45}
CATEGORY_COVERAGE = {"multi_turn": 0.5}
PER_CATEGORY = 100


def categorized(i: int) -> tuple[dict[str, Any], dict[str, str]]:
    body = chat(i)
    if i % 2:
        body["messages"] += [
            {"role": "assistant", "content": "sure"},
            {"role": "user", "content": "more please"},
        ]
        return body, {"x-specshadow-category": "multi_turn"}
    return body, {"x-specshadow-category": "chat"}


async def test_per_category_acceptance_is_recovered_from_records_within_3_percent(
    sims: Any, write_policy: Callable[[str], str], recorded_gateway: StartGateway, tmp_path: Path
) -> None:
    primary = await sims(**FAST, min_output_tokens=80, max_output_tokens=112)
    candidate = await sims(
        mode="speculative",
        num_speculative_tokens=4,
        category_acceptance=CATEGORY_ACCEPTANCE,
        category_coverage=CATEGORY_COVERAGE,
        min_output_tokens=80,
        max_output_tokens=112,
        **FAST,
    )
    url, sink, memory = await recorded_gateway(
        write_policy(policy_yaml(primary.base_url, candidate.base_url, extra=EXTRA))
    )
    cats = list(CATEGORY_ACCEPTANCE)
    bodies = [categorized(i) for i in range(PER_CATEGORY * len(cats))]
    await send_all(url, bodies)
    await wait_records(sink, memory, len(bodies))

    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    truth: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for record in query_records(tmp_path / "records.db"):
        cand = next(leg for leg in record["legs"] if leg["role"] == "candidate")
        acc = cand["acceptance"]
        assert acc["source"] == "vllm_metrics" and acc["tokens_per_pass_source"] == "stream_shape"
        s = sums[record["category"]]
        s[0] += acc["num_drafts"]
        s[1] += acc["num_draft_tokens"]
        s[2] += acc["num_accepted_tokens"]
        s[3] += cand["output_tokens"]
        s[4] += cand["events"]
        gt = candidate.state.requests[record["request_id"]]
        assert gt.category == record["category"]
        # stream shape = realized tokens per target pass, request by request
        assert acc["tokens_per_pass"] == pytest.approx(
            gt.completion_tokens / len(gt.per_step_drafted)
        )
        t = truth[record["category"]]
        t[0] += gt.num_drafts
        t[1] += gt.num_draft_tokens
        t[2] += gt.num_accepted_tokens
    assert set(sums) == set(cats)
    for cat in cats:
        drafts, draft_tokens, accepted, tokens, events = sums[cat]
        expected = expected_rates(candidate.config, cat)
        rate, mal = accepted / draft_tokens, 1 + accepted / drafts
        assert [drafts, draft_tokens, accepted] == truth[cat]  # realized ground truth, exactly
        assert rate == pytest.approx(expected.draft_acceptance_rate, abs=0.03), cat
        assert mal == pytest.approx(expected.mean_acceptance_length, rel=0.03), cat
        # the prefill pass emits one token and never drafts: leave it out of tokens per pass
        requests = PER_CATEGORY
        decode_per_pass = (tokens - requests) / (events - requests)
        assert decode_per_pass == pytest.approx(expected.tokens_per_step, rel=0.03), cat
    # coverage below 1 makes tokens per pass fall short of the acceptance length (docs/concepts.md, "Acceptance, three ways")
    multi = sums["multi_turn"]
    assert multi[3] / multi[4] < 1 + multi[2] / multi[0] - 0.2


@pytest.mark.parametrize("logprobs", [True, False])
async def test_a_divergence_injected_at_token_n_is_reported_at_n(
    sims: Any,
    write_policy: Callable[[str], str],
    recorded_gateway: StartGateway,
    tmp_path: Path,
    logprobs: bool,
) -> None:
    n = 7
    primary = await sims(**FAST)
    candidate = await sims(mode="speculative", divergence_at=n, **FAST)
    baseline = await sims(**FAST)
    url, sink, memory = await recorded_gateway(
        write_policy(policy_yaml(primary.base_url, candidate.base_url, baseline=baseline.base_url))
    )
    extra = {"logprobs": True} if logprobs else {}
    await send_all(url, [(chat(i, max_tokens=32, **extra), {}) for i in range(6)])
    await wait_records(sink, memory, 6)
    records = list(query_records(tmp_path / "records.db"))
    assert len(records) == 6
    for record in records:
        cand, base = record["comparisons"]
        assert (cand["b"], base["b"]) == ("candidate", "baseline")
        assert base["exact_match"] is True and base["first_divergence"] is None
        assert cand["exact_match"] is False and cand["flag"] is True
        if logprobs:
            assert cand["divergence_unit"] == "token" and cand["first_divergence"] == n
        else:
            p = primary.state.requests[record["request_id"]].text
            c = candidate.state.requests[record["request_id"]].text
            first = next(i for i, (x, y) in enumerate(zip(p, c, strict=False)) if x != y)
            assert cand["divergence_unit"] == "char" and cand["first_divergence"] == first
            assert first >= len("".join(primary.state.requests[record["request_id"]].tokens[:n]))


async def test_records_written_under_concurrent_load_are_all_readable(
    sims: Any,
    write_policy: Callable[[str], str],
    recorded_gateway: StartGateway,
    tmp_path: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    primary = await sims(**FAST)
    candidate = await sims(mode="speculative", **FAST)
    url, sink, memory = await recorded_gateway(
        write_policy(policy_yaml(primary.base_url, candidate.base_url, extra=EXTRA)),
        batch_size=8,
    )
    total = 120
    cats = ["code", "chat", "math"]
    bodies = [
        (chat(i, max_tokens=16), {"x-specshadow-category": cats[i % 3]}) for i in range(total)
    ]
    await send_all(url, bodies, limit=64)
    await wait_records(sink, memory, total)
    ids = {e.exchange_id for e in memory.exchanges}
    records = list(query_records(tmp_path / "records.db"))
    assert {r["exchange_id"] for r in records} == ids and len(records) == total
    writer = sink.consumers[0]
    assert isinstance(writer, RecordWriter)
    assert sink.dropped == 0 and sink.failed == 0 and writer.failed == 0
    assert max(r["concurrency"] for r in records) > 1  # they really overlapped

    # the CLI prints the same records as JSON lines, filtered
    assert (
        cli_main(
            [
                "records",
                "--store",
                str(tmp_path / "records.db"),
                "--category",
                "code",
                "--last",
                "1h",
            ]
        )
        == 0
    )
    lines = capsysbinary.readouterr().out.splitlines()
    assert len(lines) == total // 3
    assert all(json.loads(line)["category"] == "code" for line in lines)
    assert cli_main(["records", "--store", str(tmp_path / "records.db"), "--limit", "5"]) == 0
    assert len(capsysbinary.readouterr().out.splitlines()) == 5


async def test_a_candidate_that_drew_no_pair_is_judged_not_enough_data_not_left_out(
    sims: Any,
    write_policy: Callable[[str], str],
    recorded_gateway: StartGateway,
    tmp_path: Path,
) -> None:
    """A short window at a small share can mirror nothing; the report must still name the
    candidate the rule mirrors to, with zero pairs and the pairs it needs — not fall silent."""
    from report import build_report
    from report.analysis import ALL, MIN_PAIRS, analyze

    primary = await sims(**FAST)
    candidate = await sims(mode="speculative", **FAST)
    url, sink, memory = await recorded_gateway(
        write_policy(policy_yaml(primary.base_url, candidate.base_url, ratio=0.0, extra=EXTRA))
    )
    await send_all(url, [(chat(i, max_tokens=8), {}) for i in range(6)])
    await wait_records(sink, memory, 6)
    records = list(query_records(tmp_path / "records.db"))
    assert len(records) == 6 and candidate.state.requests == {}  # nothing reached the candidate
    assert all(r["sampling"]["candidates"] == ["cand"] for r in records)
    a = analyze(records)
    assert list(a.candidates) == ["cand"]
    overall = next(v for v in a.candidates["cand"].verdicts if v.category == ALL)
    assert overall.decision == "not_enough_data" and overall.pairs_needed == MIN_PAIRS
    assert a.recommendations[ALL].backend is None
    report = json.loads((build_report(records, [], tmp_path / "out").json).read_text())
    overall_json = report["candidates"]["cand"]["overall"]
    assert overall_json["verdict"] == "not_enough_data" and overall_json["pairs"] == 0
    assert "not enough data" in (tmp_path / "out" / "report.md").read_text()
