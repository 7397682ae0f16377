"""Cross-vocabulary drafters replayed: Token-Level Intersection (TLI) and string-level matching (SLEM).

A drafter with its own tokenizer proposes through one of two rules, reproduced here from their
implementations:

**TLI** — vLLM 0.32.0, ``vllm/v1/spec_decode/vocab_mapping.py`` (``VocabMapping``) and
``vllm/v1/spec_decode/llm_base_proposer.py`` (``_greedy_sample``), enabled by
``speculative_config.use_heterogeneous_vocab: true``, only with ``method: "draft_model"`` and
greedy drafts (``vllm/config/speculative.py``). At start every token string of each vocabulary is
normalised — a leading space marker (the tokenizer's own, probed by encoding ``" a"``; when that
fails both ``"Ġ"`` and ``"▁"``) becomes ``" "`` — and, per normalised string, the first id in
``get_vocab()``'s order is kept. The intersection is the normalised strings both sides have.
The drafter reads the context through ``target → draft`` (a target token outside the
intersection becomes the drafter's ``unk``, else ``eos``), its logits are masked to the
intersection, and its argmax goes back through ``draft → target``. So a drafter can never
propose a target token outside the intersection: wherever the output holds one, the draft is
rejected **by construction**.

**SLEM** — Hugging Face transformers' Universal Assisted Generation
(``src/transformers/generation/candidate_generator.py``, ``AssistedCandidateGeneratorDifferent
Tokenizers``, read at commit 00a11b6a of huggingface/transformers): the target's ids are decoded
(``skip_special_tokens``, ``clean_up_tokenization_spaces``) and re-encoded with the assistant's
tokenizer, the assistant generates ``num_assistant_tokens`` of its own tokens, the window is
decoded and re-encoded with the target's tokenizer, the new target ids (after the longest
diagonal alignment with the target's context) are the candidates, and the target accepts
the longest prefix equal to its own tokens. The match is on text: a draft is useful exactly as
far as its text spells the output's and the target's tokenizer spells that prefix as the output
does.

**Replay classes.** TLI is *exact given the drafter*: the input is the drafter's teacher-forced
greedy prediction, masked to the intersection, in draft ids (what ``_greedy_sample`` computes),
with the context read through ``target → draft`` as vLLM feeds it; the steps are
:func:`counterfactual.replay.replay`'s. SLEM is *approximate*: the input is the drafter's
greedy text at each output position (its ``num_assistant_tokens`` decoded); accepted target
tokens are the output's tokens whose text the draft spells in order (equal to the re-encoding
wherever the target tokenizer splits that text as the output did — the assumption the
re-tokenized records of :mod:`counterfactual.retokenize` make too), and a leftover of draft
text counts one more drafted (rejected) target token, so drafted tokens are a lower bound
(accepted counts are exact under the assumption). The candidates carry no
logits, so transformers' ``assisted_decoding`` accepts a candidate iff it equals the target's
own (argmax or sampled) token: "accepted iff equal" holds for sampled requests as well.

Inputs: records carry no cross-vocabulary drafter's predictions; ``specshadow counterfactual
--cross-vocab`` asks the drafter for them offline (:mod:`.crossvocab_drafter`) and the matrix
scores them at every depth (rows with ``cross_vocabulary: true``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from counterfactual.replay import Replay, drafter_offers, replay

__all__ = [
    "FALLBACK_SPACE_PREFIXES",
    "SLEM_CLASS",
    "TLI_CLASS",
    "Intersection",
    "normalize_token",
    "slem_offers",
    "slem_replay",
    "summarize",
    "tli_predictions",
    "tli_replay",
]

FALLBACK_SPACE_PREFIXES: tuple[str, ...] = ("\u0120", "\u2581")  # "Ġ" (BPE), "▁" (SentencePiece)
TLI_CLASS = "exact given the drafter (vLLM use_heterogeneous_vocab, token-level intersection)"
SLEM_CLASS = (
    "approximate (string-level exact match; target re-encoding assumed to spell as the output)"
)


def normalize_token(token: str, space_prefixes: Sequence[str]) -> str:
    """vLLM's ``_normalize_token``: the first matching space marker becomes ``" "``."""
    for prefix in space_prefixes:
        if token.startswith(prefix):
            return " " + token[len(prefix) :]
    return token


