"""The speculative step model: which steps draft, how many drafts each accepts (pure).

Two ways to decide the steps: drawn from per-position probabilities (:func:`plan_steps`,
``drafting="probabilistic"``) or replayed from a real proposer over token ids
(:func:`replay_steps`, ``drafting="replay"``). A sampled answer (``SimConfig.sampling``) with
drawn drafts takes its steps from real speculative sampling instead
(:func:`simulator.sampling.generate`), under the same step contract.

**Drawn** (seeded). A request's output of ``n`` tokens is produced by steps: the prefill step emits the first token
(vLLM drafts nothing before the first token exists), then each decode step either has no draft
(probability 1 − coverage, or plain mode) and emits 1 token, or drafts ``min(k, remaining − 1)``
tokens, accepts a prefix of them (position ``i`` accepted with conditional probability ``p[i]``
given ``i − 1`` was; the chain stops at the first rejection) and emits accepted + 1 tokens (the
bonus token). Unlike vLLM, which may draft past ``max_tokens`` and discard the surplus, the
proposer here never drafts past the end, so every step emits exactly accepted + 1 tokens and the
ground truth adds up with no exceptions.

**Replayed** — the contract a counterfactual replay of the same ids reproduces. ``prompt`` are
the ids ``POST /tokenize`` returns for the request (the chat template with the generation prompt
for chat and Responses requests, the text's ids for completions), ``out`` the ``n`` output ids
(``text_ids(output_text)``). The prefill step emits ``out[0]`` and drafts nothing (``Step(0,
0)``). Then, while ``j < n`` tokens are emitted, with ``r = n − j`` remaining, one decode step:
``draft = propose(prompt + out[:j], k)[: r − 1]`` — drafts never reach past the end, as above;
``accepted`` = the length of the common prefix of ``draft`` and ``out[j:]``; the step emits
``accepted + 1`` tokens (the accepted drafts and the target's own next token) and is
``Step(len(draft), accepted)``; an empty draft is a non-drafting step, ``Step(0, 0)``. The
output is fixed in advance by the prompt (an exact draw from the "target"), so accepting a draft
token iff it equals the target's token is exactly what lossless rejection sampling does with a
one-hot (greedy) draft distribution: the text is the same as without speculation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from simulator.config import SimConfig
from simulator.lookahead import Schedule


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step of one request: drafts verified, drafts accepted."""

    drafted: int
    accepted: int

    @property
    def emitted(self) -> int:
        return self.accepted + 1


def plan_steps(
    n_tokens: int,
    *,
    speculative: bool,
    probs: Sequence[float],
    coverage: float,
    rng: random.Random,
) -> tuple[Step, ...]:
    """Steps that emit exactly ``n_tokens`` tokens; ``probs`` has one value per draft position."""
    if n_tokens <= 0:
        return ()
    k = len(probs)
    steps = [Step(0, 0)]  # prefill
    emitted = 1
    while emitted < n_tokens:
        remaining = n_tokens - emitted
        drafted = accepted = 0
        if speculative and rng.random() < coverage:
            drafted = min(k, remaining - 1)
            for p in probs[:drafted]:
                if rng.random() >= p:
                    break
                accepted += 1
        steps.append(Step(drafted, accepted))
        emitted += accepted + 1
    return tuple(steps)


Proposer = Callable[[Sequence[int], int], Sequence[int]]  # (context ids, k) -> draft ids


def replay_steps(
    prompt: Sequence[int],
    out: Sequence[int],
    *,
    k: int,
    propose: Proposer,
    lookahead: Schedule | None = None,
) -> tuple[Step, ...]:
    """The steps ``propose`` would have had over ``prompt`` + ``out`` (see the module doc).

    ``lookahead``: a dynamic rule (:mod:`simulator.lookahead`) sets each step's ``k`` instead,
    and hears each step's drafted and accepted counts."""
    n = len(out)
    if n <= 0:
        return ()
    steps = [Step(0, 0)]  # prefill
    context = [*prompt, out[0]]
    j = 1
    while j < n:
        remaining = n - j
        wanted = lookahead.k if lookahead is not None else k
        draft = list(propose(context, wanted))[: remaining - 1]
        accepted = 0
        for want, got in zip(draft, out[j:], strict=False):
            if want != got:
                break
            accepted += 1
        steps.append(Step(len(draft), accepted))
        if lookahead is not None:
            lookahead.verified(wanted, len(draft), accepted)
        context += out[j : j + accepted + 1]
        j += accepted + 1
    return tuple(steps)


@dataclass(frozen=True, slots=True)
class ExpectedRates:
    """Long-output expectations for one config and category (truncation at the end ignored).

    - ``per_position``: P(draft position i accepted) on a drafting step = p0 × … × pi.
    - ``draft_acceptance_rate``: E[accepted] / k (vLLM's Δaccepted / Δdraft_tokens).
    - ``mean_acceptance_length``: 1 + E[accepted] over drafting steps (vLLM's 1 + Δaccepted/Δdrafts).
    - ``tokens_per_step``: coverage × (1 + E[accepted]) + (1 − coverage): tokens per target pass,
      i.e. tokens per streamed event.
    """

    per_position: tuple[float, ...]
    draft_acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_step: float
    coverage: float


def expected_rates(config: SimConfig, category: str = "chat") -> ExpectedRates:
    """What :func:`plan_steps` converges to for ``config`` and ``category`` (drawn drafts only:
    replayed ones depend on the text)."""
    if not config.speculative:
        return ExpectedRates((), 0.0, 1.0, 1.0, 0.0)
    probs = config.acceptance_for(category)
    per_position: list[float] = []
    reach = 1.0
    for p in probs:
        reach *= p
        per_position.append(reach)
    mean_accepted = sum(per_position)
    coverage = config.coverage_for(category)
    return ExpectedRates(
        per_position=tuple(per_position),
        draft_acceptance_rate=mean_accepted / len(probs),
        mean_acceptance_length=1.0 + mean_accepted,
        tokens_per_step=coverage * (1.0 + mean_accepted) + (1.0 - coverage),
        coverage=coverage,
    )
