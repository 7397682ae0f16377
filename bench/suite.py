"""The performance suite (issue 8): every arm and every target in one run, one table of verdicts.

Phases, each with its own processes (gateways pinned to CPU 0; simulators and this client on
CPU 1), arms interleaved or in rotating blocks within a phase (``bench/phases.py`` says how):

1. ``latency``: concurrency 1 — added TTFT vs the raw relay and LiteLLM, per-chunk delivery,
   coalesced/stalled events at 20 ms pacing, shadowing at 100 %, timestamp accuracy;
2. ``concurrent``: ``--streams`` (64) staggered streams per arm — added TTFT p99; GIL A/B;
3. ``throughput``: non-streaming closed loop — vs the relay, p99, telemetry on/off; GIL A/B;
4. ``paced``: ``--paced-streams`` (512) streams at 50 events/s through one gateway core;
5. ``memory``: RSS idle and per in-flight stream.

Run: ``.venv/bin/python -m bench.suite [--quick] [--no-litellm] [--phases latency,memory]
[--json FILE]``. Exit status: 0 every target met, 1 a target missed, 2 setup failed.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from collections.abc import Sequence
from importlib.metadata import version

import aiohttp

from bench import litellm_arm, phases
from bench.fleet import CLIENT_CPU, pin_self
from bench.tables import load_line, machine, pinning_line, render_checks, run_main, write_json
from core.procs import can_pin

PHASES = ("latency", "concurrent", "throughput", "paced", "memory")
FULL = {
    "requests": 150, "warmup": 5, "max_tokens": 16, "streams": 64, "stream_rounds": 7,
    "tput_concurrency": 8, "tput_segment_s": 2.0, "tput_rounds": 7,
    "paced_streams": "128,256,512", "paced_tokens": 150, "paced_rounds": 2,
    "memory_streams": 512, "memory_tokens": 25,
}  # fmt: skip
QUICK = {
    "requests": 20, "warmup": 3, "max_tokens": 12, "streams": 64, "stream_rounds": 1,
    "tput_concurrency": 8, "tput_segment_s": 1.0, "tput_rounds": 2,
    "paced_streams": "64,256", "paced_tokens": 60, "paced_rounds": 1,
    "memory_streams": 256, "memory_tokens": 15,
}  # fmt: skip


def parse_phases(text: str) -> list[str]:
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PHASES))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"phases from {PHASES}; got {text!r}")
    return [p for p in PHASES if p in chosen]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smaller sizes (under 2 minutes)")
    p.add_argument("--phases", type=parse_phases, default=list(PHASES))
    p.add_argument(
        "--no-litellm",
        action="store_true",
        help="do not run (or install) the LiteLLM arm; its target is then reported as not judged",
    )
    p.add_argument("--step-ms", type=float, default=20.0, help="upstream pacing between tokens")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="upstream time to first token")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request client timeout")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    for key, value in FULL.items():
        flag = "--" + key.replace("_", "-")
        p.add_argument(
            flag, type=type(value), default=None, help=f"default {value} ({QUICK[key]} quick)"
        )
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset sizes from the full or ``--quick`` preset."""
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def machine_lines() -> list[str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        platform.processor() or "?",
    )
    info = machine()
    return [
        f"machine: {model}, {info['cpus']} CPUs; {info['platform']}",
        f"Python {info['python']}, aiohttp {aiohttp.__version__}, uvloop {version('uvloop')}",
    ]


def litellm_or_none(args: argparse.Namespace) -> tuple[str | None, str]:
    if args.no_litellm:
        return None, "LiteLLM arm skipped (--no-litellm)"
    try:
        exe = litellm_arm.ensure_litellm()
    except litellm_arm.LiteLLMUnavailable as exc:
        return None, f"LiteLLM arm unavailable: {exc}"
    return str(exe), f"LiteLLM: {exe}"


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    for line in [*machine_lines(), load_line("start")]:
        print(line, flush=True)
    loads = [machine()["loadavg"]]
    pinned = not args.no_pin and can_pin()
    if pinned:
        pin_self(CLIENT_CPU)
    print(pinning_line(pinned), flush=True)
    exe, note = litellm_or_none(args) if "latency" in args.phases else (None, "")
    if note:
        print(note, flush=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)

    done: list[phases.Phase] = []
    for name in args.phases:
        if name == "latency":
            phase = await phases.latency_phase(args, log, exe)
        else:
            phase = await getattr(phases, f"{name}_phase")(args, log)
        loads.append(machine()["loadavg"])
        print("\n" + phase.text + "\n", flush=True)
        done.append(phase)
    checks = [c for p in done for c in p.checks]
    print(render_checks(checks))
    print(load_line("end"))
    print(
        "load average (1 min) before/after each phase: "
        + " → ".join(f"{la[0]:.2f}" for la in loads)
        + f"; total {time.perf_counter() - started:.0f} s"
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "suite",
                "config": {k: v for k, v in vars(args).items() if k != "json"},
                "machine": machine_lines(),
                "loadavg": loads,
                "phases": {p.name: p.data for p in done},
                "checks": [
                    {"name": c.name, "value": c.value, "limit": c.limit_text, "passed": c.passed}
                    for c in checks
                ],
            },
        )
    return 0 if all(c.passed for c in checks) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
