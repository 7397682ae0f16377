"""Token counts on one footing: every leg of an exchange counted in one unit before anything
compares them.

A leg's count is exact when its response says it: a usage object, continuous usage, logprobs
(:class:`core.recorder.StreamRecorder`). The official SDK streams without
``stream_options.include_usage`` unless asked, so the primary's stream — whose bytes the gateway
never changes and whose request it never adds to — usually carries no usage and its count is an
estimate (characters / 4), while every shadow leg, which the gateway asks for usage, is exact.
Compared as they are, byte-identical outputs read as different lengths, and every per-token
timing (TPOT, tokens per event) is off by the estimate's error — one way on one leg only.

:func:`reconcile` runs on the evidence worker before any comparison, quality scalar, guard or
record sees the exchange. For an exchange with a shadow leg and an estimated count:

1. **matched**: a leg with no exact count that answered the very same output (text, reasoning,
   tool calls and refusal, byte for byte) as a completed leg with an exact count takes that count
   — the legs serve one model, so one output is one token sequence;
2. **tokenize**: if a leg is still estimated and :class:`CountTap` counted the exchange's outputs
   with the engine's own tokenizer (``POST /tokenize`` on a shadow backend of the exchange, never
   the primary, after the client had its answer), *every* leg with output is counted by it — one
   unit computed the same way on every leg, the legs' own counts kept as ``reported``;
3. **estimated**: otherwise every leg with output is estimated the same way (characters / 4):
   an estimate is only ever compared with an estimate.

A leg's record says which (``tokens_source``) and, where it changed, what the leg itself reported
(``tokens_reported``); every timing that divides by the count follows the count
(:func:`core.recorder.recounted`). Exchanges whose legs are all exact pass untouched, and so do
exchanges with no shadow leg (nothing to compare within them). Per-leg acceptance is computed from
each leg's own count before any of this (it is a fact about that leg alone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from core import jsonx
from core.exchange import Exchange, ExchangeSink, LegResult, Recount
from core.recorder import estimate_tokens, recounted
from core.timings import EXACT_TOKENS, Recording
from core.wire import BACKEND_KEEPALIVE_S
from evidence.tap import Tap

__all__ = ["CountPlan", "CountTap", "Tokenizer", "output_text", "reconcile", "to_count"]

log = logging.getLogger(__name__)

# Kinds of backend that answer vLLM's ``POST /tokenize`` (SGLang serves it too).
TOKENIZE_KINDS = frozenset(("vllm", "sglang", "sim"))
_CALL_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError)


def output_text(rec: Recording) -> str:
    """A leg's whole output as one string, in stream order per choice: reasoning, text, each tool
    call's name and arguments, refusal — what is tokenized, and what "the same output" means."""
    parts: list[str] = []
    for c in rec.choices:
        parts.extend((c.reasoning, c.text))
        for call in c.tool_calls:
            parts.extend((call.name or "", call.arguments))
        parts.append(c.refusal or "")
    return "\x00".join(parts)


def _has_output(leg: LegResult) -> bool:
    rec = leg.recording
    return rec is not None and rec.output_tokens is not None


def _inexact(leg: LegResult) -> bool:
    """A leg with output whose count is not exact."""
    rec = leg.recording
    return (
        rec is not None and rec.output_tokens is not None and rec.tokens_source not in EXACT_TOKENS
    )


def to_count(exchange: Exchange) -> tuple[int, ...]:
    """Indexes (into ``exchange.legs``) of the legs a tokenizer must count so every leg is on one
    footing; empty when the matched counts already put them there (or nothing is compared)."""
    if not exchange.shadows:
        return ()
    legs = exchange.legs
    counted = [i for i, leg in enumerate(legs) if _has_output(leg)]
    if len(counted) < 2:
        return ()
    matched = _matched(legs)
    still = any(i not in matched and _inexact(legs[i]) for i in counted)
    return tuple(counted) if still else ()


