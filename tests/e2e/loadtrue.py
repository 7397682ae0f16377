"""Ground truth for load-true verdicts: continuous-batching simulators as real processes, a real
gateway process in front, open-loop (Poisson) production traffic — and the truth itself, a direct
A/B of the plain and the speculative engine at the same arrival rate.

The engines (``specshadow simulate --batching continuous``): a 14 ms memory-bound step floor, 1 ms
per verification slot, 32 output tokens, the speculative one drafting 4 tokens at 80 % per-position
acceptance. Measured on the 2-core machine with gamma arrivals of shape 4 (geometric mean of paired
plain/speculative e2e): about 2.2× at 4 requests/s, 1.85× at 10, 1.4× at 16, 0.9× at 19, 0.8× at
20; the speculative engine saturates near 21 requests/s.

The truth (:func:`direct_ab`) sends the *same* arrival schedule and prompts to a plain and a
speculative engine at once, each directly, and pairs the two e2e of each request: the speed-up a
user would see at that rate. The report's estimate comes from what a gateway mirrored; both use
the same statistic (geometric mean of paired ratios).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from core.procs import ChildProcess, free_port, wait_http_ready_async
from loadgen.runner import run_loadgen
from loadgen.trace import TraceRecord, bundled_trace

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 32
ENGINE = [
    "--batching", "continuous", "--step-ms", "14", "--slot-ms", "1", "--prefill-ms", "2",
    "--min-output-tokens", str(TOKENS), "--max-output-tokens", str(TOKENS), "--no-stamps",
]  # fmt: skip
SPECULATIVE = ["--mode", "speculative", "--k", "4", "--acceptance", "0.8"]
_URL = re.compile(r"on (http://[0-9.]+:\d+)")


def rows() -> list[TraceRecord]:
    """The bundled trace's chat rows (text prompts; every answer is TOKENS tokens long)."""
    return [r for r in bundled_trace() if r.category == "chat"]


class Procs:
    """Started processes of one test, all stopped at the end."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[ChildProcess] = []

    def _start(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> ChildProcess:
        proc = ChildProcess(
            [sys.executable, "-m", "specshadow", "--log-level", "WARNING", *argv],
            log_path=self.work / f"{name}.log",
            name=name,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        return proc

    async def simulator(self, name: str, *extra: str) -> str:
        proc = self._start(name, ["simulate", "--port", "0", *ENGINE, *extra])
        for _ in range(300):
            found = _URL.search(proc.log_bytes().decode(errors="replace"))
            if found:
                return found.group(1)
            proc.check_running()
            await asyncio.sleep(0.05)
        raise AssertionError(f"{name} printed no URL:\n{proc.log_tail()}")

    async def gateway(self, policy: str, store: Path, *, load_window_s: float = 5.0) -> str:
        policy_path = self.work / f"{store.stem}.yaml"
        policy_path.write_text(policy)
        port = free_port()
        proc = self._start(
            f"gateway-{store.stem}",
            ["serve", "--port", str(port), "--policy", str(policy_path), "--store", str(store)],
            # Shorter than the 10 s default: a sweep step here lasts seconds, not minutes.
            {"SPECSHADOW_LOAD_WINDOW_S": str(load_window_s), "SPECSHADOW_TELEMETRY": "off"},
        )
        url = f"http://127.0.0.1:{port}"
        await wait_http_ready_async(f"{url}/healthz", proc, 60.0)
        return url

    def stop(self, proc_name_prefix: str | None = None) -> None:
        for proc in reversed(self.procs):
            if proc_name_prefix is None or proc.name.startswith(proc_name_prefix):
                proc.stop()


@asynccontextmanager
async def processes() -> AsyncIterator[Procs]:
    with tempfile.TemporaryDirectory(prefix="specshadow-loadtrue-") as tmp:
        procs = Procs(Path(tmp))
        try:
            yield procs
        finally:
            procs.stop()


# Gamma-distributed gaps (shape 4): open loop, and regular enough that a 10-second phase measures
# the steady state near saturation (Poisson's bursts make the truth itself vary by ±15 % there).
BURSTINESS = 4.0


async def open_loop(base_url: str, rate: float, duration_s: float, *, seed: int) -> list[Any]:
    """Open-loop arrivals at ``rate`` for ``duration_s`` against ``base_url`` (measured results)."""
    results = await run_loadgen(
        f"{base_url}/v1",
        rows(),
        rate_rps=rate,
        burstiness=BURSTINESS,
        duration_s=duration_s,
        model="sim-model",
        max_tokens=TOKENS,
        seed=seed,
        request_timeout_s=120.0,
    )
    return [r for r in results if not r.warmup]


def paired_speedup(plain: Sequence[Any], spec: Sequence[Any], *, skip: float = 0.2) -> float:
    """Geometric mean of plain e2e / speculative e2e, request by request (the first ``skip`` of
    the run left out: the engines start empty)."""
    by_index = {r.index: r for r in spec if r.error is None and r.e2e_s}
    logs = [
        math.log(p.e2e_s / by_index[p.index].e2e_s)
        for p in plain
        if p.error is None and p.e2e_s and p.index in by_index
    ]
    logs = logs[int(len(logs) * skip) :]
    return math.exp(statistics.fmean(logs))


def truth_seed(rate: float) -> int:
    """The arrival schedule's seed for the truth at ``rate`` requests/s."""
    return 100 + round(rate * 100)


