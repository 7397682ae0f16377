"""The speculative step model: which steps draft, how many drafts each accepts (pure, seeded).

A request's output of ``n`` tokens is produced by steps: the prefill step emits the first token
(vLLM drafts nothing before the first token exists), then each decode step either has no draft
(probability 1 − coverage, or plain mode) and emits 1 token, or drafts ``min(k, remaining − 1)``
tokens, accepts a prefix of them (position ``i`` accepted with conditional probability ``p[i]``
given ``i − 1`` was; the chain stops at the first rejection) and emits accepted + 1 tokens (the
bonus token). Unlike vLLM, which may draft past ``max_tokens`` and discard the surplus, the
proposer here never drafts past the end, so every step emits exactly accepted + 1 tokens and the
ground truth adds up with no exceptions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.config import SimConfig


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
    """What :func:`plan_steps` converges to for ``config`` and ``category``."""
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