def _matched(legs: Sequence[LegResult]) -> dict[int, Recording]:
    """Leg index → the exact recording of a completed leg with the very same output, for each
    leg with output whose own count is not exact."""
    exact: dict[str, Recording] = {}
    for leg in legs:
        rec = leg.recording
        if (
            rec is not None
            and leg.outcome == "completed"
            and rec.tokens_source in EXACT_TOKENS
            and rec.output_tokens is not None
            and rec.choices
        ):
            exact.setdefault(output_text(rec), rec)
    out: dict[int, Recording] = {}
    if not exact:
        return out
    for i, leg in enumerate(legs):
        rec = leg.recording
        if (
            rec is not None
            and leg.outcome == "completed"
            and rec.output_tokens is not None
            and rec.tokens_source not in EXACT_TOKENS
        ):
            twin = exact.get(output_text(rec))
            if twin is not None:
                out[i] = twin
    return out


def _with(leg: LegResult, rec: Recording) -> LegResult:
    return leg if rec is leg.recording else dataclasses.replace(leg, recording=rec)


def reconcile(exchange: Exchange) -> Exchange:
    """``exchange`` with every leg's count on one footing (see the module docstring)."""
    if not exchange.shadows:
        return exchange
    legs = exchange.legs
    if not any(_inexact(leg) for leg in legs):
        return exchange
    out = list(legs)
    for i, twin in _matched(legs).items():
        rec = legs[i].recording
        assert rec is not None
        out[i] = _with(legs[i], recounted(rec, twin.output_tokens, "matched"))
    if any(_inexact(leg) for leg in out):
        recount = exchange.recount
        usable = (
            recount is not None
            and len(recount.counts) == len(legs)
            and all(recount.counts[i] is not None for i, leg in enumerate(legs) if _has_output(leg))
        )
        for i, leg in enumerate(legs):  # from the legs' own recordings: one rule for all
            rec = leg.recording
            if rec is None or rec.output_tokens is None:
                continue
            if usable:
                assert recount is not None
                out[i] = _with(leg, recounted(rec, recount.counts[i], "tokenize"))
            else:
                estimate = estimate_tokens(rec.choices, rec.output_events)
                out[i] = _with(leg, recounted(rec, estimate or rec.output_tokens, "estimated"))
    return dataclasses.replace(exchange, primary=out[0], shadows=tuple(out[1:]))


