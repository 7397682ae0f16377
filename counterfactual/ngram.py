"""vLLM's n-gram (prompt lookup) proposer, for every context length of one sequence at once.

Follows ``_find_longest_matched_ngram_and_propose_tokens`` in vLLM 0.32.0
(``vllm/v1/spec_decode/ngram_proposer.py``): given the context ``tokens[:T]``, find the longest
n-gram with ``prompt_lookup_min <= n <= prompt_lookup_max`` that is a suffix of the context and
also occurs earlier in it (overlapping the suffix is allowed, the suffix itself is not); among
occurrences of that length take the **earliest**; draft up to ``k`` tokens that follow it, never
past the end of the context. vLLM finds it with a KMP scan over the reversed context, O(T) per
call. Here one pass registers every n-gram's earliest start as the context grows, so all
``T`` cost O(len × window) together — the same answer (held against a literal port of vLLM's
function in the tests), fast enough to replay a whole grid on every sampled record.

The match does not depend on ``k``: :func:`draft_starts` gives, per context length, where the
draft starts, and every depth takes its prefix of what follows.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NO_DRAFT", "draft_starts"]

NO_DRAFT = -1


def draft_starts(tokens: Sequence[int], first: int, min_n: int, max_n: int) -> list[int]:
    """For each context length ``T`` in ``[first, len(tokens))``: the index where vLLM's n-gram
    proposer starts drafting from ``tokens[:T]`` (the draft is ``tokens[s : s + min(k, T - s)]``),
    or :data:`NO_DRAFT` when no n-gram of the window matches.

    Raises:
        ValueError: the window is not ``1 <= min_n <= max_n``, or ``first < 1``.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(
            f"expected 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
        )
    if first < 1:
        raise ValueError(f"first context length must be >= 1, got {first}")
    seq = tuple(tokens)
    total = len(seq)
    # earliest[n][ngram] = earliest start of that n-gram among those ending at <= T - 2 (every
    # occurrence except the context's own suffix, which ends at T - 1).
    earliest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
    lengths = range(max_n, min_n - 1, -1)
    registered = -1  # n-grams ending at indices <= registered are in ``earliest``
    out: list[int] = []
    for context in range(first, total):
        while registered < context - 2:
            registered += 1
            end = registered + 1
            for n in range(min_n, min(max_n, end) + 1):
                earliest[n].setdefault(seq[end - n : end], end - n)
        start = NO_DRAFT
        for n in lengths:
            if n > context:
                continue
            hit = earliest[n].get(seq[context - n : context])
            if hit is not None:
                start = hit + n
                break
        out.append(start)
    return out
