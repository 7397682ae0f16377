"""The performance suite's phases (issue 8): each starts its own fleet, measures, and judges.

A phase owns its processes (a :class:`~bench.fleet.Fleet`), so processes of one phase never sit
on the gateway's core during another. Every phase returns a :class:`Phase`: rendered tables,
the targets it judges (:class:`~bench.tables.Check`) and its numbers for ``--json``.

Arms (each a real process on the gateway's core, except ``direct``):

- ``direct``: client → simulator;
- ``relay``: ``bench.raw_relay`` (the floor for a Python proxy);
- ``specshadow``: ``specshadow serve --primary URL`` as shipped (telemetry on: metrics and spans
  recorded, nothing exported);
- ``shadow-100``: the same with ``--shadow URL --shadow-ratio 1`` (a speculative simulator);
- ``telemetry-off``: the same as ``specshadow`` with ``SPECSHADOW_TELEMETRY=off``;
- ``gil-0.5ms``: the same with ``SPECSHADOW_GIL_SWITCH_INTERVAL_S=0.0005`` (a 0.5 ms switch
  interval instead of CPython's 5 ms, which serve keeps: the A/B for that setting);
- ``probe``: ``bench.stamp_probe`` — the gateway with an in-memory sink that exposes the
  recorder's per-event receive stamps (timestamp accuracy);
- ``litellm``: LiteLLM's proxy, one worker, in its own venv (``bench.litellm_arm``).

Size: one function per benchmark phase (each a complete measurement with its own table); they share
the harness and are read one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import litellm_arm
from bench.analysis import ArmSummary, RequestMetrics, by_arm, minus, ratio, split_events, summarize
from bench.client import Arm, StreamResult, chat_body, get_json, run_interleaved
from bench.fleet import Fleet, simulator_args
from bench.procstat import cpu_s, rss_kib
from bench.tables import Check, render_table
from bench.throughput import ThroughputResult, closed_loop, nonstream_body, open_loop
from core.stats import percentiles

CHAT = "/v1/chat/completions"
MAX_SEQS = ["--max-num-seqs", "4096"]  # the simulator must never queue a benchmark stream
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    text: str
    checks: tuple[Check, ...]
    data: dict[str, Any]


# --------------------------------------------------------------------------- starting arms


async def start_arms(
    fleet: Fleet,
    names: Sequence[str],
    upstream: str,
    *,
    shadow: str | None = None,
    litellm_exe: str | None = None,
) -> tuple[list[Arm], dict[str, int]]:
    """Start the named proxy arms in parallel; return the arms (``direct`` first) and their pids."""
    starts: dict[str, Any] = {}
    headers: dict[str, tuple[tuple[str, str], ...]] = {}
    primary = ["--primary", upstream]
    for name in names:
        if name == "specshadow":
            starts[name] = fleet.gateway(name, primary)
        elif name == "shadow-100":
            assert shadow is not None
            args = [*primary, "--shadow", shadow, "--shadow-ratio", "1"]
            starts[name] = fleet.gateway(name, args)
        elif name == "telemetry-off":
            starts[name] = fleet.gateway(name, primary, env={"SPECSHADOW_TELEMETRY": "off"})
        elif name == "gil-0.5ms":
            env = {"SPECSHADOW_GIL_SWITCH_INTERVAL_S": "0.0005"}
            starts[name] = fleet.gateway(name, primary, env=env)
        elif name == "relay":
            starts[name] = fleet.relay(name, upstream)
        elif name == "probe":
            starts[name] = fleet.http_server(name, _probe_argv(primary))
        elif name == "litellm":
            assert litellm_exe is not None
            config = litellm_arm.write_config(
                fleet.log_dir / "litellm.yaml", upstream, model="sim-model"
            )
            starts[name] = fleet.http_server(
                name,
                litellm_arm.argv_for(Path(litellm_exe), config),
                env=litellm_arm.ENV,
                health_path=litellm_arm.HEALTH_PATH,
                timeout_s=180.0,
            )
            headers[name] = litellm_arm.HEADERS
        else:
            raise ValueError(f"unknown arm {name!r}")
    urls = dict(zip(starts, await asyncio.gather(*starts.values()), strict=True))
    arms = [Arm("direct", upstream + CHAT)]
    arms += [Arm(n, urls[n] + CHAT, headers.get(n, ())) for n in names]
    return arms, {n: fleet.procs[n].pid for n in names}


def _probe_argv(primary: list[str]) -> Callable[[int], list[str]]:
    probe = [sys.executable, "-m", "bench.stamp_probe", *primary]
    return lambda port: [*probe, "--port", str(port)]


def sim(
    fleet: Fleet, name: str, *, mode: str, prefill_ms: float, step_ms: float, tokens: int
) -> Any:
    args = simulator_args(mode=mode, prefill_ms=prefill_ms, step_ms=step_ms, tokens=tokens)
    return fleet.simulator(name, [*args, *MAX_SEQS])


def added(s: ArmSummary, d: ArmSummary, metric: str) -> tuple[float | None, float | None]:
    mine, theirs = getattr(s, metric), getattr(d, metric)
    return minus(mine.p50_ms, theirs.p50_ms), minus(mine.p99_ms, theirs.p99_ms)


def arm_rows(arms: dict[str, ArmSummary]) -> list[tuple[Any, ...]]:
    d = arms["direct"]
    rows = []
    for s in arms.values():
        at50, at99 = added(s, d, "ttft")
        dl50, dl99 = added(s, d, "delivery")
        rows.append(
            (s.arm, s.requests, s.errors, s.ttft.p50_ms, s.ttft.p99_ms, at50, at99, dl50, dl99,
             s.chunk_gap.p99_ms, s.e2e.p50_ms, s.upstream_gap.p90_ms, s.coalesced, s.stalled)
        )  # fmt: skip
    return rows


ARM_HEADER = ("arm", "reqs", "err", "ttft p50", "ttft p99", "+ttft p50", "+ttft p99",
              "+deliv p50", "+deliv p99", "gap p99", "e2e p50", "upgap p90", "coalesced",
              "stalled")  # fmt: skip


# --------------------------------------------------------------------------- 1 latency


def stamp_errors_ns(results: Sequence[StreamResult], stamps: dict[str, list[int]]) -> list[int]:
    """Per event: the probe's recorded receive time − the simulator's ``sent_ns`` (same event)."""
    errors: list[int] = []
    for r in results:
        got = stamps.get(f"{r.arm}-{r.index}")
        if r.warmup or got is None:
            continue
        sent = [e.sent_ns for e in split_events(r.reads) if not e.done]
        if len(sent) != len(got):
            continue  # cannot pair events one to one; counted as unpaired
        errors += [g - s for g, s in zip(got, sent, strict=True) if s is not None]
    return errors


async def latency_phase(args: argparse.Namespace, log: Log, litellm_exe: str | None) -> Phase:
    names = ["relay", "specshadow", "shadow-100", "telemetry-off", "probe"]
    names += ["litellm"] if litellm_exe else []
    with Fleet(pin=not args.no_pin) as fleet:
        plain = {"prefill_ms": args.prefill_ms, "step_ms": args.step_ms, "tokens": args.max_tokens}
        upstream, shadow = await asyncio.gather(
            sim(fleet, "upstream", mode="plain", **plain),
            sim(fleet, "shadow", mode="speculative", **plain),
        )
        arms, _pids = await start_arms(
            fleet, names, upstream, shadow=shadow, litellm_exe=litellm_exe
        )
        log(f"latency: {len(arms)} arms × {args.requests} requests at concurrency 1")
        results = await run_interleaved(
            arms,
            requests=args.requests,
            warmup=args.warmup,
            concurrency=1,
            body_for=functools.partial(chat_body, max_tokens=args.max_tokens),
            timeout_s=args.timeout_s,
        )
        probe_url = next(a.url for a in arms if a.name == "probe").removesuffix(CHAT)
        stamps = await get_json(probe_url + "/bench/stamps")
    metrics = by_arm(results, arms)
    arms_s = {n: summarize(n, ms) for n, ms in metrics.items()}
    stamp_err = stamp_errors_ns([r for r in results if r.arm == "probe"], stamps)
    return judge_latency(arms_s, metrics, stamp_err, litellm_ran=litellm_exe is not None)


def judge_latency(
    a: dict[str, ArmSummary],
    metrics: dict[str, list[RequestMetrics]],
    stamp_err_ns: list[int],
    *,
    litellm_ran: bool,
) -> Phase:
    d, g, r = a["direct"], a["specshadow"], a["relay"]
    g50, g99 = added(g, d, "ttft")
    r50, r99 = added(r, d, "ttft")
    deliv50, _ = added(g, d, "delivery")
    err50, err99, errmax = percentiles([e / 1e6 for e in stamp_err_ns], (50, 99, 100))
    checks = [
        Check("added TTFT p50 ÷ relay's", ratio(g50, r50), 1.5, "×"),
        Check("added TTFT p99 ÷ relay's", ratio(g99, r99), 2.0, "×"),
        Check("added per-chunk delivery p50", deliv50, 0.2, "ms"),
        Check("coalesced events via specshadow (20 ms pacing)", g.coalesced, 0, ""),
        Check("stalled events via specshadow (20 ms pacing)", g.stalled, 0, ""),
        Check("errors via specshadow", g.errors, 0, ""),
    ]
    lines: list[str] = []
    if litellm_ran:
        l50, l99 = added(a["litellm"], d, "ttft")
        checks.append(Check("LiteLLM added TTFT p50 ÷ specshadow's", ratio(l50, g50), 8, "×", True))
        lines.append(
            f"LiteLLM added TTFT p50 {l50:.3f} ms, p99 {l99:.3f} ms; LiteLLM re-serialises chunks, "
            "so the simulator's send stamps (and delivery) do not reach the client through it."
            if l50 is not None and l99 is not None
            else "LiteLLM: no successful requests"
        )
    else:
        lines.append("LiteLLM arm not run (--no-litellm or unavailable): its target is not judged.")
    shadow_ratios = {}
    for metric in ("ttft", "chunk_gap", "e2e"):
        for q in ("p50", "p99"):
            mine = getattr(getattr(a["shadow-100"], metric), f"{q}_ms")
            base = getattr(getattr(g, metric), f"{q}_ms")
            aa = getattr(getattr(a["probe"], metric), f"{q}_ms")
            shadow_ratios[f"{metric} {q}"] = (ratio(mine, base), ratio(aa, base))
            limit = 1.05 if q == "p50" else 1.10
            checks.append(
                Check(f"shadow-100 primary {metric} {q} ratio", ratio(mine, base), limit, "")
            )
    checks.append(Check("timestamp error p99 (probe recv − sim sent)", err99, 1.0, "ms"))
    changed = sum(
        1
        for m, base in zip(metrics["shadow-100"], metrics["specshadow"], strict=False)
        if m.error is None and base.error is None and m.text != base.text
    )
    checks.append(Check("shadow-100 primary text changed", changed, 0, ""))
    text = "\n\n".join(
        [
            render_table("Latency, concurrency 1 (ms; + = arm − direct)", ARM_HEADER, arm_rows(a)),
            render_table(
                "Primary with shadowing at 100 % ÷ specshadow (probe ÷ specshadow = A/A noise)",
                ("metric", "shadow-100 ratio", "A/A ratio"),
                [(k, v[0], v[1]) for k, v in shadow_ratios.items()],
            ),
            f"added TTFT — specshadow p50 {_f(g50)} / p99 {_f(g99)} ms; relay p50 {_f(r50)} / "
            f"p99 {_f(r99)} ms\n"
            + "\n".join(lines)
            + f"\ntimestamp error (probe's recorded receive − simulator's sent_ns), "
            f"{len(stamp_err_ns)} events: p50 {_f(err50)} p99 {_f(err99)} max {_f(errmax)} ms",
        ]
    )
    data = {"arms": a, "stamp_error_ms": {"n": len(stamp_err_ns), "p50": err50, "p99": err99,
                                          "max": errmax}, "shadow_ratios": shadow_ratios}  # fmt: skip
    return Phase("latency", text, tuple(checks), data)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


# --------------------------------------------------------------------------- 2 concurrency 64


async def concurrent_phase(args: argparse.Namespace, log: Log) -> Phase:
    """Each arm alone with ``--streams`` concurrent staggered streams, arms in rotating blocks."""
    names = ["relay", "specshadow", "gil-0.5ms"]
    c = args.streams
    with Fleet(pin=not args.no_pin) as fleet:
        upstream = await sim(
            fleet, "upstream", mode="plain", prefill_ms=args.prefill_ms, step_ms=args.step_ms,
            tokens=args.max_tokens,
        )  # fmt: skip
        arms, _pids = await start_arms(fleet, names, upstream)
        stream_s = (args.prefill_ms + args.max_tokens * args.step_ms) / 1e3
        log(
            f"concurrent: {len(arms)} arms × {args.stream_rounds} blocks of {2 * c} requests at {c}"
        )
        body_for = functools.partial(chat_body, max_tokens=args.max_tokens)
        results: list[StreamResult] = []
        per_round: list[float] = []  # specshadow's added TTFT p99 in each round
        for rnd in range(args.stream_rounds):
            shift = rnd % len(arms)
            this_round: list[StreamResult] = []
            for arm in [*arms[shift:], *arms[:shift]]:
                this_round += await run_interleaved(
                    [arm], requests=2 * c, warmup=c // 4, concurrency=c, body_for=body_for,
                    timeout_s=args.timeout_s, stagger_s=stream_s,
                )  # fmt: skip
            results += this_round
            r = {n: summarize(n, ms) for n, ms in by_arm(this_round, arms).items()}
            if (r99 := added(r["specshadow"], r["direct"], "ttft")[1]) is not None:
                per_round.append(r99)
    a = {n: summarize(n, ms) for n, ms in by_arm(results, arms).items()}
    g = a["specshadow"]
    # Judged on the median over rounds (each round: every arm back to back), not on the pooled
    # p99 — one stretch of host contention in one arm's block would otherwise decide the verdict.
    g99 = statistics.median(per_round) if per_round else None
    checks = (
        Check(f"added TTFT p99 at {c} concurrent streams (median of rounds)", g99, 1.0, "ms"),
        Check(f"errors via specshadow at {c} streams", g.errors, 0, ""),
    )
    text = render_table(
        f"Latency, {c} concurrent staggered streams per arm (ms; + = arm − direct)",
        ARM_HEADER,
        arm_rows(a),
    )
    text += "\nspecshadow added TTFT p99 by round: " + " ".join(f"{v:.3f}" for v in per_round)
    text += " ms\n"
    data = {"concurrency": c, "arms": a, "added_ttft_p99_by_round_ms": per_round}
    return Phase("concurrent", text, checks, data)


# --------------------------------------------------------------------------- 3 throughput


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float | None:
    """The median over rounds of ``a[i] / b[i]``."""
    ratios = [x / y for x, y in zip(a, b, strict=False) if y]
    return statistics.median(ratios) if ratios else None


def _fmt_ratios(base: ThroughputResult, arm: ThroughputResult) -> str:
    pairs = zip(base.cpu_us_per_request_by_round, arm.cpu_us_per_request_by_round, strict=False)
    return " ".join(f"{x / y:.3f}" for x, y in pairs if y)


async def throughput_phase(args: argparse.Namespace, log: Log) -> Phase:
    names = ["relay", "specshadow", "telemetry-off", "gil-0.5ms"]
    with Fleet(pin=not args.no_pin) as fleet:
        upstream = await sim(fleet, "fast", mode="plain", prefill_ms=0, step_ms=0, tokens=16)
        arms, pids = await start_arms(fleet, names, upstream)
        log(
            f"throughput: {len(arms)} arms × {args.tput_rounds} rounds × {args.tput_segment_s} s "
            f"at {args.tput_concurrency} clients"
        )
        res = await closed_loop(
            arms,
            pids,
            body=nonstream_body(16),
            concurrency=args.tput_concurrency,
            segment_s=args.tput_segment_s,
            rounds=args.tput_rounds,
        )
        by = {r.arm: r for r in res}
        # Latency at a load the gateway can carry: 0.6 × the relay's achieved rate, open loop.
        rate = 0.6 * by["relay"].rps
        log(
            f"throughput: open loop at {rate:.0f} req/s (0.6 × relay) for direct, relay, specshadow"
        )
        open_arms = [a for a in arms if a.name in ("direct", "relay", "specshadow")]
        opened = await open_loop(
            open_arms,
            pids,
            body=nonstream_body(16),
            rate_rps=rate,
            segment_s=args.tput_segment_s,
            rounds=args.tput_rounds,
        )
    g, relay, off = by["specshadow"], by["relay"], by["telemetry-off"]
    og = next(o for o in opened if o.arm == "specshadow")
    # Judged on the median over rounds of each round's ratio (arms measured back to back): a
    # stretch of contention from the shared host lands in one round of one arm, not in the verdict.
    capacity = median_ratio(relay.cpu_us_per_request_by_round, g.cpu_us_per_request_by_round)
    telemetry = median_ratio(off.cpu_us_per_request_by_round, g.cpu_us_per_request_by_round)
    open_p99 = statistics.median(og.p99_ms_by_round) if og.p99_ms_by_round else None
    # Judged on capacity (proxy CPU per request), not on the achieved rate: the simulator and the
    # load generator share one core and cap the relay's achieved rate before the relay's core is
    # busy, which would flatter every slower proxy. The achieved rates are in the table.
    checks = (
        Check(
            "non-streaming capacity ÷ relay's (CPU µs/request; median of rounds)",
            capacity, 0.6, "×", True,
        ),
        Check(
            "non-streaming p99 via specshadow at 0.6 × relay's rate (median of rounds)",
            open_p99, 10.0, "ms",
        ),
        Check(
            "open-loop sends > 1 ms behind schedule (client health)",
            sum(o.late_sends for o in opened) / max(1, sum(o.requests + o.errors for o in opened)),
            0.01, "share",
        ),
        Check(
            "capacity telemetry on ÷ off (CPU µs/request; median of rounds)",
            telemetry, 0.90, "×", True,
        ),
        Check("errors via specshadow (non-streaming)", g.errors, 0, ""),
    )  # fmt: skip
    rows = [
        (r.arm, r.requests, r.errors, r.rps, ratio(r.rps, relay.rps), r.latency.p50_ms,
         r.latency.p99_ms, r.cpu_us_per_request, r.proxy_utilisation,
         ratio(relay.cpu_us_per_request, r.cpu_us_per_request))
        for r in res
    ]  # fmt: skip
    text = render_table(
        f"Non-streaming, closed loop of {args.tput_concurrency} clients (16-token answers)",
        ("arm", "reqs", "err", "req/s", "÷ relay", "lat p50 ms", "lat p99 ms", "proxy CPU µs/req",
         "proxy CPU busy", "capacity ÷ relay"),
        rows,
    )  # fmt: skip
    text += "\n" + render_table(
        f"Non-streaming, open loop at {rate:.0f} req/s (0.6 × relay's closed-loop rate); "
        "latency from the scheduled send time",
        ("arm", "reqs", "err", "late sends", "lat p50 ms", "lat p99 ms", "lat max ms",
         "p99 by round", "proxy CPU µs/req", "proxy CPU busy"),
        [(o.arm, o.requests, o.errors, o.late_sends, o.latency.p50_ms, o.latency.p99_ms,
          o.latency.max_ms, " ".join(f"{v:.1f}" for v in o.p99_ms_by_round),
          o.cpu_us_per_request, o.proxy_utilisation) for o in opened],
    )  # fmt: skip
    text += (
        f"\nper-round ratios — capacity ÷ relay: {_fmt_ratios(relay, g)}; "
        f"telemetry on ÷ off: {_fmt_ratios(off, g)}\n"
    )
    return Phase("throughput", text, checks, {"arms": by, "open_loop": {o.arm: o for o in opened}})


# --------------------------------------------------------------------------- 4 paced streams


async def _sample_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_kib(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def paced_block(
    arm: Arm, pid: int | None, n: int, *, body_for: Callable[[int], bytes], ramp_s: float,
    timeout_s: float,
) -> tuple[list[StreamResult], int, float, float]:  # fmt: skip
    """``n`` streams at once (started over ``ramp_s``); the proxy's peak RSS (KiB), CPU s, wall s."""
    peak, stop = [0], asyncio.Event()
    cpu0, t0 = (cpu_s(pid) if pid else 0.0), time.perf_counter()

    async def block() -> list[StreamResult]:
        try:
            return await run_interleaved(
                [arm], requests=n, warmup=0, concurrency=n, body_for=body_for,
                timeout_s=timeout_s, stagger_s=ramp_s,
            )  # fmt: skip
        finally:
            stop.set()

    if pid:
        results, _ = await asyncio.gather(block(), _sample_rss(pid, peak, stop))
    else:
        results = await block()
    return results, peak[0], (cpu_s(pid) - cpu0) if pid else 0.0, time.perf_counter() - t0


