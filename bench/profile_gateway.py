"""Where the gateway's CPU goes under load: py-spy samples of a pinned ``specshadow serve``.

``python -m bench.profile_gateway --load nonstream|stream [--seconds 10] [--out DIR]`` starts a
simulator and a gateway like the suite does (gateway on CPU 0), drives load from this process, and
records the gateway with ``py-spy record --threads --format raw`` (collapsed stacks; py-spy is a
dev-only tool: ``.venv/bin/pip install py-spy``). It prints the share of samples per thread and
the top functions by self and by inclusive time, and leaves ``profile.txt`` (collapsed stacks,
readable by ``flamegraph.pl`` or speedscope) in ``--out``.

Loads: ``nonstream`` — a closed loop of ``--concurrency`` clients, 16-token non-streaming answers
(per-request cost); ``stream`` — ``--concurrency`` streams of 200 events at 2 ms pacing, restarted
as they end (per-chunk cost). ``--env K=V`` passes settings to the gateway (e.g. telemetry off).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.client import Arm, chat_body, run_interleaved
from bench.fleet import CLIENT_CPU, Fleet, pin_self, simulator_args
from bench.tables import run_main
from bench.throughput import closed_loop, nonstream_body


def _where(frame: str) -> str:
    """``fn (path/to/file.py:12)`` → ``path/to/file.py`` (site-packages trimmed to the package)."""
    inside = frame.rpartition("(")[2].partition(":")[0]
    return inside.rpartition("site-packages/")[2] or frame


def summarize_collapsed(text: str, top: int = 25) -> str:
    """Thread shares and top frames from py-spy's raw (collapsed) output."""
    threads: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        n = int(count_text)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        self_time[frames[-1]] += n
        by_file[_where(frames[-1])] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    if not total:
        return "no samples"
    out = [f"{total} samples"]
    out += ["threads:"] + [f"  {n / total:6.1%}  {t}" for t, n in threads.most_common()]
    out += ["self, by file:"] + [f"  {n / total:6.1%}  {f}" for f, n in by_file.most_common(top)]
    out += ["self:"] + [f"  {n / total:6.1%}  {f}" for f, n in self_time.most_common(top)]
    out += ["inclusive:"] + [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(out)


async def run(args: argparse.Namespace) -> int:
    out_dir: Path = args.out
    pyspy = shutil.which("py-spy") or str(Path(__file__).parents[1] / ".venv/bin/py-spy")
    env = dict(kv.split("=", 1) for kv in args.env)
    with Fleet(pin=True) as fleet:
        if fleet.pin:
            pin_self(CLIENT_CPU)
        step = 0.0 if args.load == "nonstream" else 2.0
        tokens = 16 if args.load == "nonstream" else 200
        sim = simulator_args(mode="plain", prefill_ms=0, step_ms=step, tokens=tokens)
        upstream = await fleet.simulator("upstream", [*sim, "--max-num-seqs", "4096"])
        url = await fleet.gateway("gateway", ["--primary", upstream], env=env)
        pid = fleet.procs["gateway"].pid
        arm = Arm("gateway", url + "/v1/chat/completions")
        raw = out_dir / "profile.txt"
        spy = await asyncio.create_subprocess_exec(
            pyspy, "record", "-p", str(pid), "-d", str(args.seconds), "-r", "250",
            "--threads", "--nonblocking", "-f", "raw", "-o", str(raw),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        if args.load == "nonstream":
            await closed_loop(
                [arm], {"gateway": pid}, body=nonstream_body(16), concurrency=args.concurrency,
                segment_s=args.seconds + 1, rounds=1, warmup_s=0.1,
            )  # fmt: skip
        else:
            n = max(1, int((args.seconds + 1) / 0.4)) * args.concurrency
            await run_interleaved(
                [arm], requests=n, warmup=0, concurrency=args.concurrency,
                body_for=functools.partial(chat_body, max_tokens=tokens), stagger_s=0.4,
            )  # fmt: skip
        _, err = await spy.communicate()
    if not raw.exists():
        print(f"py-spy wrote nothing: {err.decode(errors='replace')}")
        return 2
    print(summarize_collapsed(raw.read_text()))
    print(f"collapsed stacks: {raw}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_gateway", description=__doc__)
    p.add_argument("--load", choices=["nonstream", "stream"], default="nonstream")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.out = Path(args.out or tempfile.mkdtemp(prefix="specshadow-profile-"))
    args.out.mkdir(parents=True, exist_ok=True)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
