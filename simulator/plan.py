"""What one request will answer, decided up front (pure): tokens, finish reason, engine steps.

The I/O shell in :mod:`simulator.app` only paces and writes a :class:`Plan`; the plan *is* the
ground truth that tests compare against.

Speculative steps are drawn (:func:`~simulator.acceptance.plan_steps`) or, with
``drafting="replay"``, replayed over the prompt's ids and the output's ids
(:func:`~simulator.acceptance.replay_steps`, whose docstring is the contract): with vLLM's n-gram
proposer (:mod:`simulator.ngram`) or the simulated drafter (:mod:`simulator.drafter`).

Sampled answers (``SimConfig.sampling``, plain text only) are drawn by
:func:`simulator.sampling.generate` — with speculative sampling in speculative mode, whose steps
are then the drawn ones. A request vLLM would not speculate on (penalties, ``min_p``:
``SimRequest.spec_decode_unsupported``) is planned as in plain mode, one token per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from simulator.acceptance import Proposer, Step, plan_steps, replay_steps
from simulator.config import Mode, SimConfig
from simulator.drafter import drafter_proposer, prompt_logprobs
from simulator.lookahead import schedule
from simulator.ngram import find_longest_matched_ngram_and_propose_tokens
from simulator.request import SimRequest
from simulator.sampling import (
    Speculation,
    drafter_for,
    generate,
    model_for,
    pieces,
    raw_logprob,
    request_rng,
)
from simulator.scoring import scored_prompt_logprobs
from simulator.textgen import (
    copying_tokens,
    digest,
    diverged_tokens,
    dump_json,
    json_document,
    natural_length,
    rng_for,
    split_pieces,
    token_logprobs,
    value_for_schema,
    word_tokens,
)
from simulator.tokens import SPECIAL_PIECES, ids_of, text_pieces

OutputKind = Literal["text", "json", "tool_call"]


@dataclass(frozen=True, slots=True)
class SampledWith:
    """How a sampled answer was drawn (``GET /sim/requests`` shows it as ``sampling``)."""

    temperature: float  # the effective temperature (absent in the request: 1.0)
    top_p: float
    seed: int | None
    defect: str

    def to_json(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "defect": self.defect,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    """The answer to one request.

    For ``kind == "tool_call"`` the first token is the function name (streamed as the tool-call
    delta's ``name``), the rest are pieces of the ``arguments`` JSON.
    """

    category: str
    mode: Mode
    kind: OutputKind
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length", "tool_calls"]
    steps: tuple[Step, ...]
    prompt_tokens: int
    prompt_hash: str
    tool_name: str | None
    # completions with prompt_logprobs: the drafter's, and on a sampling server the model's own
    # at a chat prompt's output positions (simulator.scoring)
    prompt_logprobs: list[Any] | None = None
    sampling: SampledWith | None = None  # a sampled answer: what it was drawn with

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def arguments(self) -> str:
        return "".join(self.tokens[1:]) if self.kind == "tool_call" else ""


def _full_tokens(
    request: SimRequest, config: SimConfig, prompt_digest: bytes, category: str
) -> tuple[OutputKind, list[str]]:
    if request.tool is not None:
        params = request.tool.get("parameters")
        schema = params if isinstance(params, dict) else {"type": "object", "properties": {}}
        args = value_for_schema(schema, rng_for("tool", prompt_digest))
        return "tool_call", [str(request.tool["name"]), *split_pieces(dump_json(args))]
    if request.json_mode:
        return "json", split_pieces(
            json_document(request.json_schema, rng_for("json", prompt_digest))
        )
    n = natural_length(prompt_digest, config.min_output_tokens, config.max_output_tokens)
    copy = config.copy_for(category)
    if copy <= 0.0:
        return "text", word_tokens(rng_for("text", prompt_digest), n)
    source = [p for p in request.source_pieces if p not in SPECIAL_PIECES]
    return "text", copying_tokens(
        rng_for("text", prompt_digest),
        rng_for("copy", prompt_digest),
        n,
        source,
        copy,
        text_pieces,
    )


def _proposer(config: SimConfig, request: SimRequest, out: list[int], category: str) -> Proposer:
    if config.proposer == "draft_model":
        rule = schedule(config.lookahead)
        threshold = (
            float(rule.params["threshold"])  # type: ignore[arg-type]  # a number, by parse()
            if rule is not None and rule.name == "confidence"
            else None
        )
        return drafter_proposer(
            [*request.prompt_ids, *out], config.drafter_match_for(category), threshold=threshold
        )
    lo, hi, max_len = config.prompt_lookup_min, config.prompt_lookup_max, config.max_model_len

    def propose(context: Sequence[int], k: int) -> list[int]:
        return find_longest_matched_ngram_and_propose_tokens(context, lo, hi, max_len, k)

    return propose


@dataclass(frozen=True, slots=True)
class _SampledAnswer:
    tokens: list[str]
    logprobs: list[float]
    stopped: bool
    steps: tuple[Step, ...] | None  # drawn by speculative sampling; None: plan them as usual
    drawn_with: SampledWith


def _sampled_answer(
    config: SimConfig, request: SimRequest, prompt_digest: bytes, category: str, speculative: bool
) -> _SampledAnswer:
    model = model_for(config)
    defect = config.sampling_defect
    temperature = 0.0 if defect == "greedy_collapse" else request.effective_temperature
    speculation: Speculation | None = None
    if speculative and not config.replay:
        speculation = Speculation(
            k=config.num_speculative_tokens,
            drafter=drafter_for(config),
            coverage=config.coverage_for(category),
            draft_temperature=1.0 if defect == "draft_temperature_ignored" else None,
        )
    drawn = generate(
        model,
        prompt_digest,
        temperature=temperature,
        top_p=request.top_p,
        max_tokens=request.max_tokens,
        rng=request_rng(prompt_digest, request.seed),
        speculation=speculation,
        steps_rng=rng_for("steps", prompt_digest, config.seed),
        noise_sigma=config.logit_noise_sigma if defect == "logit_noise" else 0.0,
    )
    logprobs: list[float] = []
    prev: int | None = None
    for position, token in enumerate(drawn.ids):
        logprobs.append(round(raw_logprob(model, prompt_digest, prev, position, token), 6))
        prev = token
    return _SampledAnswer(
        tokens=pieces(drawn.ids),
        logprobs=logprobs,
        stopped=drawn.stopped,
        steps=drawn.steps if speculation is not None else None,
        drawn_with=SampledWith(
            request.effective_temperature, request.top_p, request.seed, config.sampling_defect
        ),
    )


def plan_completion(config: SimConfig, request: SimRequest, category: str) -> Plan:
    """Decide the tokens and steps for ``request`` on a server configured by ``config``."""
    prompt_digest = digest(request.canonical)
    speculative = config.speculative and not request.spec_decode_unsupported
    drawn_steps: tuple[Step, ...] | None = None
    drawn_with: SampledWith | None = None
    finish: Literal["stop", "length", "tool_calls"]
    if config.sampling and request.tool is None and not request.json_mode:
        answer = _sampled_answer(config, request, prompt_digest, category, speculative)
        kind: OutputKind = "text"
        tokens, logprobs, cut = answer.tokens, answer.logprobs, len(answer.tokens)
        finish = "stop" if answer.stopped else "length"
        drawn_steps, drawn_with = answer.steps, answer.drawn_with
    else:
        kind, full = _full_tokens(request, config, prompt_digest, category)
        logprobs = token_logprobs(rng_for("logprobs", prompt_digest), len(full))
        cut = min(request.max_tokens, len(full))
        tokens = full[:cut]
        natural: Literal["stop", "tool_calls"] = "tool_calls" if kind == "tool_call" else "stop"
        finish = "length" if cut < len(full) else natural
    if speculative and config.divergence_at is not None and config.divergence_at < cut:
        start = max(config.divergence_at, 1 if kind == "tool_call" else 0)
        tokens = diverged_tokens(rng_for("diverge", prompt_digest, config.seed), tokens, start)
        logprobs[start:cut] = token_logprobs(rng_for("diverge-lp", prompt_digest), cut - start)
    if drawn_steps is not None:
        steps = drawn_steps
    elif speculative and config.replay:
        out = ids_of(tokens)
        steps = replay_steps(
            request.prompt_ids,
            out,
            k=config.num_speculative_tokens,
            propose=_proposer(config, request, out, category),
            lookahead=schedule(config.lookahead),
        )
    else:
        steps = plan_steps(
            len(tokens),
            speculative=speculative,
            probs=config.acceptance_for(category),
            coverage=config.coverage_for(category),
            rng=rng_for("steps", prompt_digest, config.seed),
        )
    teacher = None
    if request.prompt_logprobs is not None:
        teacher = prompt_logprobs(
            request.prompt_ids, config.drafter_match_for(category), request.prompt_logprobs
        )
        if config.sampling and request.prompt_token_ids:
            # A chat prompt + an answer (a likelihood scorer): the model's own logprobs there.
            teacher = scored_prompt_logprobs(config, request.prompt_ids, teacher) or teacher
    return Plan(
        category=category,
        mode=config.mode,
        kind=kind,
        tokens=tuple(tokens),
        logprobs=tuple(logprobs[:cut]),
        finish_reason=finish,
        steps=steps,
        prompt_tokens=request.prompt_tokens,
        prompt_hash=prompt_digest.hex(),
        tool_name=str(request.tool["name"]) if request.tool is not None else None,
        prompt_logprobs=teacher,
        sampling=drawn_with,
    )