def paced_levels(text: str) -> list[int]:
    """``"128,256,512"`` → [128, 256, 512]; the last (largest) level is the judged one."""
    return sorted({int(x) for x in str(text).split(",") if x.strip()})


async def paced_phase(args: argparse.Namespace, log: Log) -> Phase:
    levels = paced_levels(args.paced_streams)
    with Fleet(pin=not args.no_pin) as fleet:
        upstream = await sim(
            fleet, "paced", mode="plain", prefill_ms=args.prefill_ms, step_ms=20.0,
            tokens=args.paced_tokens,
        )  # fmt: skip
        arms, pids = await start_arms(fleet, ["specshadow"], upstream)
        body_for = functools.partial(chat_body, max_tokens=args.paced_tokens)
        per_level = []
        for n in levels:
            log(
                f"paced: {n} streams × {args.paced_tokens} events at 50/s, {args.paced_rounds} rounds"
            )
            per_level.append(await _paced_level(args, arms, pids, n, body_for))
    rows: list[tuple[Any, ...]] = []
    notes: list[str] = []
    data: dict[str, Any] = {}
    for n, (a, cpu, wall, peak) in zip(levels, per_level, strict=True):
        d = a["direct"]
        rows += [
            (n, s.arm, s.requests, s.errors, s.chunk_gap.p50_ms, s.chunk_gap.p99_ms,
             minus(s.chunk_gap.p99_ms, d.chunk_gap.p99_ms), s.upstream_gap.p99_ms,
             s.delivery.p50_ms, s.delivery.p99_ms, s.coalesced, s.stalled,
             ratio(cpu[s.arm], wall[s.arm]) if s.arm != "direct" else None, peak.get(s.arm) or None)
            for s in a.values()
        ]  # fmt: skip
        if (d.upstream_gap.p99_ms or 0) > 40.0 or d.stalled:
            notes.append(
                f"at {n} streams the direct arm itself is late (upstream gap p99 "
                f"{_f(d.upstream_gap.p99_ms)} ms, {d.stalled} stalled): the simulator + client "
                "core is saturated, so this level measures the machine, not only the gateway"
            )
        data[str(n)] = {
            "arms": a,
            "peak_rss_kib": peak,
            "cpu_busy": {k: cpu[k] / wall[k] for k in cpu},
        }
    n = levels[-1]
    a = per_level[-1][0]
    g, d = a["specshadow"], a["direct"]
    checks = (
        Check(f"added chunk-gap p99 at {n} paced streams", minus(g.chunk_gap.p99_ms, d.chunk_gap.p99_ms), 5.0),
        Check(f"errors via specshadow at {n} paced streams", g.errors, 0, ""),
    )  # fmt: skip
    text = render_table(
        f"Concurrent paced streams (50 events/s each, {args.paced_tokens} events; ms)",
        ("streams", "arm", "reqs", "err", "gap p50", "gap p99", "+gap p99", "upgap p99",
         "deliv p50", "deliv p99", "coalesced", "stalled", "proxy CPU busy", "peak RSS KiB"),
        rows,
    )  # fmt: skip
    return Phase("paced", "\n".join([text, *notes]), checks, {"levels": data})


