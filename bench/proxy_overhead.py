"""What the gateway adds to a streamed request: direct-to-upstream vs through the gateway (issue 2).

One run, one upstream simulator, two arms interleaved request by request:

- ``direct``: client → simulator;
- ``gateway``: client → ``specshadow serve`` → the same simulator.

Run: ``.venv/bin/python -m bench.proxy_overhead [--requests 200] [--concurrency 1,8] [--json F]``.
Exit status: 0 all targets met, 1 a target missed, 2 the setup failed.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import (
    CLIENT_CPU,
    Arm,
    ArmSummary,
    Check,
    Fleet,
    RequestMetrics,
    add_common_args,
    by_arm,
    chat_body,
    load_line,
    machine,
    minus,
    pin_self,
    pinning_line,
    ratio,
    render_checks,
    render_table,
    run_interleaved,
    run_main,
    simulator_args,
    summarize,
    write_json,
)
from gateway.stats import percentiles

ARMS = ("direct", "gateway")
ADDED_TTFT_P50_MS = 1.0
ADDED_TTFT_P99_MS = 2.0


@dataclass(frozen=True, slots=True)
class Level:
    """Everything measured at one concurrency."""

    concurrency: int
    arms: dict[str, ArmSummary]
    paired_ttft_p50_ms: float | None  # median over requests of (gateway − direct) for the same i
    paired_ttft_p99_ms: float | None
    checks: tuple[Check, ...]
    requests: dict[str, list[RequestMetrics]]


def paired_ttft_ms(
    direct: Sequence[RequestMetrics], gateway: Sequence[RequestMetrics]
) -> list[float]:
    """Per request index, gateway TTFT − direct TTFT (both arms sent request ``i`` back to back)."""
    d = {m.index: m.ttft_ns for m in direct if m.error is None}
    return [
        (m.ttft_ns - t) / 1e6
        for m in gateway
        if m.error is None and m.ttft_ns is not None and (t := d.get(m.index)) is not None
    ]


def evaluate(concurrency: int, metrics: dict[str, list[RequestMetrics]], *, judged: bool) -> Level:
    arms = {name: summarize(name, metrics.get(name, [])) for name in ARMS}
    direct, gateway = arms["direct"], arms["gateway"]
    p50, p99 = percentiles(
        paired_ttft_ms(metrics.get("direct", []), metrics.get("gateway", [])), (50, 99)
    )
    checks: tuple[Check, ...] = ()
    if judged:
        checks = (
            Check(
                "added TTFT p50", minus(gateway.ttft.p50_ms, direct.ttft.p50_ms), ADDED_TTFT_P50_MS
            ),
            Check(
                "added TTFT p99", minus(gateway.ttft.p99_ms, direct.ttft.p99_ms), ADDED_TTFT_P99_MS
            ),
            Check("coalesced events via gateway", gateway.coalesced, 0, unit=""),
            Check("stalled events via gateway", gateway.stalled, 0, unit=""),
            Check("errors via gateway", gateway.errors, 0, unit=""),
        )
    return Level(concurrency, arms, p50, p99, checks, metrics)


def render_level(level: Level) -> str:
    a = level.arms
    per_arm = render_table(
        f"Per arm, concurrency {level.concurrency} (ms)",
        ("arm", "reqs", "errors", "ttft p50", "ttft p99", "deliv p50", "deliv p99",
         "gap p50", "gap p99", "e2e p50", "events", "reads", "coalesced", "stalled"),
        [
            (s.arm, s.requests, s.errors, s.ttft.p50_ms, s.ttft.p99_ms, s.delivery.p50_ms,
             s.delivery.p99_ms, s.chunk_gap.p50_ms, s.chunk_gap.p99_ms, s.e2e.p50_ms,
             s.output_events, s.reads, s.coalesced, s.stalled)
            for s in a.values()
        ],
    )  # fmt: skip
    d, g = a["direct"], a["gateway"]
    rows: list[tuple[Any, ...]] = [
        ("TTFT (Δ of percentiles)", minus(g.ttft.p50_ms, d.ttft.p50_ms),
         minus(g.ttft.p99_ms, d.ttft.p99_ms), ratio(g.ttft.p50_ms, d.ttft.p50_ms),
         ratio(g.ttft.p99_ms, d.ttft.p99_ms)),
        ("TTFT (paired per request)", level.paired_ttft_p50_ms, level.paired_ttft_p99_ms, None, None),
        ("per-chunk delivery", minus(g.delivery.p50_ms, d.delivery.p50_ms),
         minus(g.delivery.p99_ms, d.delivery.p99_ms), ratio(g.delivery.p50_ms, d.delivery.p50_ms),
         ratio(g.delivery.p99_ms, d.delivery.p99_ms)),
        ("chunk gap", minus(g.chunk_gap.p50_ms, d.chunk_gap.p50_ms),
         minus(g.chunk_gap.p99_ms, d.chunk_gap.p99_ms), ratio(g.chunk_gap.p50_ms, d.chunk_gap.p50_ms),
         ratio(g.chunk_gap.p99_ms, d.chunk_gap.p99_ms)),
        ("e2e", minus(g.e2e.p50_ms, d.e2e.p50_ms), minus(g.e2e.p99_ms, d.e2e.p99_ms),
         ratio(g.e2e.p50_ms, d.e2e.p50_ms), ratio(g.e2e.p99_ms, d.e2e.p99_ms)),
    ]  # fmt: skip
    added = render_table(
        f"Added by the gateway, concurrency {level.concurrency} (gateway − direct, ms; ratio g/d)",
        ("metric", "added p50", "added p99", "ratio p50", "ratio p99"),
        rows,
    )
    parts = [per_arm, "", added]
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
        gateway = await fleet.gateway("gateway", ["--primary", upstream])
        arms = [
            Arm("direct", upstream + "/v1/chat/completions"),
            Arm("gateway", gateway + "/v1/chat/completions"),
        ]
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
            level = evaluate(concurrency, by_arm(results), judged=n == 0)
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
