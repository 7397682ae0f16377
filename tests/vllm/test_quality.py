"""Quality equivalence on sampled traffic against real vLLM (CPU build, the tiny trained Llama).

Sixty held-out chat exchanges (healthbench prompts), half at temperature 0.8 and half at the
API's default (1), each mirrored at once to a baseline (a plain copy of production) and three
candidates:

- ``ngram`` — vLLM's n-gram speculation, lossless: it must not be rejected;
- ``other`` — the draft model served plainly under the target's name: a different model;
- ``greedy`` — the baseline's engine behind a stack that commits the argmax whatever the
  temperature (a loopback proxy that rewrites ``temperature`` to 0: the symptom of an EAGLE verify
  path that ignores sampling parameters).

With the policy's defaults (no ``quality:`` section) the report must call ``other`` and
``greedy`` ``not_equivalent`` and never recommend them. docs/quality.md states the tests' error
rates; this is the held-out check that the defaults hold on a real engine's outputs.

Then a canary whose candidate is the greedy-collapsing stack, on default-temperature traffic with
a baseline leg: the rollout's ``sampled_divergence`` guard must roll it back, no client error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from backends.server import SERVED_MODEL_NAME, VllmServer
from core import jsonx
from core.exchange import Exchange
from core.sinks import MemorySink
from gateway.settings import Settings
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.sqlite_store import query_records
from report.analysis import Analysis, analyze
from specshadow.app import build_app
from specshadow.inprocess import running_gateway
from tests.conftest import start_server
from tests.vllm.conftest import VllmServerPool, trace_requests

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_extra("other"), pytest.mark.timeout(1500)]

EXCHANGES = 60
MAX_TOKENS = 48
CANDIDATES = ("ngram", "other", "greedy")


@asynccontextmanager
async def greedy_proxy(upstream: str) -> AsyncIterator[str]:
    """A loopback stack in front of ``upstream`` that serves every request greedily."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and body:
            doc = jsonx.loads(body)
            if isinstance(doc, dict) and ("messages" in doc or "prompt" in doc):
                doc["temperature"] = 0.0
                doc.pop("top_p", None)
                body = jsonx.dumps(doc)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type",)}
        async with session.request(
            request.method, upstream + request.path_qs, data=body or None, headers=headers
        ) as up:
            out = web.StreamResponse(status=up.status)
            if "content-type" in up.headers:
                out.content_type = up.headers["content-type"].split(";")[0]
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await session.close()


def policy(urls: Mapping[str, str]) -> PolicyStore:
    raw: dict[str, Any] = {
        "version": 1,
        "backends": {name: {"url": url, "kind": "vllm"} for name, url in urls.items()},
        "primary": "plain",
        "default": {
            "ratio": 1.0,
            "legs": [{"backend": "baseline", "role": "baseline"}]
            + [{"backend": c, "role": "candidate"} for c in CANDIDATES],
        },
        "shaping": {"include_metrics": True},
    }
    return PolicyStore(parse_policy(raw, source="quality vllm"))


def has_id(request_id: str) -> Callable[[Exchange], bool]:
    return lambda exchange: exchange.request_id == request_id


def prompts() -> list[list[dict[str, Any]]]:
    rows = trace_requests("healthbench_chat.jsonl", 40, max_prompt_chars=1200)
    messages = [list(r["messages"]) for r in rows]  # type: ignore[call-overload]
    return [messages[i % len(messages)] for i in range(EXCHANGES)]


async def run(urls: Mapping[str, str], store: Path) -> None:
    todo = prompts()
    async with (
        running_gateway(policy(urls), store_path=store, shutdown_timeout_s=10.0) as gw,
        openai.AsyncOpenAI(
            base_url=gw.openai_base_url, api_key="k", max_retries=0, timeout=300
        ) as client,
    ):

        async def one(i: int) -> None:
            sampling: dict[str, Any] = {"temperature": 0.8} if i % 2 else {}  # or default 1
            await client.chat.completions.create(
                model=SERVED_MODEL_NAME,
                messages=todo[i],  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                extra_headers={"x-request-id": f"q-{i}", "x-specshadow-category": "chat"},
                **sampling,
            )
            await gw.sink.wait_for(has_id(f"q-{i}"), timeout_s=300)

        for start in range(0, EXCHANGES, 3):
            await asyncio.gather(*(one(i) for i in range(start, min(start + 3, EXCHANGES))))


