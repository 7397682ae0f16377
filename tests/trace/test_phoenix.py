"""The gateway's traces read back from a real trace store: Arize Phoenix, over OTLP/HTTP.

``specshadow serve`` (a subprocess, policy-free: ``--primary`` a plain simulator, ``--shadow`` a
speculative one, ``--baseline`` another plain one) exports with nothing but the standard
variables an SRE would set — ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``, ``OTEL_RESOURCE_ATTRIBUTES`` naming Phoenix's
project. The official ``openai`` SDK sends requests with ids of its own; afterwards every span is
read back from Phoenix's REST API and held to what the test knows independently: one trace per
request, its server span carrying the request id, one client span per leg under it, and each
leg's GenAI attributes equal to what that leg's simulator says it sent (tokens, finish reason,
model, port; the candidate's acceptance from its drafted and accepted counts). A browser test
then opens one trace in Phoenix's UI with headless Chromium and reads the span tree off the page.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from simulator.app import run_simulator
from simulator.config import SimConfig
from tests.receivers.phoenix import PhoenixServer
from tests.reliability.helpers import spawn_gateway

pytestmark = [pytest.mark.phoenix, pytest.mark.e2e, pytest.mark.timeout(900)]

PROJECT = "specshadow-trace-test"
MODEL = "sim-model"
SERVER_SPAN = "POST /v1/chat/completions"
LEG_SPAN = f"chat {MODEL}"
ROLES = ("primary", "candidate", "baseline")
# (request id, streamed?) — three streamed (two asking for usage), one not streamed
REQUESTS = (("trace-a", True), ("trace-b", True), ("trace-c", True), ("trace-d", False))
NO_USAGE = "trace-c"  # streamed as the SDK does by default: no stream_options
PROMPTS = {
    "trace-a": "Name three rivers of Europe.",
    "trace-b": "Write a haiku about tracing.",
    "trace-c": "What is speculative decoding?",
    "trace-d": "Count to five.",
}

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@dataclass(frozen=True)
class Run:
    spans: list[dict[str, Any]]
    truth: dict[str, dict[str, dict[str, Any]]]  # role → request id → the simulator's record
    ports: dict[str, int]  # role → its simulator's port


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200, url
        return await resp.json()


async def _answered(sims: list[Any], ids: list[str], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(
        (r := sim.state.get(rid)) is not None and r.outcome == "completed"
        for sim in sims
        for rid in ids
    ):
        assert asyncio.get_running_loop().time() < deadline, "a leg never completed"
        await asyncio.sleep(0.05)


async def _drive(phoenix: PhoenixServer) -> Run:
    configs = {
        "primary": SimConfig(prefill_base_s=0.002, step_s=0.001),
        "candidate": SimConfig(mode="speculative", prefill_base_s=0.002, step_s=0.001),
        "baseline": SimConfig(prefill_base_s=0.002, step_s=0.001),
    }
    async with AsyncExitStack() as stack:
        sims = {r: await stack.enter_async_context(run_simulator(c)) for r, c in configs.items()}
        args = ["--primary", sims["primary"].base_url, "--shadow", sims["candidate"].base_url,
                "--baseline", sims["baseline"].base_url]  # fmt: skip
        env = phoenix.otlp_env(PROJECT, OTEL_BSP_SCHEDULE_DELAY="100")
        async with spawn_gateway(args, env) as gw:
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
            for rid, stream in REQUESTS:
                messages: Any = [{"role": "user", "content": PROMPTS[rid]}]
                headers = {"x-request-id": rid}
                if stream:
                    usage: Any = openai.NOT_GIVEN if rid == NO_USAGE else {"include_usage": True}
                    chunks = await client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=24, temperature=0,
                        stream=True, stream_options=usage, extra_headers=headers,
                    )  # fmt: skip
                    async for _ in chunks:
                        pass
                else:
                    await client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=24, temperature=0,
                        extra_headers=headers,
                    )  # fmt: skip
            await client.close()
            # every leg has been answered before the gateway stops (its shutdown then flushes
            # the span queue into Phoenix)
            await _answered(list(sims.values()), [rid for rid, _ in REQUESTS])
        truth = {
            role: {
                rid: await _get_json(f"{sim.base_url}/sim/requests?id={rid}") for rid, _ in REQUESTS
            }
            for role, sim in sims.items()
        }
        ports = {role: sim.port for role, sim in sims.items()}

    def complete(spans: list[dict[str, Any]]) -> bool:
        names = Counter(s["name"] for s in spans)
        n = len(REQUESTS)
        return names[SERVER_SPAN] >= n and names[LEG_SPAN] >= 3 * n and names["compare"] >= n

    spans = await phoenix.wait_for_spans(PROJECT, complete)
    return Run(spans=spans, truth=truth, ports=ports)


@pytest.fixture(scope="module")
def run(phoenix: PhoenixServer) -> Run:
    return asyncio.run(_drive(phoenix))


def _traces(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        out.setdefault(span["context"]["trace_id"], []).append(span)
    return out


def _server_span(trace: list[dict[str, Any]]) -> dict[str, Any]:
    (root,) = [s for s in trace if s["parent_id"] is None]
    return root


def test_each_exchange_is_one_trace_of_a_server_span_and_a_client_span_per_leg(run: Run) -> None:
    traces = _traces(run.spans)
    assert len(traces) == len(REQUESTS)  # one trace per mirrored exchange, nothing else
    seen = []
    for trace in traces.values():
        root = _server_span(trace)
        assert root["name"] == SERVER_SPAN
        seen.append(root["attributes"]["specshadow.request_id"])
        children = [s for s in trace if s is not root]
        assert all(s["parent_id"] == root["context"]["span_id"] for s in children)
        assert sorted(s["name"] for s in children) == [LEG_SPAN, LEG_SPAN, LEG_SPAN, "compare"]
        legs = [s for s in children if s["name"] == LEG_SPAN]
        assert sorted(s["attributes"]["specshadow.leg.role"] for s in legs) == sorted(ROLES)
        (compare,) = [s for s in children if s["name"] == "compare"]
        assert (
            compare["attributes"]["specshadow.exchange_id"]
            == (root["attributes"]["specshadow.exchange_id"])
        )
    assert sorted(seen) == sorted(rid for rid, _ in REQUESTS)


def test_the_server_span_carries_the_route_and_the_request(run: Run) -> None:
    for trace in _traces(run.spans).values():
        attrs = _server_span(trace)["attributes"]
        stream = dict(REQUESTS)[attrs["specshadow.request_id"]]
        assert attrs["http.request.method"] == "POST"
        assert attrs["http.route"] == "/v1/chat/completions"
        assert attrs["http.response.status_code"] == 200
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.request.stream"] is stream
        assert attrs["specshadow.shadow.sampled"] is True


def test_every_legs_genai_attributes_equal_what_its_backend_sent(run: Run) -> None:
    for trace in _traces(run.spans).values():
        root = _server_span(trace)
        rid = root["attributes"]["specshadow.request_id"]
        for leg in (s for s in trace if s["name"] == LEG_SPAN):
            attrs = leg["attributes"]
            role = attrs["specshadow.leg.role"]
            sent = run.truth[role][rid]
            where = f"{rid}/{role}"
            assert attrs["gen_ai.operation.name"] == "chat", where
            assert attrs["gen_ai.provider.name"] == "openai", where
            assert attrs["gen_ai.request.model"] == MODEL, where
            assert attrs["gen_ai.response.model"] == sent["model"], where
            if role == "primary" and rid == NO_USAGE:
                # no usage in the stream: the gateway's count is an estimate, never usage
                assert attrs["specshadow.tokens.source"] == "estimated", where
                assert "gen_ai.usage.output_tokens" not in attrs, where
                assert "gen_ai.usage.input_tokens" not in attrs, where
            else:
                assert attrs["gen_ai.usage.output_tokens"] == sent["completion_tokens"], where
                assert attrs["gen_ai.usage.input_tokens"] == sent["prompt_tokens"], where
            assert attrs["gen_ai.response.finish_reasons"] == [sent["finish_reason"]], where
            assert attrs["server.address"] == "127.0.0.1", where
            assert attrs["server.port"] == run.ports[role], where
            assert attrs["specshadow.stream.outcome"] == "completed", where
            # shadows always stream; the primary leg streams as the client asked
            streamed = role != "primary" or dict(REQUESTS)[rid]
            assert attrs["gen_ai.request.stream"] is streamed, where
            if streamed:
                assert attrs["gen_ai.response.time_to_first_chunk"] > 0, where
                outputs = sum(e["kind"] == "output" for e in sent["events"])
                assert attrs["specshadow.timing.output_events"] == outputs, where
            # no prompt text on any span: capture is off without a policy saying `full`
            assert PROMPTS[rid] not in map(str, attrs.values()), where


def test_the_candidate_legs_acceptance_equals_its_drafted_and_accepted_counts(run: Run) -> None:
    for trace in _traces(run.spans).values():
        rid = _server_span(trace)["attributes"]["specshadow.request_id"]
        (leg,) = [s for s in trace if s["attributes"].get("specshadow.leg.role") == "candidate"]
        sent = run.truth["candidate"][rid]
        assert sent["num_draft_tokens"] > 0, rid  # a speculative simulator drafted
        attrs = leg["attributes"]
        assert attrs["specshadow.acceptance.source"] == "vllm_request_metrics"
        rate = sent["num_accepted_tokens"] / sent["num_draft_tokens"]
        length = 1 + sent["num_accepted_tokens"] / sent["num_drafts"]
        # the simulator reports both ratios rounded to 6 decimals, as the wire carries them
        assert attrs["specshadow.acceptance.draft_acceptance_rate"] == round(rate, 6)
        assert attrs["specshadow.acceptance.mean_acceptance_length"] == round(length, 6)
        plain = [s for s in trace if s["attributes"].get("specshadow.leg.role") == "baseline"]
        assert "specshadow.acceptance.source" not in plain[0]["attributes"]


def _chromium(*args: str, profile: Path) -> str:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={profile}", "--virtual-time-budget=15000", *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _page_text(dom: str) -> str:
    """The text a reader sees: no scripts or styles, tags as spaces, whitespace collapsed."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None and not IN_CI, reason="Debian's chromium is not installed")
