"""What the suffix-decoding replay costs per record: the pure-Python port against arctic-inference's
own cache (when importable: put ``backends.setup.ensure_arctic``'s folder on ``PYTHONPATH``).

Agent-like synthetic traffic: ``--records`` requests with fresh prompts of ``--prompt`` tokens and
outputs of ``--output`` tokens, each a copy of one of 20 templates with 10 % of its tokens
changed (so the global tree drafts long runs), replayed in order at ``--depths`` (every depth of
one knob set shares each step's tree walk) with vLLM's default knobs.

    .venv/bin/python -m bench.suffix_replay [--records 200] [--prompt 300] [--output 200]
        [--depths 4,8,16,24]
"""

from __future__ import annotations

import argparse
import random
import time

from counterfactual.suffix import SuffixCache
from counterfactual.suffix_replay import SuffixKnobs, SuffixSpec, suffix_offers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--output", type=int, default=200)
    p.add_argument("--depths", default="4,8,16,24")
    args = p.parse_args()
    rng = random.Random(1)
    templates = [[rng.randrange(5000) for _ in range(args.output)] for _ in range(20)]
    reqs = []
    for _ in range(args.records):
        out = list(rng.choice(templates))
        for _ in range(args.output // 10):
            out[rng.randrange(args.output)] = rng.randrange(5000)
        reqs.append(([rng.randrange(5000) for _ in range(args.prompt)], out))
    specs = [SuffixSpec(int(k)) for k in args.depths.split(",")]
    arms: list[tuple[str, object]] = [("port", SuffixCache())]
    library = SuffixKnobs().cache()
    if not isinstance(library, SuffixCache):
        arms.append(("arctic-inference", library))
    print(
        f"{args.records} records, prompt {args.prompt}, output {args.output}, depths {args.depths}"
    )
    for name, cache in arms:
        started = time.process_time()
        for i, (prompt, output) in enumerate(reqs):
            suffix_offers(cache, i, prompt, output, specs)
        cpu = time.process_time() - started
        print(f"{name:>16}: {cpu / args.records * 1e3:7.1f} ms/record (CPU), "
              f"{args.records / cpu:7.1f} records/s on one core")  # fmt: skip


if __name__ == "__main__":
    main()
