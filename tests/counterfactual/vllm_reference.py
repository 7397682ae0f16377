"""The reference the product's n-gram replay is held to: vLLM's proposer, called afresh at every
step, as the engine calls it.

The proposer is the simulator's literal port of vLLM 0.32.0's
``_find_longest_matched_ngram_and_propose_tokens`` (``simulator.ngram``), itself held to vLLM's
own compiled function in ``tests/vllm/test_ngram_port.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.ngram import find_longest_matched_ngram_and_propose_tokens


def propose(
    origin_tokens: Sequence[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> list[int]:
    return list(
        find_longest_matched_ngram_and_propose_tokens(
            origin_tokens, min_ngram, max_ngram, max_model_len, k
        )
    )


def replay_reference(
    prompt: Sequence[int], output: Sequence[int], min_n: int, max_n: int, k: int
) -> list[tuple[int, int]]:
    """(drafted, accepted) of every decode step, by calling :func:`propose` at every step."""
    steps: list[tuple[int, int]] = []
    n = len(output)
    j = 1
    while j < n:
        context = [*prompt, *output[:j]]
        draft = propose(context, min_n, max_n, 1 << 30, k)[: n - j - 1]
        a = 0
        while a < len(draft) and draft[a] == output[j + a]:
            a += 1
        steps.append((len(draft), a))
        j += a + 1
    return steps