# -- the tokenizer tap (async, off the request path) ------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A backend that may count outputs: its base URL (no ``/v1``) and its credentials, read at
    call time (a rotated secret is used without a reload)."""

    url: str
    auth: Callable[[], tuple[str, str] | None] | None = None


@dataclass(frozen=True, slots=True)
class CountPlan:
    """Which backends may count outputs: every non-primary backend that serves ``/tokenize``, by
    name; ``preferred`` first when the exchange has a leg there."""

    tokenizers: Mapping[str, Tokenizer]
    preferred: str | None = None
    max_in_flight: int = 8
    timeout_s: float = 10.0


def _tokenizer(exchange: Exchange, plan: CountPlan) -> LegResult | None:
    """The exchange's own shadow leg whose backend counts: it served this request's model."""
    shadows = [s for s in exchange.shadows if s.backend in plan.tokenizers]
    if plan.preferred is not None:
        for s in shadows:
            if s.backend == plan.preferred:
                return s
    for role in ("baseline", "candidate"):
        for s in shadows:
            if s.role == role:
                return s
    return shadows[0] if shadows else None


class CountTap(Tap):
    """A sink in front of ``downstream``: an exchange whose legs :func:`to_count` names is handed
    on with a :class:`~core.exchange.Recount` from one of its shadow backends' ``/tokenize``; every
    other exchange goes straight through. At most ``max_in_flight`` exchanges are counted at once:
    past it, and on a failed or slow call, the exchange is handed on without (its legs are then
    compared as estimates) and counted (``on_drop(reason)``, ``budget`` or ``error``)."""

    def __init__(
        self,
        downstream: ExchangeSink,
        plan: Callable[[], CountPlan | None],
        *,
        on_drop: Callable[[str], None] | None = None,
        keepalive_s: float = BACKEND_KEEPALIVE_S,
        drain_s: float = 10.0,
    ) -> None:
        super().__init__(downstream, keepalive_s=keepalive_s, drain_s=drain_s)
        self._plan = plan
        self._on_drop = on_drop
        self._in_flight = 0
        self.counted = 0
        self.dropped = 0
        self.failed = 0

    def submit(self, exchange: Exchange) -> None:
        plan = self._plan() if self._session is not None else None
        legs = to_count(exchange) if plan is not None and plan.tokenizers else ()
        counter = _tokenizer(exchange, plan) if plan is not None and legs else None
        if plan is None or counter is None:
            self._downstream.submit(exchange)
            return
        if self._in_flight >= plan.max_in_flight:
            self.dropped += 1
            self._report("budget")
            self._downstream.submit(exchange)
            return
        self._in_flight += 1
        _task = self._tasks.spawn(
            self._count(exchange, legs, counter, plan), name=f"count:{exchange.exchange_id}"
        )

    async def _count(
        self, exchange: Exchange, legs: Sequence[int], counter: LegResult, plan: CountPlan
    ) -> None:
        try:
            recount = await self._fetch(exchange, legs, counter, plan)
        except asyncio.CancelledError:
            self._report("error")
            self._downstream.submit(exchange)
            raise
        except _CALL_ERRORS as exc:
            self.failed += 1
            self._report("error")
            log.debug("token counts for %s: %s", exchange.exchange_id, exc)
            recount = None
        finally:
            self._in_flight -= 1
        if recount is not None:
            self.counted += 1
            exchange = dataclasses.replace(exchange, recount=recount)
        self._downstream.submit(exchange)

    async def _fetch(
        self, exchange: Exchange, legs: Sequence[int], counter: LegResult, plan: CountPlan
    ) -> Recount:
        tokenizer = plan.tokenizers[counter.backend]
        model = counter.upstream_model or exchange.requested_model
        keys: list[str] = []
        for i in legs:
            rec = exchange.legs[i].recording
            assert rec is not None
            if (key := output_text(rec)) not in keys:
                keys.append(key)  # one call per distinct output
        answers = await asyncio.gather(
            *(self._tokenize(tokenizer, model, key, plan.timeout_s) for key in keys)
        )
        by_text = dict(zip(keys, answers, strict=True))
        counts: list[int | None] = [None] * len(exchange.legs)
        for i in legs:
            rec = exchange.legs[i].recording
            assert rec is not None
            counts[i] = by_text[output_text(rec)]
        return Recount(source=counter.backend, counts=tuple(counts))

    async def _tokenize(
        self, tokenizer: Tokenizer, model: str | None, key: str, timeout_s: float
    ) -> int:
        body: dict[str, Any] = {"prompt": key.replace("\x00", ""), "add_special_tokens": False}
        if model:
            body["model"] = model
        headers = {"content-type": "application/json"}
        auth = tokenizer.auth() if tokenizer.auth is not None else None
        if auth is not None:
            headers[auth[0]] = auth[1]
        url = tokenizer.url + "/tokenize"
        assert self._session is not None
        async with self._session.post(
            url,
            data=jsonx.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise ValueError(f"{url}: HTTP {resp.status}: {raw[:200]!r}")
            answer = jsonx.loads(raw)
        count = answer.get("count") if isinstance(answer, dict) else None
        if not isinstance(count, int) or isinstance(count, bool):
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list):
                raise ValueError("/tokenize: neither 'count' nor 'tokens' in the answer")
            count = len(tokens)
        return count

    def _report(self, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(reason)
