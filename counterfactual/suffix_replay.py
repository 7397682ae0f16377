"""Suffix decoding replayed along recorded requests: vLLM 0.32's feeding of the cache, the knobs.

vLLM's ``SuffixDecodingProposer`` starts a request with its prompt, feeds each step's sampled
tokens, drafts from the last ``suffix_decoding_max_tree_depth`` tokens with the draft capped at
``min(num_speculative_tokens, max_model_len − tokens − 1)``, and stops the request when it leaves
the batch; its response stays in the global tree. :func:`suffix_offers` does the same for one
record through either cache — arctic-inference's own where it is importable, else the port of
:mod:`.suffix` — and returns what :func:`counterfactual.replay.replay` steps along.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from counterfactual.suffix import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_TOKEN_PROB,
    SuffixCache,
    _paths,
    _pick,
    f32,
)

__all__ = ["REPLAY_NOTE", "SuffixKnobs", "SuffixSpec", "parse_suffix_knobs", "suffix_offers"]


@dataclass(frozen=True, slots=True)
class SuffixSpec:
    """The knobs one draft depends on: depth ``k`` (``num_speculative_tokens``), the spec factor
    and the probability floor (the tree depth and cache size are the cache's)."""

    k: int
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB


def suffix_offers(
    cache: Any,
    req_id: Hashable,
    prompt: Sequence[int],
    output: Sequence[int],
    specs: Sequence[SuffixSpec],
    max_model_len: int | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Serve one request through ``cache`` (the port's :class:`SuffixCache`, or arctic-inference's
    ``SuffixDecodingCache``) as vLLM's proposer does, and return per spec the
    ``(available, match)`` of :func:`counterfactual.replay.replay`.

    The trees' state with ``j`` output tokens emitted depends only on those tokens (the engine
    feeds each step's accepted tokens and bonus token; feeding them one at a time builds the same
    trees), so the draft at every ``j`` is computed once per spec and the step walk is the
    replay's. The draft is capped at ``min(k, max_model_len − tokens − 1)`` as vLLM caps it; the
    replay cuts it at the end of the output. Every output token is fed before the request stops:
    its response stays in the global tree for the requests after it.
    """
    n, p = len(output), len(prompt)
    offers = [([0] * n, [0] * n) for _ in specs]
    cache.start_request(req_id, prompt)
    try:
        if n:
            cache.add_active_response(req_id, output[:1])
        context = [*prompt, *output[:1]]
        depth = cache.max_tree_depth
        if not isinstance(cache, SuffixCache):
            return _library_offers(cache, req_id, prompt, output, specs, max_model_len, offers)
        local = cache._local[req_id]
        caps = [spec.k for spec in specs]
        most = max(caps, default=0)
        floor = min((f32(spec.min_token_prob) for spec in specs), default=1.0)
        for j in range(1, n):
            tokens = p + j
            ctx = context[-depth:]
            lp = _paths(local, ctx, most, floor)
            gp = _paths(cache.global_tree, ctx, most, floor)
            for s, spec in enumerate(specs):
                cap = caps[s] if max_model_len is None else min(caps[s], max_model_len - tokens - 1)
                if cap <= 0:
                    continue
                factor, spec_floor = f32(spec.max_spec_factor), f32(spec.min_token_prob)
                ld, ls = _pick(lp, cap, factor, spec_floor)
                gd, gs = _pick(gp, cap, factor, spec_floor)
                draft = ld if ls >= gs else gd
                available, match = offers[s]
                available[j] = len(draft)
                m = 0
                while m < len(draft) and j + m < n and draft[m] == output[j + m]:
                    m += 1
                match[j] = m
            cache.add_active_response(req_id, output[j : j + 1])
            context.append(output[j])
    finally:
        cache.stop_request(req_id)
    return offers


REPLAY_NOTE = (
    "exact given the history: the replay feeds the trees as vLLM does, record by record in the "
    "order read (production's order), so the global tree holds every earlier response; requests "
    "that overlapped in production saw each other's partial responses there, and requests "
    "without token ids are missing from the replay's history"
)


@dataclass(frozen=True, slots=True, order=True)
class SuffixKnobs:
    """vLLM's ``suffix_decoding_*`` settings beside the depth (``num_speculative_tokens``)."""

    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB

    @property
    def label(self) -> str:
        return (
            f"tree {self.max_tree_depth} cache {self.max_cached_requests} "
            f"factor {self.max_spec_factor:g} min_prob {self.min_token_prob:g}"
        )

    def speculative_config(self) -> dict[str, object]:
        return {
            "suffix_decoding_max_tree_depth": self.max_tree_depth,
            "suffix_decoding_max_cached_requests": self.max_cached_requests,
            "suffix_decoding_max_spec_factor": self.max_spec_factor,
            "suffix_decoding_min_token_prob": self.min_token_prob,
        }

    def row_json(self) -> dict[str, object]:
        return {**self.speculative_config(), "replay_note": REPLAY_NOTE}

    def cache(self) -> Any:
        """arctic-inference's own cache where it is importable (about 25× faster), else the
        port (draw-for-draw equal: tests/counterfactual/test_suffix.py)."""
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found]
        except ImportError:
            return SuffixCache(self.max_tree_depth, self.max_cached_requests)
        return SuffixDecodingCache(self.max_tree_depth, self.max_cached_requests)

    def spec(self, k: int) -> SuffixSpec:
        return SuffixSpec(k, self.max_spec_factor, self.min_token_prob)


