"""The gateway at several commits, side by side in one run: is a capacity change real?

```
.venv/bin/python -m bench.versions --ref 73e5750 [--ref COMMIT …] [--rounds 9] [--segment-s 2]
```

Each ``--ref`` is checked out into a temporary ``git worktree`` and served by the same
interpreter (this venv's packages) with that tree first on ``sys.path``; the working tree's own
code is the arm ``HEAD``. Every arm runs ``specshadow serve --primary URL`` pinned to the gateway
core against one zero-latency simulator, beside the raw relay (the floor for a Python proxy), in
the throughput phase's closed loop (8 clients, non-streaming 16-token answers, arms rotated each
round so machine drift hits all of them alike). The table gives requests/s, CPU µs per request
(split: the event loop's thread + every other thread, over the whole run, idle time included)
and capacity ÷ relay — the median over rounds of the relay's CPU per request over the arm's —
for each arm; a change between two commits is real when it is larger than the spread of their
rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from bench.client import Arm
from bench.fleet import REPO_ROOT, Fleet
from bench.phases import CHAT, sim
from bench.procstat import thread_cpu_s
from bench.tables import load_line, render_table, run_main
from bench.throughput import closed_loop, nonstream_body


def _serve_argv(tree: Path | None) -> list[str]:
    if tree is None:
        return [sys.executable, "-m", "specshadow"]
    # The tree's own console-script entry point (it moved between releases).
    scripts = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["specshadow"].split(":")
    boot = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); "
        f"from {module} import {func} as main; sys.exit(main())"
    )
    return [sys.executable, "-c", boot]


def _worktree(ref: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(into), ref],
        check=True,
    )
    return into


def _argv_for(argv: list[str], upstream: str) -> Callable[[int], list[str]]:
    return lambda port: [*argv, "--port", str(port), "--primary", upstream]


async def run(args: argparse.Namespace, trees: Mapping[str, Path | None]) -> int:
    print(load_line("start"))
    with Fleet(pin=True) as fleet:
        upstream = await sim(fleet, "fast", mode="plain", prefill_ms=0, step_ms=0, tokens=16)
        starts = {"relay": fleet.relay("relay", upstream)}
        for name, tree in trees.items():
            argv = [
                *_serve_argv(tree),
                "--log-level",
                "WARNING",
                "serve",
                "--host",
                "127.0.0.1",
            ]
            starts[name] = fleet.http_server(name, _argv_for(argv, upstream))
        urls = dict(zip(starts, await asyncio.gather(*starts.values()), strict=True))
        arms = [Arm(n, urls[n] + CHAT) for n in starts]
        pids = {n: fleet.procs[n].pid for n in starts}
        before = {n: thread_cpu_s(pid) for n, pid in pids.items()}
        results = await closed_loop(
            arms,
            pids,
            body=nonstream_body(16),
            concurrency=8,
            segment_s=args.segment_s,
            rounds=args.rounds,
        )
        after = {n: thread_cpu_s(pid) for n, pid in pids.items()}
    by = {r.arm: r for r in results}
    relay = by["relay"].cpu_us_per_request_by_round
    rows = []
    for name in starts:
        r = by[name]
        used = {t: after[name].get(t, 0.0) - before[name].get(t, 0.0) for t in after[name]}
        loop_us = used.get("main", 0.0) / max(r.requests, 1) * 1e6
        other_us = sum(v for t, v in used.items() if t != "main") / max(r.requests, 1) * 1e6
        ratios = [a / b for a, b in zip(relay, r.cpu_us_per_request_by_round, strict=False) if b]
        rows.append(
            [
                name,
                f"{r.rps:.0f}",
                f"{r.cpu_us_per_request or 0:.0f}",
                f"{loop_us:.0f} + {other_us:.0f}",
                f"{statistics.median(ratios):.3f}" if ratios else "-",
                " ".join(f"{x:.2f}" for x in ratios),
            ]
        )
    print(
        render_table(
            f"non-streaming closed loop, 8 clients, {args.rounds} rounds × {args.segment_s} s",
            ["arm", "req/s", "CPU µs/req", "loop + threads", "capacity ÷ relay", "by round"],
            rows,
        )
    )
    print(load_line("end"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.versions", description=__doc__.splitlines()[0])
    p.add_argument("--ref", action="append", default=[], help="a commit to compare (repeatable)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--segment-s", type=float, default=2.0)
    args = p.parse_args(argv)
    trees: dict[str, Path | None] = {"HEAD": None}
    tmp = Path(tempfile.mkdtemp(prefix="specshadow-versions-"))
    try:
        for ref in args.ref:
            trees[ref] = _worktree(ref, tmp / ref)
        return run_main(lambda: run(args, trees))
    finally:
        for tree in trees.values():
            if tree is not None:
                subprocess.run(
                    ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )


if __name__ == "__main__":
    raise SystemExit(main())
