"""What counterfactual scoring costs, side by side in one run (no target is a timed test).

Arms, on the same synthetic requests (a prompt of ``--prompt`` tokens, an output of ``--output``
tokens that copies spans of its context, so the proposer drafts often):

- ``reference``: stepping a literal port of vLLM's n-gram proposer, one KMP scan per step
  (``simulator.ngram``, via ``tests/counterfactual/vllm_reference.py``), one configuration at a
  time;
- ``index``: the product's one-pass index (``counterfactual.ngram``) and replay, every depth of a
  window from one index;
- ``grid``: the whole default grid (4 windows × k = 1…8) on one record, as ``specshadow
  counterfactual`` scores it.

Prints one table: records per second on one core per arm, the index's speed-up over the reference
for the same configurations, and the grid's rate against the records a fleet tokenizes (``--rate``
requests/s × ``--share``).

    .venv/bin/python -m bench.counterfactual_replay [--records 200] [--prompt 512] [--output 256]
        [--rate 200] [--share 0.1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from counterfactual.grid import DEFAULT_DEPTHS, DEFAULT_WINDOWS, grid
from counterfactual.matrix import build_matrix
from counterfactual.replay import ngram_offers, replay
from tests.counterfactual.vllm_reference import replay_reference


def requests(
    n: int, prompt_len: int, output_len: int, seed: int = 1
) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(2000) for _ in range(prompt_len)]
        output: list[int] = []
        while len(output) < output_len:
            if rng.random() < 0.5:
                source = prompt + output
                start = rng.randrange(max(1, len(source) - 16))
                output.extend(source[start : start + rng.randint(4, 16)])
            else:
                output.extend(rng.randrange(2000) for _ in range(rng.randint(1, 8)))
        out.append((prompt, output[:output_len]))
    return out


def timed(fn: Any) -> float:
    started = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - started) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--rate", type=float, default=200.0, help="fleet requests per second")
    p.add_argument("--share", type=float, default=0.1, help="counterfactual.share")
    p.add_argument("--reference-records", type=int, default=20, help="the reference is slow")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    data = requests(args.records, args.prompt, args.output)
    few = data[: args.reference_records]
    windows, depths = DEFAULT_WINDOWS, DEFAULT_DEPTHS

    def reference() -> None:
        for prompt, output in few:
            for lo, hi in windows:
                for k in depths:
                    replay_reference(prompt, output, lo, hi, k)

    def index_few() -> None:
        for prompt, output in few:
            for lo, hi in windows:
                offers = ngram_offers(prompt, output, lo, hi, max(depths))
                for k in depths:
                    replay(len(output), k, *offers)

    records = [
        {"exchange_id": str(i), "category": "code", "greedy": True, "legs": [],
         "tokens": {"prompt": pr, "output": out, "drafters": {}}}
        for i, (pr, out) in enumerate(data)
    ]  # fmt: skip

    def whole_grid() -> None:
        build_matrix(lambda: iter(records), depths=depths, windows=windows)

    t_ref = timed(reference)
    t_idx = timed(index_few)
    t_grid = timed(whole_grid)
    configs = len(grid(depths=depths, windows=windows))
    needed = args.rate * args.share
    rows = [
        ("reference (vLLM's KMP per step), grid", len(few) / t_ref, 1.0),
        ("index + replay, grid", len(few) / t_idx, t_ref / t_idx),
        ("build_matrix, grid (2 passes, all sums)", len(records) / t_grid, None),
    ]
    print(f"{configs} configurations per record; prompt {args.prompt}, output {args.output} tokens")
    print(f"{'arm':<44}{'records/s/core':>16}{'× reference':>14}")
    for name, rate, ratio in rows:
        print(f"{name:<44}{rate:>16.1f}{'' if ratio is None else f'{ratio:.1f}×':>14}")
    grid_rate = len(records) / t_grid
    print(
        f"a fleet at {args.rate:g} req/s with share {args.share:g} tokenizes {needed:g} records/s: "
        f"one core scores them {grid_rate / needed:.1f}× as fast as they arrive"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"configs": configs, "rows": [list(r) for r in rows], "needed_per_s": needed}, f
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
