"""A continuous-batching engine: every running request advances one step per engine step, and a
step's time grows with the batch — the ground truth that makes speculation's load dependence real.

One engine per simulated server (``SimConfig.batching == "continuous"``) runs as a tracked task.
Each engine step:

1. admits waiting requests into the batch (FIFO, at most ``max_num_seqs`` running); a request
   admitted in a step is prefilled in it (``prefill_base_s + prefill_per_token_s × prompt``) and
   emits its first token at the step's end;
2. takes ``step_s + slot_s × slots + draft_s × drafting + spec_step_overhead_s`` seconds, where
   ``slots`` counts the verification positions of every decoding request (1 for a plain step, the
   drafted tokens + 1 for a speculative one) and ``drafting`` the requests whose proposer drafted
   (a draft model's own cost) — a memory-bound floor plus a compute-bound slope;
3. emits, for every request in the batch, the tokens of its next planned step (the same
   :class:`~simulator.plan.Plan` — text, drafts, acceptance — as the independent mode; only the
   timing comes from the batch).

So at a low arrival rate a speculative server emits several tokens per ~``step_s`` and wins; at a
high one each step costs ``k + 1`` slots per request and it loses, and past its capacity its queue
grows. Steps are scheduled on absolute deadlines (``perf_counter_ns``), so sleep overshoot does not
accumulate. The engine never waits for a client: each request's tokens go to its own queue, and
its handler writes them at the pace its client reads.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from core.tasks import TaskSet
from simulator.acceptance import Step
from simulator.config import SimConfig
from simulator.metrics import SimMetrics
from simulator.plan import Plan
from simulator.state import RequestRecord

# (index, start, end, step) of one emitted step; None: the engine dropped the request (shutdown).
Emitted = tuple[int, int, int, Step] | None


@dataclass(slots=True)
class _Sequence:
    plan: Plan
    record: RequestRecord
    out: asyncio.Queue[Emitted] = field(default_factory=asyncio.Queue)
    index: int = 0  # next plan step
    pos: int = 0  # tokens emitted so far
    admitted: bool = False
    prev_ns: int = 0
    kv_tokens: int = 0

    @property
    def next_step(self) -> Step:
        return self.plan.steps[self.index]

    @property
    def done(self) -> bool:
        return self.index >= len(self.plan.steps)


class BatchEngine:
    """The engine of one simulated server in continuous-batching mode (see the module doc)."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._work = asyncio.Event()
        self._tasks = TaskSet()
        self._loop: asyncio.Task[None] | None = None
        self.steps = 0  # engine steps taken (for tests)

    @property
    def batch(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        if self._loop is None:
            self._loop = self._tasks.spawn(self._run(), name="sim-batch-engine")

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await self._tasks.drain(1.0)
            self._loop = None
        for seq in [*self._waiting, *self._running]:
            seq.out.put_nowait(None)

    async def submit(self, plan: Plan, record: RequestRecord) -> asyncio.Queue[Emitted]:
        """Queue one request; its steps arrive on the returned queue as the engine emits them."""
        seq = _Sequence(plan, record, prev_ns=record.arrival_ns, kv_tokens=plan.prompt_tokens)
        self.metrics.queued()
        if not plan.steps:
            seq.out.put_nowait(None)
            self.metrics.waiting.dec()
            return seq.out
        self._waiting.append(seq)
        self._work.set()
        self.start()
        return seq.out

    def abandon(self, queue: asyncio.Queue[Emitted]) -> None:
        """The request's client left: take it out of the batch (or the queue)."""
        for seq in list(self._waiting):
            if seq.out is queue:
                self._waiting.remove(seq)
                self.metrics.waiting.dec()
        for seq in list(self._running):
            if seq.out is queue:
                self._finish(seq, completed=False)

    # -- the loop ----------------------------------------------------------------------------

    def step_seconds(self, admitted: list[_Sequence]) -> float:
        """The duration of the next engine step for the current batch (the cost model)."""
        c = self.config
        slots = drafting = 0
        for seq in self._running:
            if seq in admitted:
                continue
            step = seq.next_step
            slots += step.drafted + 1
            drafting += step.drafted > 0
        prefill = sum(
            c.prefill_base_s + c.prefill_per_token_s * s.plan.prompt_tokens for s in admitted
        )
        overhead = c.spec_step_overhead_s if c.speculative and drafting else 0.0
        return c.step_s + c.step_slot_s * slots + c.draft_s * drafting + overhead + prefill

    async def _run(self) -> None:
        target_ns = time.perf_counter_ns()
        while True:
            if not self._running and not self._waiting:
                self._work.clear()
                await self._work.wait()
                target_ns = time.perf_counter_ns()
            admitted: list[_Sequence] = []
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._waiting.popleft()
                seq.admitted = True
                seq.record.started_ns = time.perf_counter_ns()
                self.metrics.started(
                    (seq.record.started_ns - seq.record.arrival_ns) / 1e9, seq.plan.prompt_tokens
                )
                self._running.append(seq)
                admitted.append(seq)
            cost_s = self.step_seconds(admitted)
            target_ns += int(cost_s * 1e9)
            now = time.perf_counter_ns()
            if target_ns > now:
                await asyncio.sleep((target_ns - now) / 1e9)
            else:
                target_ns = now  # fell behind (a busy host): do not burst to catch up
            self.steps += 1
            now = time.perf_counter_ns()
            for seq in list(self._running):
                self._emit(seq, now, cost_s)

    def _emit(self, seq: _Sequence, now_ns: int, cost_s: float) -> None:
        step = seq.next_step
        record = seq.record
        record.step_ns.append(now_ns)
        record.step_cost_s.append(cost_s)
        if seq.index == 0:
            record.first_token_ns = now_ns
        record.last_token_ns = now_ns
        self.metrics.step(step, first=seq.index == 0, elapsed_s=(now_ns - seq.prev_ns) / 1e9)
        seq.prev_ns = now_ns
        seq.kv_tokens += step.emitted
        start, end = seq.pos, seq.pos + step.emitted
        seq.out.put_nowait((seq.index, start, end, step))
        seq.index += 1
        seq.pos = end
        if seq.done:
            self._finish(seq, completed=True)

    def _finish(self, seq: _Sequence, *, completed: bool) -> None:
        if seq in self._running:
            self._running.remove(seq)
        record = seq.record
        e2e_s = None
        if completed and record.last_token_ns is not None:
            e2e_s = (record.last_token_ns - record.arrival_ns) / 1e9
        reason = "stop" if seq.plan.finish_reason == "tool_calls" else seq.plan.finish_reason
        self.metrics.finished(
            kv_tokens=seq.kv_tokens, finish_reason=reason if completed else None, e2e_s=e2e_s
        )
        if not completed:
            seq.out.put_nowait(None)