async def direct_ab(procs: Procs, rates: Sequence[float], duration_s: float) -> dict[float, float]:
    """The truth: at each rate, the same schedule to a plain and a speculative engine at once."""
    plain = await procs.simulator("truth-plain")
    spec = await procs.simulator("truth-spec", *SPECULATIVE)
    truth = {}
    for rate in rates:
        # Seeded by the rate, not by its place in the list: one rate's schedule (and truth) is the
        # same whichever other rates a test measures beside it.
        seed = truth_seed(rate)
        a, b = await asyncio.gather(
            open_loop(plain, rate, duration_s, seed=seed),
            open_loop(spec, rate, duration_s, seed=seed),
        )
        truth[rate] = paired_speedup(a, b)
    procs.stop("truth-")
    return truth


def policy(
    primary: str,
    candidate: str,
    *,
    ratio: str,
    baseline: str | None = None,
    sweep: str | None = None,
    max_in_flight: int = 256,
) -> str:
    legs = (
        "[{backend: cand, role: candidate}"
        + (", {backend: base, role: baseline}" if baseline else "")
        + "]"
    )
    text = (
        "version: 1\n"
        "backends:\n"
        f"  prim: {{url: '{primary}', kind: sim, replicas: 1}}\n"
        f"  cand: {{url: '{candidate}', kind: sim, replicas: 1}}\n"
        + (f"  base: {{url: '{baseline}', kind: sim, replicas: 1}}\n" if baseline else "")
        + "primary: prim\n"
        f"default:\n  ratio: {ratio}\n  legs: {legs}\n"
        + (f"  sweep: {sweep}\n" if sweep else "")
        + f"budgets: {{max_in_flight: {max_in_flight}}}\n"
        "timeouts: {connect_s: 2, idle_s: 60, total_s: 120}\n"
    )
    return text


async def mirrored(
    procs: Procs,
    *,
    rate: float,
    duration_s: float,
    ratio: str,
    store: Path,
    baseline: bool = False,
    sweep: str | None = None,
    max_in_flight: int = 256,
    seed: int = 7,
) -> None:
    """Production traffic at ``rate`` through a gateway that mirrors ``ratio`` to a candidate."""
    async with AsyncExitStack():
        name = store.stem
        primary = await procs.simulator(f"{name}-primary")
        candidate = await procs.simulator(f"{name}-candidate", *SPECULATIVE)
        base = await procs.simulator(f"{name}-baseline") if baseline else None
        gateway = await procs.gateway(
            policy(
                primary,
                candidate,
                ratio=ratio,
                baseline=base,
                sweep=sweep,
                max_in_flight=max_in_flight,
            ),
            store,
        )
        await open_loop(gateway, rate, duration_s, seed=seed)
        await asyncio.sleep(1.0)
        procs.stop(f"gateway-{name}")  # flushes the store
        procs.stop(f"{name}-")