@pytest.fixture(scope="module")
def quality_records(
    vllm_servers: dict[str, VllmServer],
    vllm_server: VllmServerPool,
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("quality") / "r.sqlite"
    other = vllm_server("other")  # the run's shared "another model" server

    async def go() -> None:
        async with greedy_proxy(vllm_servers["baseline"].base_url) as greedy:
            await run(
                {
                    "plain": vllm_servers["plain"].base_url,
                    "baseline": vllm_servers["baseline"].base_url,
                    "ngram": vllm_servers["ngram"].base_url,
                    "other": other.base_url,
                    "greedy": greedy,
                },
                store,
            )

    asyncio.run(go())
    records = list(query_records(store))
    assert len(records) == EXCHANGES
    return records


@pytest.fixture(scope="module")
def analysis(quality_records: list[dict[str, Any]]) -> Analysis:
    return analyze(quality_records)


def test_the_lossless_ngram_candidate_is_not_rejected(
    quality_records: list[dict[str, Any]],
) -> None:
    # A lossless candidate is rejected at most at the test's family-wise level: at the default
    # 5 % one clean CI run in twenty would fail here by construction (one did: distinct bigrams,
    # Holm-corrected). Judged at 0.5 %, as tests/report/test_quality_gateway.py judges its
    # lossless candidate, the false-alarm rate this assertion accepts is 0.5 % (with 2,000
    # permutations, Holm's first step then needs a metric beyond every permutation).
    eq = analyze(quality_records, alpha=0.005).candidates["ngram"].equivalence["all"]
    print("ngram:", eq.verdict, eq.decided_by, eq.n, eq.mmd, eq.reasons)
    assert eq.n >= EXCHANGES - 3
    assert eq.verdict != "not_equivalent", eq.reasons


@pytest.mark.parametrize("backend", ["other", "greedy"])
def test_another_model_and_a_greedy_collapse_are_not_equivalent_and_never_recommended(
    analysis: Analysis, backend: str
) -> None:
    c = analysis.candidates[backend]
    eq = c.equivalence["all"]
    print(f"{backend}:", eq.verdict, eq.decided_by, eq.n, eq.mmd, eq.reasons)
    assert eq.verdict == "not_equivalent", eq.reasons
    assert all(v.decision == "do_not_adopt" for v in c.verdicts if v.category == "all")
    assert all(r.backend != backend for r in analysis.recommendations.values())


async def test_a_canary_that_collapses_to_greedy_on_default_temperature_is_rolled_back(
    vllm_servers: dict[str, VllmServer], servers: list[Any], tmp_path: Path, write_policy: Any
) -> None:
    """The canary's candidate is the greedy-collapsing stack from the start; every request takes
    the API's default temperature. With a baseline leg, ``sampled_divergence`` must roll it back
    (the latency and acceptance guards are off: the point is the guard that reads outputs), and
    no client sees an error before or after."""
    guards = {
        "min_samples": 10,
        "e2e_p99_ratio_max": None,
        "tpot_p99_ratio_max": None,
        "tokens_per_event_min": None,
        "kv_usage_max": None,
    }
    rollout = jsonx.dumps({"stage": "canary", "serve_ratio": 0.3, "guards": guards}).decode()
    async with greedy_proxy(vllm_servers["baseline"].base_url) as greedy:
        text = (
            "version: 1\n"
            f"backends:\n  plain: {{url: '{vllm_servers['plain'].base_url}', kind: vllm}}\n"
            f"  baseline: {{url: '{vllm_servers['baseline'].base_url}', kind: vllm}}\n"
            f"  greedy: {{url: '{greedy}', kind: vllm}}\n"
            "primary: plain\n"
            "quality: {likelihood: null}\n"
            "default:\n  ratio: 1.0\n"
            "  legs: [{backend: greedy, role: candidate}, {backend: baseline, role: baseline}]\n"
            f"  rollout: {rollout}\n"
        )
        settings = Settings(
            policy_path=write_policy(text),
            state_path=str(tmp_path / "rollout.json"),
            admin_token="t",
            shutdown_timeout_s=10.0,
        )
        sink = MemorySink()
        gateway = await start_server(build_app(settings, sinks=[sink]))
        servers.append(gateway)
        url = str(gateway.make_url("")).rstrip("/")
        todo = prompts()
        served: list[str] = []
        async with (
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=300
            ) as client,
            aiohttp.ClientSession() as admin,
        ):

            async def one(i: int) -> None:
                raw = await client.chat.completions.with_raw_response.create(
                    model=SERVED_MODEL_NAME,
                    messages=todo[i % len(todo)],  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                    extra_headers={"x-request-id": f"c-{i}"},
                )
                assert raw.parse().choices[0].message.content is not None  # no client error
                served.append(raw.headers.get("x-specshadow-served-by", ""))

            async def stage() -> str:
                async with admin.get(f"{url}/admin/rollout") as r:
                    return str((await r.json())["rules"]["default"]["stage"])

            sent = 0
            while sent < 120 and await stage() == "canary":
                await asyncio.gather(*(one(i) for i in range(sent, sent + 4)))
                sent += 4
                for i in range(sent - 4, sent):
                    await sink.wait_for(has_id(f"c-{i}"), timeout_s=300)
                await asyncio.sleep(0.2)  # the evidence worker feeds the guards
            async with admin.get(f"{url}/admin/rollout") as r:
                rule = (await r.json())["rules"]["default"]
            print(f"rolled back after {sent} exchanges: {rule['last_transition']}")
            assert rule["stage"] == "shadow", rule["guards"]
            assert rule["last_transition"]["guard"] == "sampled_divergence"
            assert "candidate" in served
            await asyncio.gather(*(one(i) for i in range(sent, sent + 4)))
            assert served[-4:] == ["primary"] * 4
