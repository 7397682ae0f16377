"""The projected end-to-end speed-up of agent runs against the same runs sent to each backend
directly (issue 30's ground truth).

Two simulators run as processes — production plain, the candidate speculative (k = 4,
acceptance 0.7: about 2.8 tokens per step) — behind a real ``specshadow serve`` process in the
policy-free start (every call mirrored to the candidate). Agent-shaped runs
(:mod:`loadgen.agent`, the official ``openai`` SDK) of two workflow types go through it:

- ``tool-heavy``: three steps of short calls (the second a fan-out of two) with 2.5 s of tool
  time after each of the first two — generation is a small part of the run (the gate), so the
  run speeds up little (≈1.1×);
- ``generation-heavy``: three longer calls with 40 ms between them — the run speeds up almost
  as much as each call (≈2.3×).

The report's ``report.json`` projects each type's run speed-up from the mirrored calls. The
truth is measured at the same moment: the very same runs (the same prompts, so the candidate
drafts the same steps) sent straight to production and straight to the candidate alongside the
runs through the gateway (three arms at once: an interleaved A/B under the same load), the ratio
of the mean run wall times on the client's clock.
A projection that took the per-call speed-up for the run's fails the tool-heavy type; one that
counted the tool time as generation, or the fan-out's two calls twice, fails a type too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from loadgen.agent import AgentRun, Step, Workflow, run_agent, sdk_sender
from records.sqlite_store import query_records
from report import build_report
from tests.reliability.helpers import spawn_gateway

pytestmark = pytest.mark.e2e

# One engine per server stepping every running request on absolute deadlines (continuous
# batching with no per-slot cost: a step takes 50 ms whatever the batch), so a late wake-up on a
# busy machine delays one step, never every step after it. Long steps keep the chunk rate low:
# the three arms' SDK clients share this process's event loop.
ENGINE = ["--batching", "continuous", "--prefill-ms", "2", "--step-ms", "50",
          "--min-output-tokens", "256", "--max-output-tokens", "256", "--seed", "7"]  # fmt: skip
SPECULATIVE = ["--mode", "speculative", "--k", "4", "--acceptance", "0.7"]

TOOL_HEAVY = Workflow(
    "tool-heavy",
    (
        Step("Plan the ticket triage.", 8, gap_after_s=2.5),
        Step("Summarize the tool result.", 8, fanout=2, gap_after_s=2.5),
        Step("Write the reply.", 8),
    ),
)
GENERATION_HEAVY = Workflow(
    "generation-heavy",
    (
        Step("Draft the report.", 48, gap_after_s=0.04),
        Step("Expand section two.", 48, gap_after_s=0.04),
        Step("Write the conclusion.", 48),
    ),
)
WORKFLOWS = (TOOL_HEAVY, GENERATION_HEAVY)
RUNS = 4  # per type
STAGGER = 0.3


async def simulator(*extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specshadow", "simulate", "--port", "0", *ENGINE, *extra,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    return proc, line.rsplit(" ", 1)[-1].strip()


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[str, str]]:
    started = [await simulator(), await simulator(*SPECULATIVE)]
    try:
        yield started[0][1], started[1][1]
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 10)


async def runs(base_url: str) -> dict[str, list[AgentRun]]:
    """Every workflow's runs through ``base_url``, run ``i`` starting ``i × STAGGER`` seconds
    in (so a stall of this busy machine lands on different moments of different runs); run
    ``i`` of a type has the same prompts whichever the backend."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    send = sdk_sender(client, "sim-model", temperature=0)

    async def run(wf: Workflow, i: int) -> AgentRun:
        await asyncio.sleep(i * STAGGER)
        return await run_agent(send, wf, tag=f"{wf.name}-{i}")

    try:
        done = await asyncio.gather(*(run(wf, i) for wf in WORKFLOWS for i in range(RUNS)))
    finally:
        await client.close()
    return {wf.name: [r for r in done if r.workflow == wf.name] for wf in WORKFLOWS}


def measured(prod: list[AgentRun], cand: list[AgentRun]) -> float:
    return sum(r.wall_s for r in prod) / sum(r.wall_s for r in cand)


# A projected speed-up held to the measured one on the wall clock (±10 %): the timing tier.
@pytest.mark.timing
async def test_projected_run_speedup_matches_the_runs_sent_to_the_candidate(
    upstreams: tuple[str, str], tmp_path: Path
) -> None:
    prod_url, cand_url = upstreams
    store = tmp_path / "records.sqlite"
    async with spawn_gateway(
        ["--primary", prod_url, "--shadow", cand_url, "--store", str(store)]
    ) as gp:
        # Through the gateway and straight to each backend, the three arms at once: the same
        # runs (the same prompts) at the same moment, so a busy machine slows all three alike.
        shadowed, direct_prod, direct_cand = await asyncio.gather(
            runs(gp.url), runs(prod_url), runs(cand_url)
        )

    assert all(len(r.calls) == wf.calls for wf in WORKFLOWS for r in shadowed[wf.name])
    records = list(query_records(store))
    calls = sum(wf.calls for wf in WORKFLOWS) * RUNS
    assert len(records) == calls
    paths = build_report(records, None, tmp_path / "report")
    report = json.loads(paths.json.read_text())
    truth = {wf.name: measured(direct_prod[wf.name], direct_cand[wf.name]) for wf in WORKFLOWS}
    got = {name: report["workflows"][name]["projected_e2e_speedup"] for name in truth}
    print({n: (round(truth[n], 3), got[n]) for n in truth})
    for name, t in truth.items():
        assert got[name]["estimate"] == pytest.approx(t, rel=0.10), (name, t, got[name])
        assert got[name]["low"] <= got[name]["estimate"] <= got[name]["high"]
    # the two types are told apart, and the gate falls on the tool-heavy one only
    assert truth["tool-heavy"] < 1.4 < 1.8 < truth["generation-heavy"]
    wf = report["workflows"]
    assert wf["tool-heavy"]["below_gate"] and not wf["generation-heavy"]["below_gate"]
    assert wf["tool-heavy"]["calls_per_run"] == TOOL_HEAVY.calls
    # the gateway saw the tool time the script spent between calls (plus the client's own time
    # around each call, which a loaded machine stretches)
    assert TOOL_HEAVY.tool_s * 0.98 <= wf["tool-heavy"]["between_s"] <= TOOL_HEAVY.tool_s * 1.3
    # the report leads with the workflow figure: the first screen's first line
    glance = paths.markdown.read_text().split("## At a glance", 1)[1].split("\n## ", 1)[0]
    assert glance.lstrip().startswith("- **Whole runs**"), glance
