"""What the gateway adds to a streamed request: direct-to-upstream vs through the gateway (issue 2).

One run, one upstream simulator, three arms interleaved request by request:

- ``direct``: client → simulator;
- ``gateway``: client → ``specshadow serve`` → the same simulator;
- ``relay`` (unless ``--no-relay``): client → ``bench.raw_relay`` (a minimal aiohttp relay, the
  floor for any Python proxy here) → the same simulator.

Run: ``.venv/bin/python -m bench.proxy_overhead [--requests 200] [--concurrency 1,8] [--json F]``.
Exit status: 0 all targets met, 1 a target missed, 2 the setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.analysis import ArmSummary, RequestMetrics, by_arm, minus, ratio, summarize
from bench.client import Arm, chat_body, run_interleaved
from bench.fleet import CLIENT_CPU, Fleet, pin_self, simulator_args
from bench.tables import (
    Check,
    add_common_args,
    load_line,
    machine,
    pinning_line,
    render_checks,
    render_table,
    run_main,
    write_json,
)
from core.stats import percentiles

ADDED_TTFT_P50_MS = 1.0
ADDED_TTFT_P99_MS = 2.0


@dataclass(frozen=True, slots=True)
class Level:
    """Everything measured at one concurrency."""

    concurrency: int
    arms: dict[str, ArmSummary]
    # Per proxy arm: median and p99 over request indices of (proxy ttft − direct ttft).
    paired_ttft_ms: dict[str, tuple[float | None, float | None]]
    checks: tuple[Check, ...]
    requests: dict[str, list[RequestMetrics]]


def paired_ttft_ms(
    direct: Sequence[RequestMetrics], proxy: Sequence[RequestMetrics]
) -> list[float]:
    """Per request index, proxy TTFT − direct TTFT (both arms sent request ``i`` back to back)."""
    d = {m.index: m.ttft_ns for m in direct if m.error is None}
    return [
        (m.ttft_ns - t) / 1e6
        for m in proxy
        if m.error is None and m.ttft_ns is not None and (t := d.get(m.index)) is not None
    ]


def evaluate(concurrency: int, metrics: dict[str, list[RequestMetrics]], *, judged: bool) -> Level:
    arms = {name: summarize(name, ms) for name, ms in metrics.items()}
    direct, gateway = arms["direct"], arms["gateway"]
    paired = {
        name: percentiles(paired_ttft_ms(metrics["direct"], metrics[name]), (50, 99))
        for name in metrics
        if name != "direct"
    }
    checks: tuple[Check, ...] = ()
    if judged:
        checks = (
            Check("added TTFT p50", minus(gateway.ttft.p50_ms, direct.ttft.p50_ms), ADDED_TTFT_P50_MS),
            Check("added TTFT p99", minus(gateway.ttft.p99_ms, direct.ttft.p99_ms), ADDED_TTFT_P99_MS),
            Check("coalesced events via gateway", gateway.coalesced, 0, unit=""),
            Check("stalled events via gateway", gateway.stalled, 0, unit=""),
            Check("errors via gateway", gateway.errors, 0, unit=""),
        )  # fmt: skip
    return Level(concurrency, arms, {k: (v[0], v[1]) for k, v in paired.items()}, checks, metrics)


def added_rows(
    via: str, p: ArmSummary, d: ArmSummary, paired: tuple[float | None, float | None]
) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for label, metric in (
        ("TTFT (Δ of percentiles)", "ttft"),
        ("per-chunk delivery", "delivery"),
        ("chunk gap", "chunk_gap"),
        ("e2e", "e2e"),
    ):
        mine, theirs = getattr(p, metric), getattr(d, metric)
        rows.append(
            (
                via,
                label,
                minus(mine.p50_ms, theirs.p50_ms),
                minus(mine.p99_ms, theirs.p99_ms),
                ratio(mine.p50_ms, theirs.p50_ms),
                ratio(mine.p99_ms, theirs.p99_ms),
            )
        )
        if metric == "ttft":
            rows.append((via, "TTFT (paired per request)", paired[0], paired[1], None, None))
    return rows  # fmt: skip


def render_level(level: Level) -> str:
    a = level.arms
    per_arm = render_table(
        f"Per arm, concurrency {level.concurrency} (ms)",
        ("arm", "reqs", "errors", "ttft p50", "ttft p99", "deliv p50", "deliv p99",
         "gap p50", "gap p99", "e2e p50", "upgap p90", "events", "reads", "coalesced", "stalled"),
        [
            (s.arm, s.requests, s.errors, s.ttft.p50_ms, s.ttft.p99_ms, s.delivery.p50_ms,
             s.delivery.p99_ms, s.chunk_gap.p50_ms, s.chunk_gap.p99_ms, s.e2e.p50_ms,
             s.upstream_gap.p90_ms, s.output_events, s.reads, s.coalesced, s.stalled)
            for s in a.values()
        ],
    )  # fmt: skip
    rows = [
        row
        for via, paired in level.paired_ttft_ms.items()
        for row in added_rows(via, a[via], a["direct"], paired)
    ]
    added = render_table(
        f"Added by each proxy, concurrency {level.concurrency} (proxy − direct, ms; ratio proxy/direct)",
        ("via", "metric", "added p50", "added p99", "ratio p50", "ratio p99"),
        rows,
    )
    parts = [per_arm, "", added]
    if "relay" in a:
        g, r, d = a["gateway"], a["relay"], a["direct"]
        vs = [ratio(minus(g.ttft.p50_ms, d.ttft.p50_ms), minus(r.ttft.p50_ms, d.ttft.p50_ms)),
              ratio(minus(g.ttft.p99_ms, d.ttft.p99_ms), minus(r.ttft.p99_ms, d.ttft.p99_ms))]  # fmt: skip
        parts.append(
            "gateway's added TTFT ÷ raw relay's added TTFT: p50 "
            + " p99 ".join("-" if v is None else f"{v:.2f}×" for v in vs)
            + " (issue 8 aims for ≤ 1.5× and ≤ 2×)"
        )
    if level.checks:
        parts += ["", render_checks(level.checks)]
    return "\n".join(parts)


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("expected e.g. 1 or 1,8")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_overhead", description=__doc__)
    add_common_args(p, requests=200)
    p.add_argument(
        "--concurrency",
        type=parse_levels,
        default=[1],
        help="comma-separated levels, e.g. 1,8; targets are judged at the first",
    )
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="skip the raw aiohttp relay arm (the floor for a Python proxy; bench/raw_relay.py)",
    )
    return p


async def run(args: argparse.Namespace) -> int:
    start = machine()
    print(load_line("start"), flush=True)
    levels: list[Level] = []
    with Fleet(pin=not args.no_pin) as fleet:
        if fleet.pin:
            pin_self(CLIENT_CPU)
        print(pinning_line(fleet.pin), flush=True)
        sim_args = simulator_args(
            mode="plain", prefill_ms=args.prefill_ms, step_ms=args.step_ms, tokens=args.max_tokens
        )
        upstream = await fleet.simulator("upstream", sim_args)
        servers = {"gateway": fleet.gateway("gateway", ["--primary", upstream])}
        if not args.no_relay:
            servers["relay"] = fleet.relay("relay", upstream)
        urls = dict(zip(servers, await asyncio.gather(*servers.values()), strict=True))
        arms = [Arm("direct", upstream + "/v1/chat/completions")]
        arms += [Arm(name, url + "/v1/chat/completions") for name, url in urls.items()]
        body_for = functools.partial(chat_body, max_tokens=args.max_tokens)
        for n, concurrency in enumerate(args.concurrency):
            results = await run_interleaved(
                arms,
                requests=args.requests,
                warmup=args.warmup,
                concurrency=concurrency,
                body_for=body_for,
                timeout_s=args.timeout_s,
            )
            level = evaluate(concurrency, by_arm(results, arms), judged=n == 0)
            levels.append(level)
            print("\n" + render_level(level) + "\n", flush=True)
    print(load_line("end"))
    print(
        f"{args.requests} requests per arm (+{args.warmup} warm-up), {args.max_tokens} tokens each, "
        f"upstream prefill {args.prefill_ms} ms, step {args.step_ms} ms; stop times (s): "
        + ", ".join(f"{k}={v:.2f}" for k, v in fleet.stop_s.items())
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "proxy_overhead",
                "config": {k: v for k, v in vars(args).items() if k != "json"},
                "machine_start": start,
                "machine_end": machine(),
                "pinned": fleet.pin,
                "levels": levels,
            },
        )
    checks = [c for level in levels for c in level.checks]
    return 0 if all(c.passed for c in checks) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
