"""What the cross-vocabulary replays cost per record on the CLI's side (the drafter's server
time is apart: docs/benchmarks.md): TLI's masked argmax over a ``prompt_logprobs`` answer with
``--top`` candidates per position and its replay at every depth; SLEM's string matching and
replay at every depth.

Synthetic: a 4,096-token target and a 3,000-token drafter sharing 2,700 strings; ``--records``
outputs of ``--output`` tokens; the drafter's ranked candidates random, the actual token first
half of the time.

    .venv/bin/python -m bench.crossvocab_replay [--records 200] [--prompt 300] [--output 200]
        [--top 20] [--depths 1,2,3,4]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from counterfactual.crossvocab import Intersection, slem_replay, tli_replay
from counterfactual.crossvocab_drafter import masked_argmax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--output", type=int, default=200)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--depths", default="1,2,3,4")
    args = p.parse_args()
    depths = [int(k) for k in args.depths.split(",")]
    rng = random.Random(1)
    shared = [f"w{i}" for i in range(2700)]
    target = {t: i for i, t in enumerate([*shared, *(f"t{i}" for i in range(4096 - 2700))])}
    draft = {t: i for i, t in enumerate([*(f"d{i}" for i in range(300)), *shared])}
    x = Intersection.build(target, draft, target_unk=0, draft_unk=0)
    reqs: list[tuple[list[int], list[Any]]] = []
    for _ in range(args.records):
        output = [rng.randrange(4096) for _ in range(args.output)]
        seq = x.to_draft([rng.randrange(4096) for _ in range(args.prompt)] + output)
        logprobs: list[Any] = [None]
        for i in range(1, len(seq)):
            ranked = [seq[i]] if rng.random() < 0.5 else []
            ranked += [rng.randrange(3000) for _ in range(args.top - len(ranked))]
            logprobs.append({str(t): {"logprob": -r / 2, "rank": r}
                             for r, t in enumerate(ranked, 1)})  # fmt: skip
        reqs.append((output, logprobs))
    print(f"{args.records} records, prompt {args.prompt}, output {args.output}, top {args.top}, "
          f"depths {depths}")  # fmt: skip
    started = time.process_time()
    for output, logprobs in reqs:
        argmax, _ = masked_argmax(logprobs, args.prompt, len(output), x.draft_to_target, args.top)
        for k in depths:
            tli_replay(x, output, argmax, k)
    cpu = time.process_time() - started
    print(f"{'tli':>6}: {cpu / args.records * 1e3:7.2f} ms/record (CPU, all depths)")
    texts = [f"w{i} " for i in range(args.output)]
    started = time.process_time()
    for _ in range(args.records):
        for _ in depths:
            drafts = [None, *("".join(texts[j : j + 3]) + "x" for j in range(1, args.output))]
            slem_replay(texts, drafts)
    cpu = time.process_time() - started
    print(f"{'slem':>6}: {cpu / args.records * 1e3:7.2f} ms/record (CPU, all depths)")


if __name__ == "__main__":
    main()