def _normalized(vocab: Mapping[str, int], prefixes: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for token, tid in vocab.items():  # the first id per normalised string wins, as in vLLM
        out.setdefault(normalize_token(token, prefixes), tid)
    return out


@dataclass(frozen=True, slots=True)
class Intersection:
    """vLLM's ``VocabMapping`` without tensors: both directions of the id map and the unk ids."""

    draft_to_target: Mapping[int, int]
    target_to_draft: Mapping[int, int]
    target_unk: int
    draft_unk: int

    @classmethod
    def build(
        cls,
        target_vocab: Mapping[str, int],
        draft_vocab: Mapping[str, int],
        *,
        target_unk: int,
        draft_unk: int,
        target_prefixes: Sequence[str] = FALLBACK_SPACE_PREFIXES,
        draft_prefixes: Sequence[str] = FALLBACK_SPACE_PREFIXES,
        target_vocab_size: int | None = None,
        draft_vocab_size: int | None = None,
    ) -> Intersection:
        """``*_vocab``: ``tokenizer.get_vocab()`` (its order matters); ``*_prefixes``: the space
        marker the tokenizer spells ``" a"`` with (vLLM's probe), else both fallbacks; ``*_unk``:
        ``unk_token_id``, else ``eos_token_id``; ids at or past a vocab size are left out."""
        t_norm = _normalized(target_vocab, target_prefixes)
        d_norm = _normalized(draft_vocab, draft_prefixes)
        t_size = (
            target_vocab_size
            if target_vocab_size is not None
            else 1 + max(t_norm.values(), default=-1)
        )
        d_size = (
            draft_vocab_size
            if draft_vocab_size is not None
            else 1 + max(d_norm.values(), default=-1)
        )
        d2t: dict[int, int] = {}
        t2d: dict[int, int] = {}
        for norm in t_norm.keys() & d_norm.keys():
            t_id, d_id = t_norm[norm], d_norm[norm]
            if t_id < t_size and d_id < d_size:
                d2t[d_id] = t_id
                t2d[t_id] = d_id
        return cls(d2t, t2d, target_unk, draft_unk)

    @property
    def size(self) -> int:
        return len(self.draft_to_target)

    def to_draft(self, target_ids: Iterable[int]) -> list[int]:
        """The context as the drafter reads it (``map_target_to_draft_ids``)."""
        return [self.target_to_draft.get(t, self.draft_unk) for t in target_ids]

    def to_target(self, draft_ids: Iterable[int]) -> list[int]:
        """``map_draft_to_target_ids``."""
        return [self.draft_to_target.get(d, self.target_unk) for d in draft_ids]


def tli_predictions(intersection: Intersection, draft_argmax: Sequence[int | None]) -> list[int]:
    """The target ids a TLI drafter proposes: its masked greedy predictions (draft ids; ``None``
    where nothing predicts, e.g. position 0) through ``draft → target``."""
    return [
        -1 if d is None else intersection.draft_to_target.get(d, intersection.target_unk)
        for d in draft_argmax
    ]


def tli_replay(
    intersection: Intersection, output: Sequence[int], draft_argmax: Sequence[int | None], k: int
) -> tuple[Replay, int, int]:
    """(the replay, output tokens outside the intersection, drafting steps whose first rejected
    token was outside it — rejections by construction)."""
    predicted = tli_predictions(intersection, draft_argmax)
    available, match = drafter_offers(output, predicted)
    r = replay(len(output), k, available, match)
    outside = sum(t not in intersection.target_to_draft for t in output)
    by_construction = sum(output[i] not in intersection.target_to_draft for i in r.rejected_at)
    return r, outside, by_construction


def slem_offers(
    output_texts: Sequence[str], draft_texts: Sequence[str | None]
) -> tuple[list[int], list[int]]:
    """(available, match) for a string-level drafter: ``draft_texts[j]`` is its greedy text
    continuation with ``j`` output tokens emitted (``None``: no draft). ``match[j]``: the output
    tokens from ``j`` whose texts the draft spells in order; ``available[j]``: those plus one
    for any draft text left over (a rejected target token)."""
    n = len(output_texts)
    if len(draft_texts) != n:
        raise ValueError(f"expected {n} draft texts, got {len(draft_texts)}")
    available = [0] * n
    match = [0] * n
    for j, draft in enumerate(draft_texts):
        if not draft:
            continue
        pos = m = 0
        i = j
        while i < n and output_texts[i] and draft.startswith(output_texts[i], pos):
            pos += len(output_texts[i])
            m += 1
            i += 1
        match[j] = m
        available[j] = m + (1 if pos < len(draft) else 0)
    return available, match


def slem_replay(output_texts: Sequence[str], draft_texts: Sequence[str | None]) -> Replay:
    """SLEM's steps along one output. The drafter's depth is its own tokens' (transformers'
    ``num_assistant_tokens``), already spent on ``draft_texts``; the target verifies every target
    token the text re-encodes to, so nothing else caps a step."""
    available, match = slem_offers(output_texts, draft_texts)
    return replay(len(output_texts), max(1, len(output_texts)), available, match)


def _rates(replays: Sequence[Replay]) -> dict[str, float | int | None]:
    drafts = sum(r.drafts for r in replays)
    drafted = sum(r.draft_tokens for r in replays)
    accepted = sum(r.accepted for r in replays)
    passes = sum(r.passes for r in replays)
    out = sum(r.output_tokens for r in replays)
    return {
        "requests": len(replays),
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_pass": out / passes if passes else None,
    }


def summarize(
    intersection: Intersection | None,
    requests: Iterable[
        tuple[
            str,
            Sequence[int],
            Sequence[int | None] | None,
            Sequence[str] | None,
            Sequence[str | None] | None,
        ]
    ],
    k: int,
) -> dict[str, dict[str, object]]:
    """Per category: the TLI replay at depth ``k`` and the SLEM replay of the drafter's texts. Each request is ``(category,
    output ids, the drafter's masked greedy draft ids or None, output token texts or None, the
    drafter's greedy texts or None)``; a rule without its input is left out for that request."""
    tli: dict[str, list[Replay]] = {}
    slem: dict[str, list[Replay]] = {}
    tally: dict[str, list[int]] = {}
    for category, output, draft_argmax, texts, draft_texts in requests:
        t = tally.setdefault(category, [0, 0, 0])
        t[0] += len(output)
        if intersection is not None and draft_argmax is not None:
            r, outside, by_construction = tli_replay(intersection, output, draft_argmax, k)
            tli.setdefault(category, []).append(r)
            t[1] += outside
            t[2] += by_construction
        if texts is not None and draft_texts is not None:
            slem.setdefault(category, []).append(slem_replay(texts, draft_texts))
    out: dict[str, dict[str, object]] = {}
    for category in sorted(tally):
        n_out, outside, by_construction = tally[category]
        tli_rows = tli.get(category, [])
        rejected = sum(len(r.rejected_at) for r in tli_rows)
        out[category] = {
            "output_tokens": n_out,
            "tli": None
            if not tli_rows
            else {
                "replay_class": TLI_CLASS,
                "intersection_size": intersection.size if intersection is not None else None,
                "outside_intersection": outside,
                "outside_share": outside / n_out if n_out else None,
                "rejections": rejected,
                "rejections_by_construction": by_construction,
                **_rates(tli_rows),
            },
            "slem": None
            if category not in slem
            else {"replay_class": SLEM_CLASS, **_rates(slem[category])},
        }
    return out
