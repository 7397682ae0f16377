"""Target-likelihood scoring (pure): ``prompt_logprobs`` over a chat prompt's ids + an answer's.

A scorer (specshadow's ``quality.likelihood``, :mod:`evidence.likelihood`) sends one
``/v1/completions`` request whose ``prompt`` is the ids ``POST /tokenize`` gave for the chat
messages followed by an answer's output ids, with ``prompt_logprobs``. On a sampling server
(``SimConfig.sampling``) the output positions then carry the server's model's exact raw
log-probabilities (:func:`simulator.sampling.raw_logprob`: temperature 1, no truncation, as
vLLM's ``prompt_logprobs`` are), conditioned on the *original* prompt — the digest an answer to
those messages was drawn under:

- **The split.** The chat template (:mod:`simulator.tokens`) ends every message with
  ``<|im_end|>``, ``"\\n"`` and the prompt with the generation prompt ``<|im_start|>``,
  ``assistant``, ``"\\n"``; :func:`split_chat` reads the blocks back from the start, and the
  first ``<|im_start|>`` with no ``<|im_end|>`` after it is the generation prompt: what follows
  is the output (a sampled answer never contains a special piece).
- **The digest.** Each block decodes (:func:`simulator.tokens.decode`) to its role and content;
  the messages ``[{"role", "content"}, …]`` (a leading ``tools`` block left out: the offered
  tools are not part of a text answer's canonical form) give the canonical bytes a chat request
  with those messages has (:func:`simulator.request.chat_canonical`), hence its digest.
- **The tokens.** Each output id decodes to a piece; a word piece (any capitalisation, with or
  without its leading space), ``"."`` or ``","`` is that model token. Its entry holds the
  actual token with its raw logprob and its rank among the model's tokens, and the rank-1
  token (the model's argmax: what this server, run as a drafter, predicts).

Exact where the messages round-trip: string contents, only ``role`` and ``content`` keys, no
special piece inside a content, every hashed piece seen by this process (``/tokenize`` sees
them). Otherwise, and for completions prompts (nothing marks where a text prompt ends), the
entries stay the drafter's (:func:`simulator.drafter.prompt_logprobs`). A piece that is no model
token gets ``-9999.0``, vLLM's floor for an impossible token's logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from simulator.config import SimConfig
from simulator.request import chat_canonical
from simulator.sampling import COMMA, EOS, PERIOD, VOCAB, logits, model_for, pieces, raw_logprob
from simulator.textgen import WORDS, digest
from simulator.tokens import ENDOFTEXT, IM_END, IM_START, decode, decode_piece, piece_id

__all__ = ["FLOOR", "model_token", "scored_prompt_logprobs", "split_chat"]

FLOOR = -9999.0  # vLLM's logprob floor (it never writes -inf)
_IM_START, _IM_END, _NL = piece_id(IM_START), piece_id(IM_END), piece_id("\n")
_WORD_ID = {w: i for i, w in enumerate(WORDS)}


def split_chat(ids: Sequence[int]) -> tuple[bytes, int] | None:
    """(the digest of the chat request, where its output starts) for ids that are a chat
    prompt with the generation prompt followed by an output; None when they are not."""
    messages: list[dict[str, str]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] != _IM_START:
            return None
        try:
            nl = ids.index(_NL, i + 1)
        except ValueError:
            return None
        try:
            end = ids.index(_IM_END, nl + 1)
        except ValueError:
            end = -1
        try:
            role = decode(ids[i + 1 : nl])
            if end < 0:  # the generation prompt: the rest is the output
                if role != "assistant":
                    return None
                canonical = chat_canonical(messages, None, None, False)
                return digest(canonical), nl + 1
            content = decode(ids[nl + 1 : end])
        except KeyError:  # a hashed piece this process never saw
            return None
        if end + 1 >= n or ids[end + 1] != _NL:
            return None
        if not (role == "tools" and not messages and i == 0):
            messages.append({"role": role, "content": content})
        i = end + 2
    return None


def model_token(piece: str | None) -> int | None:
    """The model token (:data:`simulator.sampling.VOCAB` index) a text piece spells, or None."""
    if piece == ".":
        return PERIOD
    if piece == ",":
        return COMMA
    if piece is None:
        return None
    return _WORD_ID.get(piece.lstrip(" ").lower())


def _spelling(prev: int | None, first: bool, token: int) -> tuple[int, str]:
    """The id and piece the model writes ``token`` as after ``prev``."""
    if token == EOS:
        return piece_id(ENDOFTEXT), ENDOFTEXT
    piece = pieces([token])[0] if first or prev is None else pieces([prev, token])[1]
    return piece_id(piece), piece


def scored_prompt_logprobs(
    config: SimConfig, prompt_ids: Sequence[int], teacher: list[Any]
) -> list[Any] | None:
    """``teacher`` (vLLM-shaped ``prompt_logprobs`` for ``prompt_ids``) with every output
    position of a chat prompt + output scored under the server's model (see the module doc);
    None when the ids are not one."""
    found = split_chat(prompt_ids)
    if found is None:
        return None
    prompt_digest, start = found
    model = model_for(config)
    out = list(teacher)
    prev: int | None = None
    for j, token_id in enumerate(prompt_ids[start:]):
        piece = decode_piece(token_id)
        token = model_token(piece)
        if token is None:
            out[start + j] = {
                str(token_id): {"logprob": FLOOR, "rank": len(VOCAB), "decoded_token": piece or ""}
            }
            prev = None
            continue
        values = logits(model, prompt_digest, prev, j)
        lp = raw_logprob(model, prompt_digest, prev, j, token)
        best = max(range(len(values)), key=lambda t: (values[t], -t))
        entry: dict[str, Any] = {
            str(token_id): {
                "logprob": lp if lp > FLOOR else FLOOR,
                "rank": 1 + sum(1 for v in values if v > values[token]),
                "decoded_token": piece,
            }
        }
        best_id, best_piece = _spelling(prev, j == 0, best)
        if best != token and str(best_id) not in entry:
            best_lp = raw_logprob(model, prompt_digest, prev, j, best)
            entry[str(best_id)] = {
                "logprob": max(best_lp, FLOOR),
                "rank": 1,
                "decoded_token": best_piece,
            }
        out[start + j] = entry
        prev = token
    return out