def parse_suffix_knobs(text: str) -> SuffixKnobs:
    """``"depth=24,cache=10000,factor=1.0,min_prob=0.1"`` (any subset) → the knobs.

    Raises:
        ValueError: naming the piece that is not ``NAME=VALUE`` with a known name and a valid value.
    """
    values: dict[str, float] = {}
    names = {"depth": "max_tree_depth", "cache": "max_cached_requests",
             "factor": "max_spec_factor", "min_prob": "min_token_prob"}  # fmt: skip
    for piece in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = piece.partition("=")
        if name not in names:
            raise ValueError(f"suffix knob {piece!r}: expected one of {', '.join(names)}")
        try:
            values[names[name]] = float(value)
        except ValueError:
            raise ValueError(f"suffix knob {piece!r}: expected a number") from None
    knobs = SuffixKnobs(
        max_tree_depth=int(values.get("max_tree_depth", DEFAULT_MAX_TREE_DEPTH)),
        max_cached_requests=int(values.get("max_cached_requests", DEFAULT_MAX_CACHED_REQUESTS)),
        max_spec_factor=values.get("max_spec_factor", DEFAULT_MAX_SPEC_FACTOR),
        min_token_prob=values.get("min_token_prob", DEFAULT_MIN_TOKEN_PROB),
    )
    if knobs.max_tree_depth < 1 or knobs.max_spec_factor < 0 or knobs.min_token_prob < 0:
        raise ValueError(f"suffix knobs {text!r}: depth >= 1, factor and min_prob >= 0")
    return knobs


def _library_offers(
    cache: Any,
    req_id: Hashable,
    prompt: Sequence[int],
    output: Sequence[int],
    specs: Sequence[SuffixSpec],
    max_model_len: int | None,
    offers: list[tuple[list[int], list[int]]],
) -> list[tuple[list[int], list[int]]]:
    """:func:`suffix_offers` through the library (the request already started and its first
    token fed; stopped by the caller)."""
    n, p = len(output), len(prompt)
    context = [*prompt, *output[:1]]
    depth = cache.max_tree_depth
    for j in range(1, n):
        for s, spec in enumerate(specs):
            cap = spec.k if max_model_len is None else min(spec.k, max_model_len - p - j - 1)
            if cap <= 0:
                continue
            draft = cache.speculate(
                req_id, context[-depth:], cap, spec.max_spec_factor, 0.0, spec.min_token_prob
            ).token_ids
            available, match = offers[s]
            available[j] = len(draft)
            m = 0
            while m < len(draft) and j + m < n and draft[m] == output[j + m]:
                m += 1
            match[j] = m
        cache.add_active_response(req_id, output[j : j + 1])
        context.append(output[j])
    return offers
