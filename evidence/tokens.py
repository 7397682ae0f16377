"""The token tap: token ids of a sampled share of exchanges, for counterfactual scoring.

:class:`TokenTap` sits between the gateway and the evidence worker. An exchange reaches it when
all its legs have ended — the client has its answer — and most go straight through. For the
policy's ``counterfactual.share`` (by exchange id), it asks the tokenizer backend's
``POST /tokenize`` (vLLM, SGLang and the simulator answer it) for the prompt's ids — the chat
template applied with the generation prompt, as the engine does — and the primary's output's
ids, and each drafter backend for its greedy prediction at every output position (one
``/v1/completions`` pass with ``prompt_logprobs: 1`` over prompt + output, teacher-forced), then
hands the exchange on with :class:`~core.exchange.TokenIds` attached. The output's ids are the
ones an engine generated whenever a leg sent them (the gateway asks shadow legs for vLLM's
``return_token_ids`` while the policy scores counterfactuals; a shadow that answered the very
text the primary did generated the same ids), and re-tokenized text only otherwise. Never the primary backend
(the policy refuses it), never on the request path, at most ``max_in_flight`` at once: past it an
exchange is handed on without tokens and counted (``dropped``), never queued; a failed or slow
call (``timeout_s``) hands it on without tokens too (``failed``).

The same tap scores target likelihoods (:mod:`evidence.likelihood`, the policy's
``quality.likelihood``) for its own share of sampled exchanges with a baseline and a candidate
leg, under its own ``max_in_flight`` and ``timeout_s``, dropped and counted apart
(``on_likelihood_drop``); either runs without the other, and an exchange in both shares is
handed on once, when both are done.

Re-tokenizing the output text can differ from the ids the engine generated (a BPE tokenizer has
several spellings of some strings); the record keeps the leg's reported token count beside the
ids so the difference is visible (docs/counterfactual.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from core import jsonx
from core.exchange import Exchange, ExchangeSink, LegResult, Likelihood, TokenIds
from core.sample import is_sampled
from core.wire import BACKEND_KEEPALIVE_S
from evidence.likelihood import LikelihoodPlan, scorable, score, scored_legs
from evidence.tap import Tap

__all__ = ["TokenEndpoint", "TokenPlan", "TokenTap", "logprob_ids", "prediction_ids", "selected"]

# What a failed tokenizer, drafter or scorer call raises: a transport error, a timeout, or an
# answer not shaped as vLLM's (the call's result is then dropped and counted, never raised).
CALL_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, IndexError)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEndpoint:
    """A backend the tap may call: its policy name, base URL (no ``/v1``) and kind."""

    name: str
    url: str
    kind: str | None = None  # ``llamacpp``: its own /apply-template and /tokenize (see _ids)


@dataclass(frozen=True, slots=True)
class TokenPlan:
    """What to tokenize and where (the policy's ``counterfactual`` section)."""

    tokenizer: TokenEndpoint
    share: float
    drafters: tuple[TokenEndpoint, ...] = ()
    max_in_flight: int = 4
    timeout_s: float = 10.0


def selected(exchange_id: str, share: float, *, salt: str = "tap/cf-share") -> bool:
    """Whether an exchange is in the tokenized share: a hash of its id, so replicas agree
    (``salt`` keeps the likelihood's share independent of this one, and its ``/``, which no rule
    name has, keeps both independent of the rules' draws)."""
    return is_sampled(salt, exchange_id, share)


def _production_leg(exchange: Exchange) -> LegResult | None:
    """The completed leg of role ``primary`` with one plain-text choice (no tool calls)."""
    leg = next((leg for leg in exchange.legs if leg.role == "primary"), None)
    rec = leg.recording if leg is not None else None
    if leg is None or rec is None or leg.outcome != "completed" or len(rec.choices) != 1:
        return None
    choice = rec.choices[0]
    if not choice.text or choice.tool_calls or choice.refusal:
        return None
    return leg


def logprob_ids(tokens: Sequence[str] | None) -> tuple[int, ...] | None:
    """Ids from logprob tokens when the engine wrote them as ids (vLLM's
    ``return_tokens_as_token_ids``: ``"token_id:123"``); None otherwise."""
    if not tokens:
        return None
    out: list[int] = []
    for token in tokens:
        head, _, digits = token.partition(":")
        if head != "token_id" or not digits.isdigit():
            return None
        out.append(int(digits))
    return tuple(out)


def _generated_ids(exchange: Exchange) -> dict[str, tuple[int, ...]]:
    """Backend → the token ids its leg generated, for completed one-choice legs that sent them
    all (``return_token_ids``, logprobs with ``return_tokens_as_token_ids``, or llama.cpp's
    logprobs ``id``s)."""
    out: dict[str, tuple[int, ...]] = {}
    for leg in exchange.legs:
        rec = leg.recording
        if leg.outcome == "completed" and rec is not None and len(rec.choices) == 1:
            choice = rec.choices[0]
            ids = choice.token_ids or logprob_ids(choice.tokens)
            # Fewer ids than the leg's output count: incomplete (llama.cpp's streams drop some)
            if ids and (rec.output_tokens is None or len(ids) == rec.output_tokens):
                out[leg.backend] = ids
    return out


def _prompt_request(exchange: Exchange) -> dict[str, Any] | None:
    """The ``/tokenize`` body for the exchange's prompt; None for what it cannot tokenize."""
    body = exchange.request_json
    if body is None:
        return None
    if exchange.route == "chat" and isinstance(body.get("messages"), list):
        out: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            out["tools"] = body["tools"]
        return out
    if exchange.route == "completions" and isinstance(body.get("prompt"), str):
        return {"prompt": body["prompt"]}
    return None  # the Responses API, batched or pre-tokenized prompts: not scored


def prediction_ids(prompt_logprobs: object, start: int, count: int) -> tuple[int, ...] | None:
    """The rank-1 token at positions ``start … start + count − 1`` of vLLM's ``prompt_logprobs``
    (a list: ``null``, then per position ``{token_id: {logprob, rank, …}}``); None if malformed."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < start + count:
        return None
    out: list[int] = []
    for entry in prompt_logprobs[start : start + count]:
        if not isinstance(entry, Mapping) or not entry:
            return None
        best: tuple[float, int] | None = None
        for token, info in entry.items():
            if not isinstance(info, Mapping):
                return None
            rank, logprob = info.get("rank"), info.get("logprob")
            score = (
                float("inf") if rank == 1 else logprob if isinstance(logprob, float | int) else None
            )
            if score is None:
                continue
            try:
                tid = int(token)
            except ValueError:
                return None
            if best is None or score > best[0]:
                best = (float(score), tid)
        if best is None:
            return None
        out.append(best[1])
    return tuple(out)


def prediction_confidence(
    prompt_logprobs: object, start: int, count: int
) -> tuple[float, ...] | None:
    """The probability of the rank-1 token at positions ``start … start + count − 1`` of vLLM's
    ``prompt_logprobs`` (its logprob, exponentiated); None if any position lacks it."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < start + count:
        return None
    out: list[float] = []
    for entry in prompt_logprobs[start : start + count]:
        if not isinstance(entry, Mapping):
            return None
        best = [
            info.get("logprob")
            for info in entry.values()
            if isinstance(info, Mapping) and info.get("rank") == 1
        ]
        if not best or not isinstance(best[0], float | int):
            return None
        out.append(round(math.exp(float(best[0])), 6))
    return tuple(out)


class TokenTap(Tap):
    """A sink in front of ``downstream`` that attaches token ids to a sampled share, and target
    likelihoods to another (see module)."""

    def __init__(
        self,
        downstream: ExchangeSink,
        plan: Callable[[], TokenPlan | None],
        *,
        on_drop: Callable[[str], None] | None = None,
        likelihood: Callable[[], LikelihoodPlan | None] | None = None,
        on_likelihood_drop: Callable[[str], None] | None = None,
        keepalive_s: float = BACKEND_KEEPALIVE_S,
        drain_s: float = 10.0,
    ) -> None:
        """``on_drop(reason)``: one exchange recorded without tokens, ``budget`` (too many in
        flight) or ``error`` (a call failed or timed out). ``likelihood``: the current
        likelihood plan (None: off); ``on_likelihood_drop(reason)``: the same for the
        likelihood, with its own budget. ``keepalive_s``: as :class:`~evidence.tap.Tap`."""
        super().__init__(downstream, keepalive_s=keepalive_s, drain_s=drain_s)
        self._plan = plan
        self._on_drop = on_drop
        self._likelihood_plan = likelihood
        self._on_likelihood_drop = on_likelihood_drop
        self._in_flight = 0
        self._scoring = 0
        self.tokenized = 0
        self.dropped = 0
        self.failed = 0
        self.scored = 0
        self.likelihood_dropped = 0
        self.likelihood_failed = 0

    def _wants_tokens(self, exchange: Exchange) -> TokenPlan | None:
        plan = self._plan()
        if (
            plan is None
            or not selected(exchange.exchange_id, plan.share)
            or _production_leg(exchange) is None
        ):
            return None
        if self._in_flight >= plan.max_in_flight:
            self.dropped += 1
            self._report("budget")
            return None
        return plan

    def _wants_likelihood(self, exchange: Exchange) -> LikelihoodPlan | None:
        if not exchange.shadows:  # scoring needs a baseline and a candidate leg: most exchanges
            return None
        plan = self._likelihood_plan() if self._likelihood_plan is not None else None
        if plan is None or not selected(exchange.exchange_id, plan.share, salt="tap/lk-share"):
            return None
        legs = scored_legs(exchange)
        if legs is None or not scorable(plan, legs):
            return None
        if self._scoring >= plan.max_in_flight:
            self.likelihood_dropped += 1
            self._report_likelihood("budget")
            return None
        return plan

    def submit(self, exchange: Exchange) -> None:
        if self._session is None or _prompt_request(exchange) is None:
            self._downstream.submit(exchange)
            return
        plan, lplan = self._wants_tokens(exchange), self._wants_likelihood(exchange)
        if plan is None and lplan is None:
            self._downstream.submit(exchange)
            return
        if plan is not None:
            self._in_flight += 1
        if lplan is not None:
            self._scoring += 1
        _task = self._tasks.spawn(
            self._tap(exchange, plan, lplan), name=f"tokens:{exchange.exchange_id}"
        )

    async def _tap(
        self, exchange: Exchange, plan: TokenPlan | None, lplan: LikelihoodPlan | None
    ) -> None:
        try:
            tokens, likelihood = await asyncio.gather(
                self._tokens(exchange, plan), self._likelihood(exchange, lplan)
            )
        except asyncio.CancelledError:
            # Shut down past the drain: the exchange still reaches its record, without tokens
            # or likelihood.
            if plan is not None:
                self._report("error")
            if lplan is not None:
                self._report_likelihood("error")
            self._downstream.submit(exchange)
            raise
        if tokens is not None:
            self.tokenized += 1
            exchange = dataclasses.replace(exchange, tokens=tokens)
        if likelihood is not None:
            self.scored += 1
            exchange = dataclasses.replace(exchange, likelihood=likelihood)
        self._downstream.submit(exchange)

    async def _tokens(self, exchange: Exchange, plan: TokenPlan | None) -> TokenIds | None:
        if plan is None:
            return None
        try:
            return await self._fetch(exchange, plan)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            self.failed += 1
            self._report("error")
            log.debug("tokens for %s: %s", exchange.exchange_id, exc)
            return None
        finally:
            self._in_flight -= 1

    async def _likelihood(
        self, exchange: Exchange, plan: LikelihoodPlan | None
    ) -> Likelihood | None:
        if plan is None:
            return None
        prompt_body = _prompt_request(exchange)
        try:
            assert prompt_body is not None
            return await score(self._post, plan, exchange, prompt_body, _generated_ids(exchange))
        except CALL_ERRORS as exc:
            self.likelihood_failed += 1
            self._report_likelihood("error")
            log.debug("likelihood for %s: %s", exchange.exchange_id, exc)
            return None
        finally:
            self._scoring -= 1

    def _report_likelihood(self, reason: str) -> None:
        if self._on_likelihood_drop is not None:
            self._on_likelihood_drop(reason)

    def _report(self, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(reason)

    async def _post(self, url: str, body: Mapping[str, Any], timeout_s: float) -> Any:
        assert self._session is not None
        async with self._session.post(
            url,
            data=jsonx.dumps(body),
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise ValueError(f"{url}: HTTP {resp.status}: {raw[:200]!r}")
            return jsonx.loads(raw)

    async def _ids(self, plan: TokenPlan, body: Mapping[str, Any]) -> tuple[int, ...]:
        url = plan.tokenizer.url
        if plan.tokenizer.kind == "llamacpp":  # text in ``content``: a chat prompt rendered by
            # its /apply-template first, then special tokens added and parsed as its server does
            if "messages" in body:
                chat = {k: body[k] for k in ("messages", "tools") if k in body}
                text = (await self._post(url + "/apply-template", chat, plan.timeout_s))["prompt"]
                special = True
            else:
                text, special = body["prompt"], body.get("add_special_tokens", True) is not False
            body = {"content": text, "add_special": special, "parse_special": special}
        answer = await self._post(url + "/tokenize", body, plan.timeout_s)
        ids = answer["tokens"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("/tokenize: 'tokens' is not a list of integers")
        return tuple(ids)

    async def _fetch(self, exchange: Exchange, plan: TokenPlan) -> TokenIds | None:
        leg = _production_leg(exchange)
        prompt_body = _prompt_request(exchange)
        if leg is None or prompt_body is None or leg.recording is None:
            return None
        model = (
            next(
                (s.upstream_model for s in exchange.legs if s.backend == plan.tokenizer.name), None
            )
            or exchange.requested_model
        )
        extra = {"model": model} if model else {}
        text = leg.recording.choices[0].text
        generated = _generated_ids(exchange)
        # Prefer the ids an engine generated: re-tokenizing decoded text can spell some strings
        # differently (a run of newlines as one token where the model emitted several).
        own = generated.get(leg.backend)
        twin = next(
            (
                (s.backend, generated[s.backend])
                for s in exchange.shadows
                if s.backend in generated and s.recording and s.recording.choices[0].text == text
            ),
            None,
        )
        source = f"tokenize:{plan.tokenizer.name}"
        if own is not None:
            output_ids, output_source = own, "engine"
            prompt = await self._ids(plan, {**extra, **prompt_body})
        elif twin is not None:
            output_ids, output_source = twin[1], f"leg:{twin[0]}"
            prompt = await self._ids(plan, {**extra, **prompt_body})
        else:
            prompt, output_ids = await asyncio.gather(
                self._ids(plan, {**extra, **prompt_body}),
                self._ids(plan, {**extra, "prompt": text, "add_special_tokens": False}),
            )
            output_source = source
        drafters: dict[str, tuple[int, ...]] = {}
        confidence: dict[str, tuple[float, ...]] = {}
        if output_ids:
            for drafter, answer in zip(
                plan.drafters,
                await asyncio.gather(
                    *(
                        self._predictions(d, prompt, output_ids, plan.timeout_s)
                        for d in plan.drafters
                    )
                ),
                strict=True,
            ):
                predicted, probabilities = answer
                if predicted is not None:
                    drafters[drafter.name] = predicted
                    if probabilities is not None:
                        confidence[drafter.name] = probabilities
        return TokenIds(
            source=source,
            leg="primary",
            prompt=prompt,
            output=output_ids,
            drafters=drafters,
            output_source=output_source,
            legs=generated,
            drafter_confidence=confidence,
        )

    async def _predictions(
        self, drafter: TokenEndpoint, prompt: Sequence[int], output: Sequence[int], timeout_s: float
    ) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
        """The drafter's rank-1 prediction of each output token and the probability it gave it."""
        body = {
            "prompt": [*prompt, *output],
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 1,
        }
        try:
            answer = await self._post(drafter.url + "/v1/completions", body, timeout_s)
            logprobs = answer["choices"][0].get("prompt_logprobs")
            return (
                prediction_ids(logprobs, len(prompt), len(output)),
                prediction_confidence(logprobs, len(prompt), len(output)),
            )
        except CALL_ERRORS as exc:
            log.debug("drafter %s: %s", drafter.name, exc)
            return None, None
