"""``specshadow demo``: the whole loop on one machine, with embedded defaults and no configuration.

Starts three simulated backends — a plain primary, a speculative candidate and a plain baseline —
and the gateway with a policy that mirrors a share of traffic, replays the bundled trace through
the gateway with the official ``openai`` SDK, prints what the gateway measured per request and a
summary per role, and stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from importlib import resources
from typing import Any

import openai
from aiohttp import web

from gateway import jsonx
from gateway.app import create_app
from gateway.exchange import Exchange, LegResult
from gateway.settings import Settings
from gateway.sinks import MemorySink
from gateway.stats import percentile
from policies.compile import parse_policy
from policies.store import PolicyStore
from simulator.app import run_simulator
from simulator.config import SimConfig

MODEL = "sim-model"
# Per-category acceptance of the simulated candidate (conditional per draft position).
CANDIDATE_ACCEPTANCE = {"chat": 0.7, "multi_turn": 0.6, "structured_output": 0.85}


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="run the whole shadow-testing loop on simulated backends"
    )
    p.add_argument("--requests", type=int, default=40, help="how many trace rows to replay")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--ratio", type=float, default=0.8, help="share of requests mirrored")
    p.add_argument("--trace", default=None, help="JSONL trace (default: the bundled one)")
    p.set_defaults(func=lambda args: asyncio.run(run_demo(args)))


def bundled_trace() -> list[dict[str, Any]]:
    text = resources.files("loadgen").joinpath("data/demo_trace.jsonl").read_text("utf-8")
    return [jsonx.loads(line) for line in text.splitlines() if line.strip()]


def read_trace(path: str | None) -> list[dict[str, Any]]:
    if path is None:
        return bundled_trace()
    with open(path, "rb") as f:
        return [jsonx.loads(line) for line in f if line.strip()]


def demo_policy(primary: str, candidate: str, baseline: str, ratio: float) -> PolicyStore:
    raw = {
        "version": 1,
        "backends": {
            "primary": {"url": primary, "kind": "sim"},
            "candidate": {"url": candidate, "kind": "sim"},
            "baseline": {"url": baseline, "kind": "sim"},
        },
        "primary": "primary",
        "default": {
            "ratio": ratio,
            "legs": [
                {"backend": "candidate", "role": "candidate"},
                {"backend": "baseline", "role": "baseline"},
            ],
        },
    }
    return PolicyStore(parse_policy(raw, source="demo (embedded)"))


async def run_demo(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)[: args.requests]
    started = time.perf_counter()
    plain = SimConfig(model=MODEL, prefill_base_s=0.03, step_s=0.008)
    speculative = SimConfig(
        model=MODEL,
        mode="speculative",
        num_speculative_tokens=4,
        acceptance=0.7,
        category_acceptance=CANDIDATE_ACCEPTANCE,
        prefill_base_s=0.03,
        step_s=0.008,
        spec_step_overhead_s=0.002,
    )
    async with AsyncExitStack() as stack:
        primary = await stack.enter_async_context(run_simulator(plain))
        candidate = await stack.enter_async_context(run_simulator(speculative))
        baseline = await stack.enter_async_context(run_simulator(plain))
        sink = MemorySink()
        store = demo_policy(primary.base_url, candidate.base_url, baseline.base_url, args.ratio)
        app = create_app(Settings(primary_url=None), sink=sink, policy=store)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        gateway_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        print(f"primary   (plain)        {primary.base_url}")
        print(f"candidate (speculative)  {candidate.base_url}")
        print(f"baseline  (plain)        {baseline.base_url}")
        print(f"gateway                  {gateway_url}  (mirroring {args.ratio:.0%})")
        print()
        await replay(gateway_url, rows, args.concurrency)
        # Let the last shadow legs finish and their exchanges assemble.
        deadline = time.perf_counter() + 30
        while len(sink.exchanges) < len(rows) and time.perf_counter() < deadline:  # noqa: ASYNC110 — a bounded poll of a plain deque
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        exchanges = list(sink.exchanges)
    print_table(exchanges)
    print_summary(exchanges)
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0


async def replay(gateway_url: str, rows: Sequence[dict[str, Any]], concurrency: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="sk-demo", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, row: dict[str, Any]) -> None:
        body = {k: v for k, v in row.items() if k not in ("category", "meta", "model")}
        async with gate:
            stream = await client.chat.completions.create(
                model=MODEL,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={
                    "x-request-id": f"demo-{i:04d}",
                    "x-specshadow-category": str(row.get("category", "chat")),
                },
                **body,
            )
            async for _chunk in stream:
                pass

    try:
        await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    finally:
        await client.close()


def _ms(value: float | None) -> str:
    return f"{value * 1000:7.1f}" if value is not None else "      –"


def _tpe(leg: LegResult | None) -> str:
    if leg is None or leg.recording is None or leg.recording.timings.tokens_per_event is None:
        return "   –"
    return f"{leg.recording.timings.tokens_per_event:4.2f}"


def _role(exchange: Exchange, role: str) -> LegResult | None:
    return next((leg for leg in exchange.legs if leg.role == role), None)


def print_table(exchanges: Sequence[Exchange]) -> None:
    print(
        f"{'request':<10} {'category':<18} {'ttft ms':>7} {'tpot ms':>7} {'tok/ev':>6}   "
        f"{'cand ttft':>9} {'cand tpot':>9} {'cand tok/ev':>11}"
    )
    for ex in sorted(exchanges, key=lambda e: e.request_id):
        p = ex.primary.recording
        cand = _role(ex, "candidate")
        c = cand.recording if cand is not None else None
        print(
            f"{ex.request_id:<10} {ex.category or '-':<18} "
            f"{_ms(p.timings.ttft_s if p else None)} {_ms(p.timings.tpot_s if p else None)} "
            f"{_tpe(ex.primary):>6}   "
            f"{_ms(c.timings.ttft_s if c else None):>9} {_ms(c.timings.tpot_s if c else None):>9} "
            f"{_tpe(cand):>11}"
        )


def print_summary(exchanges: Sequence[Exchange]) -> None:
    print("\nper role (medians over the requests each role served)")
    print(f"{'role':<10} {'n':>4} {'ttft ms':>8} {'tpot ms':>8} {'e2e ms':>8} {'tok/ev':>7}")
    for role in ("primary", "candidate", "baseline"):
        legs = [leg for ex in exchanges for leg in ex.legs if leg.role == role and leg.recording]
        recs = [leg.recording for leg in legs if leg.recording is not None]

        def med(values: list[float | None]) -> float | None:
            return percentile([v for v in values if v is not None], 50)

        ttft = med([r.timings.ttft_s for r in recs])
        tpot = med([r.timings.tpot_s for r in recs])
        e2e = med([r.timings.e2e_s for r in recs])
        tpe = med([r.timings.tokens_per_event for r in recs])
        print(
            f"{role:<10} {len(recs):>4} {_ms(ttft):>8} {_ms(tpot):>8} {_ms(e2e):>8} "
            f"{tpe if tpe is not None else float('nan'):>7.2f}"
        )
    mirrored = [ex for ex in exchanges if ex.shadows]
    ratios = []
    for ex in mirrored:
        cand = _role(ex, "candidate")
        p, c = ex.primary.recording, cand.recording if cand else None
        if p and c and p.timings.tpot_s and c.timings.tpot_s:
            ratios.append(p.timings.tpot_s / c.timings.tpot_s)
    print(f"\nmirrored {len(mirrored)} of {len(exchanges)} requests")
    if ratios:
        print(
            f"paired TPOT speedup of the candidate (primary/candidate), median: "
            f"{percentile(ratios, 50):.2f}x"
        )
