"""The agent-shaped client: one trace id per run, fresh span ids per call, the workflow and
session headers, fan-outs sent together and the scripted tool time between steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.wire import TRACEPARENT_HEADER, WORKFLOW_HEADER, trace_id_of
from loadgen.agent import Call, CallTiming, Step, Workflow, run_agent, traceparent

SHAPE = Workflow(
    "triage",
    (
        Step("plan", 8, gap_after_s=0.15),
        Step("look up", 8, fanout=3, gap_after_s=0.1),
        Step("answer", 8),
    ),
)
CALL_S = 0.05


class Recorder:
    """A sender that answers every call after ``CALL_S`` and keeps what it was sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[Call, float, float]] = []

    async def __call__(self, call: Call, t0: float) -> CallTiming:
        start = time.perf_counter() - t0
        await asyncio.sleep(CALL_S)
        end = time.perf_counter() - t0
        self.calls.append((call, start, end))
        return CallTiming(start, start + CALL_S / 2, end, 4)


async def test_every_call_of_a_run_shares_one_trace_id_and_carries_the_type() -> None:
    rec = Recorder()
    a, b = await asyncio.gather(
        run_agent(rec, SHAPE, tag="a", session="s-1"), run_agent(rec, SHAPE, tag="b")
    )
    assert a.trace_id != b.trace_id and len(a.calls) == len(b.calls) == SHAPE.calls == 5
    by_run: dict[str, list[Call]] = {}
    for call, _, _ in rec.calls:
        tid = trace_id_of(call.headers[TRACEPARENT_HEADER])
        assert tid is not None
        by_run.setdefault(tid, []).append(call)
        assert call.headers[WORKFLOW_HEADER] == "triage" and call.max_tokens == 8
    assert {k: len(v) for k, v in by_run.items()} == {a.trace_id: 5, b.trace_id: 5}
    spans = {c.headers[TRACEPARENT_HEADER].split("-")[2] for c in by_run[a.trace_id]}
    assert len(spans) == 5  # each call its own span id, as an instrumented client's
    assert all(c.headers["x-session-id"] == "s-1" for c in by_run[a.trace_id])
    assert all("x-session-id" not in c.headers for c in by_run[b.trace_id])
    assert all("[a step" in c.prompt for c in by_run[a.trace_id])


async def test_fan_outs_go_together_and_tool_time_separates_the_steps() -> None:
    rec = Recorder()
    run = await run_agent(rec, SHAPE)
    first, fan, last = run.calls[0], run.calls[1:4], run.calls[4]
    assert max(c.start_s for c in fan) < min(c.end_s for c in fan)  # all sent before any answer
    assert min(c.start_s for c in fan) >= first.end_s + 0.15
    assert last.start_s >= max(c.end_s for c in fan) + 0.1
    # the run's wall time holds the scripted tool time and each step's call once
    assert run.wall_s >= SHAPE.tool_s + 3 * CALL_S
    assert SHAPE.tool_s == pytest.approx(0.25)


def test_a_traceparent_reads_back_as_its_trace_id() -> None:
    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of(traceparent(tid)) == tid
    assert trace_id_of(f"00-{tid.upper()}-00f067aa0ba902b7-01") == tid
    for bad in (
        None, "", "garbage", f"00-{tid}-00f067aa0ba902b7", f"ff-{tid}-00f067aa0ba902b7-01",
        f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{tid[:-1]}x-00f067aa0ba902b7-01",
        f"00-{tid}0-00f067aa0ba902b7-01", f"00-{tid[:-2]}_6-00f067aa0ba902b7-01",
    ):  # fmt: skip
        assert trace_id_of(bad) is None, bad


def test_a_step_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="bad step"):
        Step("x", 8, fanout=0)
    with pytest.raises(ValueError, match="bad step"):
        Step("x", 8, gap_after_s=-1)
