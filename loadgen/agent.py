"""Agent-shaped runs: several LLM calls per application run, with known tool and retrieval time
between them (I/O shell).

A :class:`Workflow` is a list of :class:`Step`\\ s; each step makes ``fanout`` calls at once and
waits for all of them, then spends ``gap_after_s`` outside the LLM (a tool, a retrieval) before
the next step. Every call of one run carries the same W3C ``traceparent`` trace id (a fresh span
id per call, as an instrumented application's client spans would), the workflow's name in
``x-specshadow-workflow`` and, when asked, a session header — what the gateway records to group
calls into runs and runs into types (docs/workflows.md).

The client is whatever sends one chat call: :func:`sdk_sender` wraps the official ``openai`` SDK's
async client (duck-typed: this package does not import the SDK), and any other
``Sender`` will do. :func:`run_agent` times the run on the client's clock (``time.perf_counter``):
its wall time, and per call its start, first content and end — the ground truth a projected
speed-up is checked against.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from core.wire import TRACEPARENT_HEADER, WORKFLOW_HEADER

__all__ = [
    "AgentRun",
    "Call",
    "CallTiming",
    "Sender",
    "Step",
    "Workflow",
    "new_trace_id",
    "run_agent",
    "sdk_sender",
    "traceparent",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a run: ``fanout`` calls at once, then ``gap_after_s`` of tool time."""

    prompt: str
    max_tokens: int
    fanout: int = 1
    gap_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fanout < 1 or self.max_tokens < 1 or self.gap_after_s < 0:
            raise ValueError(f"bad step: {self!r}")


@dataclass(frozen=True, slots=True)
class Workflow:
    """A named run shape; ``gap_before_s``: retrieval before the first call."""

    name: str
    steps: tuple[Step, ...]
    gap_before_s: float = 0.0

    @property
    def calls(self) -> int:
        return sum(s.fanout for s in self.steps)

    @property
    def tool_s(self) -> float:
        """The run's time outside the LLM, as scripted."""
        return self.gap_before_s + sum(s.gap_after_s for s in self.steps)


@dataclass(frozen=True, slots=True)
class Call:
    """One call to send: its prompt, its token budget and the headers that place it in a run."""

    prompt: str
    max_tokens: int
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class CallTiming:
    """One call on the client's clock, in seconds from the run's start: sent, first content
    (None: none came), last byte; ``tokens``: content chunks received."""

    start_s: float
    first_s: float | None
    end_s: float
    chunks: int


@dataclass(frozen=True, slots=True)
class AgentRun:
    """One run as the client saw it: ``wall_s`` from its start to its end (tool time included)."""

    workflow: str
    trace_id: str
    session: str | None
    wall_s: float
    calls: tuple[CallTiming, ...]


Sender = Callable[[Call, float], Awaitable[CallTiming]]
"""Sends one call; the float is the run's start on ``time.perf_counter``."""


def new_trace_id() -> str:
    return secrets.token_hex(16)


def traceparent(trace_id: str) -> str:
    """A sampled W3C ``traceparent`` in ``trace_id`` with a fresh span id."""
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


def sdk_sender(client: Any, model: str, **create: Any) -> Sender:
    """A :data:`Sender` over an ``openai.AsyncOpenAI`` client: a streamed chat completion; the
    first content is the first chunk with text. ``create``: more arguments for
    ``chat.completions.create`` (``temperature``, ``extra_body``, …)."""

    async def send(call: Call, t0: float) -> CallTiming:
        start = time.perf_counter() - t0
        first: float | None = None
        chunks = 0
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": call.prompt}],
            max_tokens=call.max_tokens,
            stream=True,
            extra_headers=dict(call.headers),
            **create,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
        return CallTiming(start, first, time.perf_counter() - t0, chunks)

    return send


async def run_agent(
    send: Sender,
    workflow: Workflow,
    *,
    trace_id: str | None = None,
    session: str | None = None,
    session_header: str = "x-session-id",
    type_header: str = WORKFLOW_HEADER,
    tag: str = "",
) -> AgentRun:
    """Run ``workflow`` once through ``send``: each step's calls at once, then its tool gap.
    ``tag`` is appended to every prompt (a run's own prompts; the same tag gives the same
    prompts, so a run can be replayed against another backend)."""
    tid = trace_id or new_trace_id()
    base = {type_header: workflow.name} | ({session_header: session} if session else {})
    t0 = time.perf_counter()
    await asyncio.sleep(workflow.gap_before_s)
    timings: list[CallTiming] = []
    for i, step in enumerate(workflow.steps):
        calls = [
            Call(
                f"{step.prompt} [{tag} step {i} call {j}]",
                step.max_tokens,
                {**base, TRACEPARENT_HEADER: traceparent(tid)},
            )
            for j in range(step.fanout)
        ]
        timings += await asyncio.gather(*(send(c, t0) for c in calls))
        await asyncio.sleep(step.gap_after_s)
    return AgentRun(workflow.name, tid, session, time.perf_counter() - t0, tuple(timings))
