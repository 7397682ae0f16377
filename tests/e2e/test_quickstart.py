"""The README's quick start, followed literally, with the official SDK at its defaults.

The commands are read out of README.md ("Quick start against your own endpoint"): the policy-free
``specshadow serve`` line and the ``specshadow report`` line, run as written with only the two
upstream URLs and the port replaced by simulators on loopback (a plain production endpoint and a
speculative candidate). The client is the ``openai`` SDK as an application uses it: no
``stream_options``, no temperature — then the same with ``include_usage``, non-streaming,
completions and the Responses API.

Known truth: the README mirrors 10 % of requests to one candidate replica, so the candidate runs
at about a tenth of production's per-replica arrival rate. The report must say exactly that
(``not_load_matched``) with its fix, never a quality or speed verdict it cannot support, and no
leg may be compared on an estimated token count against an exact one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from core.procs import free_port
from records.reader import read
from records.sqlite_store import query_records
from tests.reliability.helpers import wait_healthy

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 250  # 10 % of them mirrored: ~25 pairs (fewer than 10 has probability < 0.1 %)
CONCURRENCY = 16


def quick_start() -> tuple[list[str], list[str]]:
    """The policy-free serve line and the report line of the README's quick start, as argv."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start against your own endpoint") :]
    block = section[
        section.index("```bash") + 7 : section.index("```", section.index("```bash") + 7)
    ]
    lines = [line.split(" #")[0].strip() for line in block.splitlines()]
    serve = next(
        line for line in lines if line.startswith("specshadow serve") and "--shadow " in line
    )
    report = next(line for line in lines if line.startswith("specshadow report"))
    return shlex.split(serve), shlex.split(report)


def literal(argv: list[str], **swap: str) -> list[str]:
    out = [sys.executable, "-m", "specshadow", *argv[1:]]
    for old, new in swap.items():
        out = [arg.replace(old, new) for arg in out]
    return out


async def client_traffic(url: str, variant: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-anything")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        prompt = f"Question {i}: how does speculative decoding work?"
        messages: Any = [{"role": "user", "content": prompt}]
        async with gate:
            if variant == "chat":
                stream = await client.chat.completions.create(
                    model="sim-model", messages=messages, stream=True
                )
                async for _chunk in stream:
                    pass
            elif variant == "chat-include-usage":
                stream = await client.chat.completions.create(
                    model="sim-model",
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for _chunk in stream:
                    pass
            elif variant == "chat-whole":
                await client.chat.completions.create(model="sim-model", messages=messages)
            elif variant == "completions":
                pieces = await client.completions.create(
                    model="sim-model", prompt=prompt, stream=True
                )
                async for _piece in pieces:
                    pass
            else:
                events = await client.responses.create(model="sim-model", input=prompt, stream=True)
                async for _event in events:
                    pass

    try:
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    finally:
        await client.close()


def verdicts_of(report: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    """Category (``all`` included) → decision of the one candidate, and its fix, from
    report.json's summary."""
    summary = report["summary"]
    assert len(summary) == 1, list(summary)
    (cand,) = summary.values()
    return {"all": cand["verdict"], **cand["categories"]}, cand["fix"]


@pytest.mark.parametrize(
    "variant", ["chat", "chat-include-usage", "chat-whole", "completions", "responses"]
)
async def test_the_readme_quick_start_with_sdk_defaults(variant, sims, tmp_path):
    serve, report = quick_start()
    assert "--store" in serve, "the quick start's serve line must write the records it reports on"
    production = await sims()
    candidate = await sims(mode="speculative", num_speculative_tokens=3)
    port = str(free_port())
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(  # noqa: ASYNC220 — started once
            literal(
                serve,
                **{
                    "http://prod-llm:8000": production.base_url,
                    "http://spec-llm:8000": candidate.base_url,
                    "8080": port,
                },
            ),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
        )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, proc, log.read_text)
        await client_traffic(url, variant)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    started = log.read_text()
    # The startup summary says what each backend is: both were detected as simulators.
    assert re.search(r"shadow-1.*\bsim\b", started), started

    records = [read(r) for r in query_records(tmp_path / "records.sqlite")]
    assert len(records) == REQUESTS, (len(records), started[-2000:])
    mirrored = [r for r in records if len(r.legs) > 1]
    # Bin(250, 0.1): outside [10, 60] with probability 1.3e-4.
    assert 10 <= len(mirrored) <= 60, (len(mirrored), started[-2000:])
    for r in mirrored:
        sources = {leg.tokens_source for leg in r.legs if leg.output_tokens is not None}
        # One footing per exchange: never an estimate beside an exact count.
        assert "estimated" not in sources or sources == {"estimated"}, sources

    out = await asyncio.to_thread(
        subprocess.run,
        literal(report),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "report" / "report.json").read_text())
    decisions, fix = verdicts_of(result)
    # A tenth of production's load: the report says so and nothing it cannot support.
    assert set(decisions.values()) == {"not_load_matched"}, decisions
    assert fix is not None and "load_matched" in fix, fix
    # … and leads with the one fix, the same words in every format.
    md = (tmp_path / "report" / "report.md").read_text()
    first_screen = "\n".join(md.splitlines()[:40])
    assert fix in first_screen, first_screen
    assert fix in (tmp_path / "report" / "report.html").read_text()
    assert "not_equivalent" not in json.dumps(result.get("candidates"))
