"""A literal port of vLLM 0.32.0's n-gram proposer (``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``, Apache-2.0, copyright the vLLM project):
the KMP scan over the reversed context, line for line, numba and numpy removed. The tests hold
the product's one-pass index (``counterfactual.ngram``) to it."""

from __future__ import annotations

from collections.abc import Sequence


def propose(
    origin_tokens: Sequence[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> list[int]:
    total_token = len(origin_tokens)
    if total_token < min_ngram:
        return []
    k = min(k, max_model_len - total_token)
    if k <= 0:
        return []
    tokens = list(origin_tokens)[::-1]
    lps = [0] * max_ngram
    longest_ngram = 0
    position = 0
    prev_lps = 0
    i = 1
    while i < total_token:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest_ngram:
                longest_ngram = prev_lps
                position = i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest_ngram < min_ngram:
        return []
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return list(origin_tokens[start_position : start_position + k])


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
