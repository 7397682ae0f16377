"""Target-likelihood scoring of shadow legs, for the report's ``loglik`` metric (docs/quality.md).

For an exchange the token tap (:mod:`evidence.tokens`) picked — sampled (not greedy), with a
completed baseline leg and at least one completed candidate leg, each one plain-text choice —
every one of those shadow legs' outputs is scored under the target model on the policy's scorer
backend (never the primary): the prompt's ids from the scorer's ``POST /tokenize`` (the chat
template with the generation prompt, as the engine applies it), the leg's output ids (its own
generated ids when it sent them — shadow legs are asked for vLLM's ``return_token_ids`` while
scoring is on — else its text tokenized by the scorer), then one ``POST /v1/completions`` with
``prompt`` = prompt + output ids, ``max_tokens: 1``, ``prompt_logprobs: 0``, ``temperature: 0``.
vLLM's ``prompt_logprobs`` (``null`` first, then per position ``{token_id: {logprob, rank,
decoded_token}}``, the actual token always among them) gives the log-probability of every
output token given everything before it; the mean over the output positions is the leg's
score. vLLM computes prompt logprobs from the raw logits (temperature 1, no truncation), so
a lossless candidate's outputs score like the baseline's in distribution, one that collapses to
greedy scores higher and another model lower.

An exchange is scored all or nothing: any failed call leaves it without a likelihood. The tap
owns the budget, the timeouts' accounting and the hand-off (:class:`evidence.tokens.TokenTap`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.exchange import Exchange, LegLikelihood, LegResult, Likelihood
from evidence.compare import is_greedy

__all__ = [
    "LikelihoodPlan",
    "Post",
    "output_logprobs",
    "score",
    "scored_legs",
]

# POST url with a JSON body under a timeout → the decoded JSON answer (raises on failure).
Post = Callable[[str, Mapping[str, Any], float], Awaitable[Any]]


# Backend kinds that answer vLLM's /tokenize and prompt_logprobs (the default scorer's test).
SCORING_KINDS = frozenset({"vllm", "sim"})


@dataclass(frozen=True, slots=True)
class LikelihoodPlan:
    """Where and how much to score (the policy's ``quality.likelihood`` section).

    ``scorer_name`` / ``scorer_url`` None: each exchange's baseline leg scores it, when its
    backend is in ``baseline_scorers`` (name → base URL); otherwise the exchange goes unscored.
    """

    scorer_name: str | None
    scorer_url: str | None  # base URL, no ``/v1``
    baseline_scorers: Mapping[str, str] = field(default_factory=dict)
    share: float = 0.5
    max_in_flight: int = 4
    timeout_s: float = 10.0


def _plain_text(leg: LegResult) -> bool:
    rec = leg.recording
    if leg.outcome != "completed" or rec is None or len(rec.choices) != 1:
        return False
    choice = rec.choices[0]
    return bool(choice.text) and not choice.tool_calls and not choice.refusal


def scorable(plan: LikelihoodPlan, legs: Sequence[LegResult]) -> bool:
    """A scorer exists for these legs (a fixed one, or the baseline's backend can score)."""
    return plan.scorer_name is not None or legs[0].backend in plan.baseline_scorers


def scored_legs(exchange: Exchange) -> tuple[LegResult, ...] | None:
    """The shadow legs to score — the baseline, then every candidate — when the exchange is
    eligible: sampled (not greedy), with a completed plain-text baseline leg and at least one
    completed plain-text candidate leg; None otherwise. Failed candidates are left out."""
    if is_greedy(exchange.temperature, exchange.seed):
        return None
    baseline = [s for s in exchange.shadows if s.role == "baseline" and _plain_text(s)]
    candidates = [s for s in exchange.shadows if s.role == "candidate" and _plain_text(s)]
    if not baseline or not candidates:
        return None
    return (baseline[0], *candidates)


def output_logprobs(
    prompt_logprobs: object, start: int, output: Sequence[int]
) -> tuple[float, ...] | None:
    """The logprob of ``output[i]`` at position ``start + i`` of vLLM's ``prompt_logprobs``, for
    every ``i``; None when the list is too short, malformed, or lacks an actual token."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < start + len(output):
        return None
    out: list[float] = []
    for entry, token in zip(prompt_logprobs[start : start + len(output)], output, strict=True):
        if not isinstance(entry, Mapping):
            return None
        info = entry.get(str(token), entry.get(token))
        logprob = info.get("logprob") if isinstance(info, Mapping) else None
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            return None
        value = float(logprob)
        if math.isnan(value):
            return None
        out.append(value)
    return tuple(out)


def _ids(answer: Any, what: str) -> tuple[int, ...]:
    ids = answer["tokens"]
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError(f"/tokenize ({what}): 'tokens' is not a list of integers")
    return tuple(ids)


async def score(
    post: Post,
    plan: LikelihoodPlan,
    exchange: Exchange,
    prompt_body: Mapping[str, Any],
    generated: Mapping[str, tuple[int, ...]],
) -> Likelihood | None:
    """Score the eligible legs (:func:`scored_legs`) on the scorer; None when none is eligible.

    ``prompt_body``: the ``/tokenize`` body of the exchange's prompt; ``generated``: each
    backend's generated ids, where its leg sent them. Raises what a failed call raises
    (``aiohttp.ClientError``, ``TimeoutError``, ``ValueError``, ``KeyError``, ``TypeError``,
    ``IndexError``).
    """
    legs = scored_legs(exchange)
    if legs is None:
        return None
    scorer_name, base = plan.scorer_name, plan.scorer_url
    if scorer_name is None or base is None:
        scorer_name = legs[0].backend  # the baseline leg
        base = plan.baseline_scorers.get(scorer_name)
        if base is None:
            return None
    timeout = plan.timeout_s
    model = (
        next((s.upstream_model for s in exchange.legs if s.backend == scorer_name), None)
        or exchange.requested_model
    )
    extra: dict[str, Any] = {"model": model} if model else {}
    prompt = _ids(await post(base + "/tokenize", {**extra, **prompt_body}, timeout), "prompt")
    if not prompt:
        raise ValueError("/tokenize (prompt): no tokens")

    async def one(leg: LegResult) -> tuple[str, LegLikelihood | None]:
        own = generated.get(leg.backend)
        source: Literal["engine", "tokenize"]
        if own:
            ids, source = own, "engine"
        else:
            assert leg.recording is not None
            body = {**extra, "prompt": leg.recording.choices[0].text, "add_special_tokens": False}
            ids, source = _ids(await post(base + "/tokenize", body, timeout), "output"), "tokenize"
        if not ids:
            return leg.backend, None
        answer = await post(
            base + "/v1/completions",
            {
                **extra,
                "prompt": [*prompt, *ids],
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": 0,
            },
            timeout,
        )
        lps = output_logprobs(answer["choices"][0].get("prompt_logprobs"), len(prompt), ids)
        if lps is None:
            raise ValueError(f"{scorer_name}: no prompt_logprobs for the output positions")
        return leg.backend, LegLikelihood(sum(lps) / len(lps), len(lps), source)

    tasks = [asyncio.ensure_future(one(leg)) for leg in legs]
    try:
        scored = await asyncio.gather(*tasks)
    except BaseException:  # one call failed (or we were cancelled): the others stop too
        for task in tasks:
            task.cancel()
        raise
    out = {name: leg for name, leg in scored if leg is not None}
    return Likelihood(scorer=scorer_name, legs=out) if out else None