async def _paced_level(
    args: argparse.Namespace, arms: list[Arm], pids: dict[str, int], n: int,
    body_for: Callable[[int], bytes],
) -> tuple[dict[str, ArmSummary], dict[str, float], dict[str, float], dict[str, int]]:  # fmt: skip
    results: list[StreamResult] = []
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    peak: dict[str, int] = {}
    for rnd in range(args.paced_rounds):
        for arm in arms if rnd % 2 == 0 else arms[::-1]:
            got, rss, used, secs = await paced_block(
                arm, pids.get(arm.name), n, body_for=body_for, ramp_s=1.0,
                timeout_s=args.timeout_s,
            )  # fmt: skip
            results += got
            cpu[arm.name] = cpu.get(arm.name, 0.0) + used
            wall[arm.name] = wall.get(arm.name, 0.0) + secs
            peak[arm.name] = max(peak.get(arm.name, 0), rss)
    a = {name: summarize(name, ms) for name, ms in by_arm(results, arms).items()}
    return a, cpu, wall, peak


# --------------------------------------------------------------------------- 5 memory


async def memory_phase(args: argparse.Namespace, log: Log) -> Phase:
    n = args.memory_streams
    tokens, step_ms = args.memory_tokens, 200.0
    with Fleet(pin=not args.no_pin) as fleet:
        upstream = await sim(
            fleet, "idle", mode="plain", prefill_ms=0, step_ms=step_ms, tokens=tokens
        )
        arms, pids = await start_arms(fleet, ["specshadow"], upstream)
        arm, pid = arms[1], pids["specshadow"]
        body_for = functools.partial(chat_body, max_tokens=tokens)
        fresh_kib = rss_kib(pid)
        warm = await run_interleaved(
            [arm], requests=4, warmup=0, concurrency=4, body_for=body_for, timeout_s=args.timeout_s
        )
        await asyncio.sleep(0.5)
        idle_kib = rss_kib(pid)
        log(f"memory: {n} streams open at once, one event per {step_ms:.0f} ms ({tokens} events)")
        results, peak_kib, _, _ = await paced_block(
            arm, pid, n, body_for=body_for, ramp_s=1.0, timeout_s=args.timeout_s
        )
        await asyncio.sleep(1.0)
        after_kib = rss_kib(pid)
    errors = sum(1 for r in [*warm, *results] if r.error is not None or r.status != 200)
    per_stream = (peak_kib - idle_kib) / n
    checks = (
        Check("RSS per in-flight stream", per_stream, 64, "KiB"),
        # "60 MB" read as ps/top read it: MiB. In decimal MB the figure is 1.049 × larger.
        Check("idle RSS (after warm-up)", idle_kib / 1024, 60, "MiB"),
    )
    text = render_table(
        f"Gateway memory (specshadow serve; {n} slow streams open at once)",
        ("fresh KiB", "idle KiB", "peak KiB", "after KiB", "per stream KiB", "errors"),
        [(fresh_kib, idle_kib, peak_kib, after_kib, per_stream, errors)],
    )
    data = {"streams": n, "fresh_kib": fresh_kib, "idle_kib": idle_kib, "peak_kib": peak_kib,
            "after_kib": after_kib, "per_stream_kib": per_stream, "errors": errors}  # fmt: skip
    return Phase("memory", text, checks, data)
