"""Both n-gram implementations against vLLM's own compiled proposer (``pytest -m vllm``).

vLLM 0.32.0's ``_find_longest_matched_ngram_and_propose_tokens`` is read from the installed
source (``specshadow vllm setup``), compiled by numba as vLLM compiles it, and run in vLLM's own
environment on random sequences. It must answer what the simulator's literal port
(``simulator.ngram``, the ground truth of the simulated n-gram candidates) and the product's
one-pass index (``counterfactual.ngram``, what the replay uses) answer.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from backends.setup import VllmEnv
from counterfactual.ngram import NO_DRAFT, draft_starts
from simulator.ngram import find_longest_matched_ngram_and_propose_tokens as port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

RUNNER = r"""
import ast, json, sys
import numpy as np
from numba import jit

source = open(sys.argv[1]).read()
for node in ast.parse(source).body:
    if isinstance(node, ast.FunctionDef) and node.name == FUNCTION:
        exec(compile(ast.Module([node], []), sys.argv[1], "exec"))
find = globals()[FUNCTION]
out = []
for tokens, lo, hi, max_len, k in json.load(sys.stdin):
    arr = np.array(tokens, dtype=np.int32)
    out.append([int(t) for t in find(arr, lo, hi, max_len, k)])
print(json.dumps(out))
""".replace("FUNCTION", repr("_find_longest_matched_ngram_and_propose_tokens"))


def test_the_ports_answer_what_vllms_own_function_answers(vllm_env: VllmEnv) -> None:
    (source,) = vllm_env.venv.glob(
        "lib/python*/site-packages/vllm/v1/spec_decode/ngram_proposer.py"
    )
    rng = random.Random(11)
    cases = []
    for _ in range(1500):
        tokens = [rng.randrange(rng.choice((2, 3, 4, 50))) for _ in range(rng.randrange(1, 60))]
        lo = rng.randint(1, 4)
        cases.append(
            (tokens, lo, rng.randint(lo, 6), rng.choice((4096, len(tokens) + 2)), rng.randint(1, 6))
        )
    done = subprocess.run(
        [str(vllm_env.python), "-c", RUNNER, str(source)],
        input=json.dumps(cases), capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    theirs = json.loads(done.stdout)
    assert [port(*case) for case in cases] == theirs
    # The product's index answers every context length at once; ask it for the last one.
    for (tokens, lo, hi, max_len, k), expected in zip(cases, theirs, strict=True):
        if len(tokens) < 2 or max_len - len(tokens) < k:
            continue  # the index does not model max_model_len (a request never nears it)
        start = draft_starts([*tokens, -1], len(tokens), lo, hi)[0]
        got = [] if start == NO_DRAFT else tokens[start : start + min(k, len(tokens) - start)]
        assert got == expected, (tokens, lo, hi, k)
