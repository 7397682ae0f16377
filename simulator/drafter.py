"""The simulated draft model (pure): its greedy prediction of each token, from the ids alone.

The drafter's greedy (argmax) prediction of ``tokens[i]`` from ``tokens[:i]`` is ``tokens[i]``
itself with probability ``match``, decided by a uniform draw keyed by a blake2b hash of the
context ids ``tokens[:i]``; otherwise it is another id of the fixed vocabulary, also chosen by
that hash. Keyed by the context, not by the request, it is a function of the ids only: the same on
every server, in the speculative replay (``proposer="draft_model"``) and when teacher forcing
reads it back through ``prompt_logprobs`` (:func:`prompt_logprobs`), as vLLM's
``/v1/completions`` with a token-id prompt and ``prompt_logprobs`` answers.

Replay (:func:`drafter_proposer`): a draft at ``j`` output tokens is the drafter's ``k``
autoregressive greedy predictions, so it accepts the number of consecutive positions from ``j``
where the prediction equals the actual token (``k`` at most; the step contract in
:mod:`simulator.acceptance` cuts it to ``r − 1``). Predictions after the first miss are from a
context the target never had; they are kept as the drafter's (they are rejected either way).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

from simulator.acceptance import Proposer
from simulator.tokens import SPECIAL_PIECES, VOCABULARY, decode_piece

_FIRST_ORDINARY = len(SPECIAL_PIECES)
_ORDINARY = len(VOCABULARY) - _FIRST_ORDINARY


def _context_keys(tokens: Sequence[int]) -> list[bytes]:
    """``keys[i]``: the hash of ``tokens[:i]`` for every ``i`` in ``[0, len(tokens)]``."""
    h = hashlib.blake2b(b"drafter", digest_size=16)
    keys = [h.digest()]
    for token in tokens:
        h.update(token.to_bytes(8, "big"))
        keys.append(h.copy().digest())
    return keys


def _prediction(key: bytes, actual: int, match: float) -> tuple[int, float]:
    """(the greedy prediction, the draw's second uniform) for a context ``key``."""
    u = int.from_bytes(key[:8], "big") / 2**64
    v = int.from_bytes(key[8:], "big") / 2**64
    if u < match:
        return actual, v
    other = _FIRST_ORDINARY + int(v * _ORDINARY)
    if other == actual:
        other = _FIRST_ORDINARY + (other - _FIRST_ORDINARY + 1) % _ORDINARY
    return other, v


def predictions(tokens: Sequence[int], match: float) -> list[int | None]:
    """``out[i]``: the drafter's greedy prediction of ``tokens[i]`` from ``tokens[:i]``
    (``None`` at 0: nothing predicts the first token)."""
    keys = _context_keys(tokens)
    return [None, *(_prediction(keys[i], tokens[i], match)[0] for i in range(1, len(tokens)))]


def confidences(tokens: Sequence[int], match: float) -> list[float | None]:
    """``out[i]``: the drafter's probability of its own prediction of ``tokens[i]`` — the
    rank-1 logprob :func:`prompt_logprobs` reports, exponentiated (``None`` at 0)."""
    keys = _context_keys(tokens)
    return [
        None,
        *(math.exp(_best_logprob(_prediction(keys[i], tokens[i], match)[1]))
          for i in range(1, len(tokens))),
    ]  # fmt: skip


def _best_logprob(v: float) -> float:
    return -round(0.05 + 0.6 * v, 4)


def drafter_proposer(
    full: Sequence[int], match: float, *, threshold: float | None = None
) -> Proposer:
    """A proposer over contexts that are prefixes of ``full`` (prompt + the actual output).

    ``threshold``: confidence early exit — the draft stops after the first token whose
    probability (:func:`confidences`) is under it, as transformers'
    ``assistant_confidence_threshold`` does."""
    preds = predictions(full, match)
    probs = confidences(full, match) if threshold is not None else None

    def propose(context: Sequence[int], k: int) -> list[int]:
        start = len(context)
        out: list[int] = []
        for i in range(start, min(start + k, len(preds))):
            p = preds[i]
            if p is None:
                continue
            out.append(p)
            q = probs[i] if probs is not None else None
            if threshold is not None and q is not None and q < threshold:
                break
        return out

    return propose


def _decoded(token_id: int) -> str:
    piece = decode_piece(token_id)
    return piece if piece is not None else ""


def prompt_logprobs(tokens: Sequence[int], match: float, top: int) -> list[Any]:
    """vLLM's ``prompt_logprobs`` for a prompt: ``None`` first, then per position a dict keyed by
    the token id (as a string) holding the actual token and the ``max(top, 1)`` best — the
    argmax (rank 1) being the drafter's prediction. Logprobs are plausible, not normalised."""
    keys = _context_keys(tokens)
    out: list[Any] = [None]
    for i in range(1, len(tokens)):
        actual = tokens[i]
        predicted, v = _prediction(keys[i], actual, match)
        best_lp = _best_logprob(v)
        ranked = [
            predicted,
            *(
                _FIRST_ORDINARY + (predicted - _FIRST_ORDINARY + 7 * n) % _ORDINARY
                for n in range(1, max(top, 1))
            ),
        ]
        entry: dict[str, Any] = {}
        for rank, token_id in enumerate(ranked, start=1):
            entry[str(token_id)] = {
                "logprob": best_lp if rank == 1 else round(best_lp - 1.5 * rank, 4),
                "rank": rank,
                "decoded_token": _decoded(token_id),
            }
        if str(actual) not in entry:
            rank = len(ranked) + 1 + int(v * 5)
            entry = {
                str(actual): {
                    "logprob": round(best_lp - math.log(rank) - 1.0, 4),
                    "rank": rank,
                    "decoded_token": _decoded(actual),
                },
                **entry,
            }
        out.append(entry)
    return out
