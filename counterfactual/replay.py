"""One speculative configuration replayed along one output: the engine's steps, as vLLM takes them.

The contract (the simulator's replay mode follows the same one, so its reports are ground truth):
the prefill step emits output token 0 and drafts nothing. Then, with ``j`` output tokens emitted
and ``r = n − j`` left, a decode step drafts ``d = min(k, available, r − 1)`` tokens — never past
the end of the output — where ``available`` is what the proposer can offer at ``j`` (an n-gram
match's continuation, bounded by the context; unbounded for a draft model). ``d == 0`` is a step
without a draft. The target accepts the longest prefix of the draft that equals the output's
next tokens, ``a = min(match_j, d)``, and the step emits ``a + 1`` tokens (the bonus token).

Why "accepted iff equal" is right for sampled requests too: a one-hot draft token ``x`` is accepted
by rejection sampling with probability ``p(x)``, and when rejected the emitted token is drawn from
``p`` without ``x`` — the same joint law as drawing the output token from ``p`` and accepting iff
it equals ``x``. So along an output the target really sampled, the replayed acceptance is an exact
draw of what that configuration would have accepted; averages over requests are unbiased. vLLM's
n-gram, draft-model and EAGLE proposers all draft one-hot (greedy) tokens.

Where it differs from vLLM: vLLM drafts all ``k`` at the last step and counts acceptances past
``max_tokens`` that it then discards; what the model would have said there is unknowable, so the
replay stops at the end (one step per request; docs/counterfactual.md).

A dynamic rule (:mod:`.rules`) chooses each step's ``k`` from the steps before it; the step
contract is the same, and the rule hears each step's drafted and accepted counts. Beside the
counts, a replay keeps where drafts were rejected (the output position of each step's first
rejected draft token, for :mod:`.rejections`) and the steps that started within the output's
first :data:`FIRST_TOKENS` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from counterfactual.rules import Rule

__all__ = ["FIRST_TOKENS", "Replay", "confidence_offers", "replay"]

FIRST_TOKENS = 16  # "the first tokens" of an output, against the rest (acceptance by position)


@dataclass(frozen=True, slots=True)
class Replay:
    """What one configuration would have done on one output."""

    k: int
    output_tokens: int
    passes: int  # target forward passes, the prefill included
    drafts: int  # steps that drafted (vLLM's num_spec_steps / num_drafts)
    draft_tokens: int
    accepted: int
    accepted_by_position: tuple[int, ...]  # drafting steps that accepted draft position i
    # The output position of each drafting step's first rejected draft token (steps that
    # accepted their whole draft have none).
    rejected_at: tuple[int, ...] = ()
    # Drafting steps, drafted and accepted tokens of the steps that started within the first
    # FIRST_TOKENS output tokens.
    early: tuple[int, int, int] = (0, 0, 0)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted per drafting step (vLLM's definition); None when nothing was drafted."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def tokens_per_pass(self) -> float | None:
        return self.output_tokens / self.passes if self.passes else None


def replay(
    n: int,
    k: int,
    available: Sequence[int],
    match: Sequence[int],
    rule: Rule | None = None,
) -> Replay:
    """Steps of depth ``k`` — or of the depth ``rule`` chooses before each step, up to its cap —
    along an output of ``n`` tokens.

    ``available[j]`` / ``match[j]`` (``j`` in ``[0, n)``; index 0 is never read): the draft
    tokens the proposer offers with ``j`` tokens emitted, and how many leading tokens of that
    offer equal the output from ``j`` on.
    """
    controller = rule.controller() if rule is not None else None
    if rule is not None:
        k = rule.cap
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    by_position = [0] * k
    rejected: list[int] = []
    early = [0, 0, 0]
    passes = drafts = draft_tokens = accepted = 0
    if n > 0:
        passes, j = 1, 1
        while j < n:
            passes += 1
            wanted = controller.k if controller is not None else k
            d = min(wanted, available[j], n - j - 1)
            if d <= 0:
                if controller is not None:
                    controller.update(wanted, 0, 0)
                j += 1
                continue
            a = min(match[j], d)
            drafts += 1
            draft_tokens += d
            accepted += a
            for i in range(a):
                by_position[i] += 1
            if a < d:
                rejected.append(j + a)
            if j < FIRST_TOKENS:
                early[0] += 1
                early[1] += d
                early[2] += a
            if controller is not None:
                controller.update(wanted, d, a)
            j += a + 1
    return Replay(
        k=k,
        output_tokens=max(n, 0),
        passes=passes,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted=accepted,
        accepted_by_position=tuple(by_position),
        rejected_at=tuple(rejected),
        early=(early[0], early[1], early[2]),
    )


def common_prefix(seq: Sequence[int], a: int, b: int, limit: int) -> int:
    """How many of ``seq[a:a+limit]`` equal ``seq[b:b+limit]``, from the start."""
    n = 0
    while n < limit and seq[a + n] == seq[b + n]:
        n += 1
    return n


def ngram_offers(
    prompt: Sequence[int], output: Sequence[int], min_n: int, max_n: int, max_k: int
) -> tuple[list[int], list[int]]:
    """(available, match) per output position for vLLM's n-gram proposer (:mod:`.ngram`)."""
    from counterfactual.ngram import NO_DRAFT, draft_starts

    seq = (*prompt, *output)
    p, n = len(prompt), len(output)
    available, match = [0] * n, [0] * n
    if n < 2:
        return available, match
    for j, start in enumerate(draft_starts(seq, p + 1, min_n, max_n), start=1):
        if start == NO_DRAFT:
            continue
        context = p + j
        offer = min(context - start, max_k)
        available[j] = offer
        match[j] = common_prefix(seq, start, context, min(offer, n - j))
    return available, match


def drafter_offers(output: Sequence[int], predicted: Sequence[int]) -> tuple[list[int], list[int]]:
    """(available, match) for a draft model whose greedy prediction of output token ``j`` (from
    the prompt and ``output[:j]``, teacher-forced) is ``predicted[j]``.

    Its ``k`` drafts at ``j`` are autoregressive; each after the first is conditioned on the
    drafts before it, which equal the output's tokens exactly as long as they are accepted, so
    the teacher-forced predictions decide every accepted prefix.
    """
    n = len(output)
    if len(predicted) != n:
        raise ValueError(f"expected {n} predictions, got {len(predicted)}")
    match = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        match[j] = match[j + 1] + 1 if predicted[j] == output[j] else 0
    return [n] * n, match[:n]


def confidence_offers(
    output: Sequence[int],
    predicted: Sequence[int],
    probability: Sequence[float],
    threshold: float,
    cap: int,
) -> tuple[list[int], list[int]]:
    """(available, match) for a draft model that stops drafting after the first token it gave a
    probability under ``threshold`` (``probability[j]``: the drafter's probability of its own
    prediction of output token ``j``, teacher-forced).

    Exact on every accepted prefix: while drafts are accepted their contexts are the output's,
    so the teacher-forced probabilities are the drafter's. Past the first wrong prediction the
    drafter's context is its own wrong token, which no record holds: the draft is counted up to
    that token (accepted counts are exact; drafted tokens a lower bound).
    """
    n = len(output)
    if len(predicted) != n or len(probability) != n:
        raise ValueError(f"expected {n} predictions and probabilities")
    _, match = drafter_offers(output, predicted)
    available = [0] * n
    for j in range(n):
        i = 0
        while i < cap and j + i < n:
            i += 1
            if probability[j + i - 1] < threshold or predicted[j + i - 1] != output[j + i - 1]:
                break
        available[j] = i
    return available, match