def test_phoenix_shows_the_trace_of_an_exchange_with_its_span_tree(
    run: Run, phoenix: PhoenixServer, tmp_path: Path
) -> None:
    profile = tmp_path / "chromium-profile"
    project_id = asyncio.run(phoenix.project_id(PROJECT))
    assert project_id is not None
    trace = next(
        t for t in _traces(run.spans).values()
        if _server_span(t)["attributes"]["specshadow.request_id"] == "trace-b"
    )  # fmt: skip
    trace_id = trace[0]["context"]["trace_id"]
    page = f"{phoenix.url}/projects/{project_id}/traces/{trace_id}"
    text = _page_text(_chromium("--dump-dom", page, profile=profile))
    # The trace's panel: its id, then the span tree (the server span, three legs, compare), then
    # the selected server span's attributes with the request id.
    assert f"Trace {trace_id}" in text, text[:3000]
    tree = text[text.index(f"Trace {trace_id}") :]
    assert re.search(
        rf"{SERVER_SPAN} \S+ (?:{LEG_SPAN} .*?){{3}}compare", tree
    ), tree[:3000]  # fmt: skip
    assert "trace-b" in tree
    # The check can fail: a trace id Phoenix never received shows no such tree.
    missing = "0" * 31 + "1"
    other = _page_text(
        _chromium(
            "--dump-dom", f"{phoenix.url}/projects/{project_id}/traces/{missing}", profile=profile
        )
    )
    assert f"Trace {trace_id}" not in other and "trace-b" not in other
    shot = tmp_path / "phoenix-trace.png"
    _chromium(f"--screenshot={shot}", "--window-size=1400,900", page, profile=profile)
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    print(f"screenshot: {shot} ({len(png)} bytes)")
