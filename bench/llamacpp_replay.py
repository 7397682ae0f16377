"""What the llama.cpp n-gram replay costs per record: ``ngram-mod`` and ``ngram-map-k``, one
replayed server per configuration (counterfactual/llamacpp_ngram.py), against vLLM's n-gram
replay on the same records for scale.

Agent-like synthetic traffic, as bench/suffix_replay.py: ``--records`` requests with fresh
prompts of ``--prompt`` tokens and outputs of ``--output`` tokens, each a copy of one of 20
templates with 10 % of its tokens changed (so the shared pool drafts long runs), served in order
by a 2-slot server at ``--depths``; ngram-mod with n_match 4 and n_min 1, ngram-map-k with key 2.

    .venv/bin/python -m bench.llamacpp_replay [--records 200] [--prompt 300] [--output 200]
        [--depths 4,8,16]
"""

from __future__ import annotations

import argparse
import random
import time

from counterfactual.llamacpp_ngram import LlamaKnobs
from counterfactual.replay import ngram_offers, replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--output", type=int, default=200)
    p.add_argument("--depths", default="4,8,16")
    args = p.parse_args()
    rng = random.Random(1)
    templates = [[rng.randrange(5000) for _ in range(args.output)] for _ in range(20)]
    reqs = []
    for _ in range(args.records):
        out = list(rng.choice(templates))
        for _ in range(args.output // 10):
            out[rng.randrange(args.output)] = rng.randrange(5000)
        reqs.append(([rng.randrange(5000) for _ in range(args.prompt)], out))
    depths = [int(k) for k in args.depths.split(",")]
    print(f"{args.records} records, prompt {args.prompt}, output {args.output}, depths {depths}")
    for spec_type, n_match in (("ngram-mod", 4), ("ngram-map-k", 2)):
        servers = [LlamaKnobs(spec_type, n_match, 1, k, slots=2).server() for k in depths]
        started = time.process_time()
        drafted = accepted = 0
        for prompt, output in reqs:
            for server in servers:
                r = server.serve(prompt, output)
                drafted, accepted = drafted + r.draft_tokens, accepted + r.accepted
        cpu = time.process_time() - started
        per = cpu / args.records / len(depths) * 1e3
        print(f"{spec_type:>12}: {per:6.2f} ms/record per configuration (CPU), "
              f"{accepted}/{drafted} accepted over the depths")  # fmt: skip
    started = time.process_time()
    for prompt, output in reqs:
        offers = ngram_offers(prompt, output, 2, 4, max(depths))
        for k in depths:
            replay(len(output), k, *offers)
    cpu = time.process_time() - started
    print(f"{'vllm ngram':>12}: {cpu / args.records / len(depths) * 1e3:6.2f} ms/record per "
          "configuration (CPU; one lookup pass shared by the depths)")  # fmt: skip


if __name__ == "__main__":
    main()
