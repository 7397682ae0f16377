"""Does a shadow slow the primary? Primary latency with shadowing off vs on, healthy or not (issue 3).

One run, one primary simulator, and one gateway process per arm in front of it:

- ``off``: no shadow (the baseline every ratio divides by);
- ``off-copy``: a second, identical gateway with no shadow — its ratios are the run's noise floor
  (an A/A test), shown but not judged;
- ``shadow-100``: every request mirrored to a healthy speculative simulator;
- ``shadow-slow``: mirrored to a speculative simulator ``--slow-factor`` × slower per step;
- ``shadow-hung``: mirrored to a simulator that never sends headers;
- ``shadow-refusing``: mirrored to a closed port.

Requests are interleaved across the arms (request ``i`` goes to every arm before ``i + 1``).

Run: ``.venv/bin/python -m bench.shadow_isolation [--requests 100] [--arms off,shadow-hung]``.
Exit status: 0 all targets met, 1 a target missed, 2 the setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.analysis import ArmSummary, RequestMetrics, by_arm, ratio, summarize
from bench.client import Arm, chat_body, get_json, run_interleaved
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
from core.procs import free_port

BASELINE = "off"
NOISE_FLOOR = "off-copy"
ALL_ARMS = ("off", NOISE_FLOOR, "shadow-100", "shadow-slow", "shadow-hung", "shadow-refusing")
P50_RATIO_MAX = 1.05
P99_RATIO_MAX = 1.10


@dataclass(frozen=True, slots=True)
class ArmResult:
    summary: ArmSummary
    text_mismatches: int  # requests whose text differs from the ``off`` arm's for the same prompt
    ratios: dict[str, float | None]  # "ttft_p50" … "e2e_p99": this arm / off
    admin: Any  # the gateway's /admin/shadow at the end of the run


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ALL_ARMS))
    if unknown or BASELINE not in arms:
        raise argparse.ArgumentTypeError(
            f"arms from {ALL_ARMS}, including {BASELINE!r}; got {text!r}"
        )
    return [a for a in ALL_ARMS if a in arms]


def ratios_vs(s: ArmSummary, base: ArmSummary) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for metric in ("ttft", "chunk_gap", "e2e"):
        mine, theirs = getattr(s, metric), getattr(base, metric)
        out[f"{metric}_p50"] = ratio(mine.p50_ms, theirs.p50_ms)
        out[f"{metric}_p99"] = ratio(mine.p99_ms, theirs.p99_ms)
    return out


def text_mismatches(mine: Sequence[RequestMetrics], base: Sequence[RequestMetrics]) -> int:
    expected = {m.index: m.text for m in base if m.error is None}
    return sum(
        1 for m in mine if m.error is None and m.index in expected and m.text != expected[m.index]
    )


def checks_for(name: str, r: ArmResult) -> list[Check]:
    checks = [
        Check(
            f"{name} {key} ratio",
            value,
            P50_RATIO_MAX if key.endswith("p50") else P99_RATIO_MAX,
            "",
        )
        for key, value in r.ratios.items()
    ]
    checks.append(Check(f"{name} primary errors", r.summary.errors, 0, ""))
    checks.append(Check(f"{name} primary text changed", r.text_mismatches, 0, ""))
    return checks


def verdict(name: str, r: ArmResult) -> str:
    if name == NOISE_FLOOR:
        return "A/A (noise)"
    return "PASS" if all(c.passed for c in checks_for(name, r)) else "FAIL"


def render(results: dict[str, ArmResult]) -> str:
    rows = [
        (name, s.requests, s.errors, r.text_mismatches, s.ttft.p50_ms, s.ttft.p99_ms,
         s.chunk_gap.p50_ms, s.chunk_gap.p99_ms, s.e2e.p50_ms, s.e2e.p99_ms,
         s.delivery.p50_ms, s.delivery.p99_ms, s.stalled, s.coalesced)
        for name, r in results.items()
        for s in [r.summary]
    ]  # fmt: skip
    latency = render_table(
        "Primary latency per arm (ms, client-side)",
        ("arm", "reqs", "errors", "changed", "ttft p50", "ttft p99", "gap p50", "gap p99",
         "e2e p50", "e2e p99", "deliv p50", "deliv p99", "stalled", "coalesced"),
        rows,
    )  # fmt: skip
    ratio_rows = [
        (name, *r.ratios.values(), verdict(name, r))
        for name, r in results.items()
        if name != BASELINE
    ]
    ratios = render_table(
        f"Ratios vs {BASELINE!r} (targets: p50 ≤ {P50_RATIO_MAX}, p99 ≤ {P99_RATIO_MAX}, "
        "zero primary errors, text unchanged)",
        ("arm", "ttft p50", "ttft p99", "gap p50", "gap p99", "e2e p50", "e2e p99", "verdict"),
        ratio_rows,
    )
    return "\n\n".join([latency, ratios, render_counters(results)])


def render_counters(results: dict[str, ArmResult]) -> str:
    rows: list[tuple[Any, ...]] = []
    for name, r in results.items():
        admin = r.admin if isinstance(r.admin, dict) else {}
        breakers = ",".join(f"{k}={v}" for k, v in (admin.get("breakers") or {}).items()) or "-"
        rows.append((name, admin.get("in_flight"), breakers, "", ""))
        for c in admin.get("counts") or ():
            label = c["event"] + (f" ({c['reason']})" if c.get("reason") else "")
            rows.append(("", "", "", f"{c['role']}/{c['backend']}: {label}", c["count"]))
    return render_table(
        "Gateway /admin/shadow at the end (breaker 0 closed, 1 open, 2 half-open)",
        ("arm", "in_flight", "breakers", "counter", "count"),
        rows,
    )


async def start_arms(fleet: Fleet, args: argparse.Namespace) -> dict[str, str]:
    """Start the primary, the shadow upstreams the arms need, and one gateway per arm."""
    sim = functools.partial(simulator_args, prefill_ms=args.prefill_ms, tokens=args.max_tokens)
    shadow_sims = {
        "shadow-100": sim(mode="speculative", step_ms=args.step_ms),
        "shadow-slow": sim(mode="speculative", step_ms=args.step_ms * args.slow_factor),
        "shadow-hung": sim(mode="speculative", step_ms=args.step_ms, fault="hang_before_headers"),
    }
    wanted = {a: s for a, s in shadow_sims.items() if a in args.arms}
    urls = await asyncio.gather(
        fleet.simulator("primary", sim(mode="plain", step_ms=args.step_ms)),
        *(fleet.simulator(f"upstream-{a}", s) for a, s in wanted.items()),
    )
    primary, shadow_urls = urls[0], dict(zip(wanted, urls[1:], strict=True))
    # Nothing listens there: the port was free a moment ago and is closed again.
    shadow_urls["shadow-refusing"] = f"http://127.0.0.1:{free_port()}"
    gateways = await asyncio.gather(
        *(
            fleet.gateway(
                f"gateway-{a}",
                ["--primary", primary]
                + (
                    []
                    if a in (BASELINE, NOISE_FLOOR)
                    else ["--shadow", shadow_urls[a], "--shadow-ratio", "1.0"]
                ),
            )
            for a in args.arms
        )
    )
    return dict(zip(args.arms, gateways, strict=True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.shadow_isolation", description=__doc__)
    add_common_args(p, requests=100)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (all arms)")
    p.add_argument("--slow-factor", type=float, default=5.0, help="shadow-slow step multiplier")
    p.add_argument(
        "--arms", type=parse_arms, default=list(ALL_ARMS), help="comma-separated subset; needs off"
    )
    return p


async def run(args: argparse.Namespace) -> int:
    start = machine()
    print(load_line("start"), flush=True)
    with Fleet(pin=not args.no_pin) as fleet:
        if fleet.pin:
            pin_self(CLIENT_CPU)
        print(pinning_line(fleet.pin), flush=True)
        gateways = await start_arms(fleet, args)
        arms = [Arm(a, url + "/v1/chat/completions") for a, url in gateways.items()]
        raw = await run_interleaved(
            arms,
            requests=args.requests,
            warmup=args.warmup,
            concurrency=args.concurrency,
            body_for=functools.partial(chat_body, max_tokens=args.max_tokens),
            timeout_s=args.timeout_s,
        )
        admin = await asyncio.gather(
            *(get_json(url + "/admin/shadow") for url in gateways.values())
        )
    metrics = by_arm(raw, arms)
    base = summarize(BASELINE, metrics.get(BASELINE, []))
    results: dict[str, ArmResult] = {}
    for (name, _url), counters in zip(gateways.items(), admin, strict=True):
        mine = metrics.get(name, [])
        s = summarize(name, mine)
        results[name] = ArmResult(
            s, text_mismatches(mine, metrics.get(BASELINE, [])), ratios_vs(s, base), counters
        )
    print("\n" + render(results) + "\n")
    checks = [
        c
        for name, r in results.items()
        if name not in (BASELINE, NOISE_FLOOR)
        for c in checks_for(name, r)
    ]
    failed = [c for c in checks if not c.passed]
    if failed:
        print(render_checks(failed) + "\n")
    print(load_line("end"))
    print(
        f"{args.requests} requests per arm (+{args.warmup} warm-up), {args.max_tokens} tokens each, "
        f"primary prefill {args.prefill_ms} ms, step {args.step_ms} ms, concurrency "
        f"{args.concurrency}; gateway stop times (s): "
        + ", ".join(f"{k}={v:.2f}" for k, v in fleet.stop_s.items() if k.startswith("gateway"))
        + (f"; needed SIGKILL: {', '.join(fleet.killed)}" if fleet.killed else "")
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "shadow_isolation",
                "config": {k: v for k, v in vars(args).items() if k != "json"},
                "machine_start": start,
                "machine_end": machine(),
                "pinned": fleet.pin,
                "arms": results,
                "checks": checks,
                "stop_s": fleet.stop_s,
                "killed": fleet.killed,
                "requests": metrics,
            },
        )
    return 0 if not failed else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
