"""Suffix decoding (vLLM ``method: "suffix"``): a pure-Python port of arctic-inference's cache.

vLLM 0.32's suffix proposer (``vllm/v1/spec_decode/suffix_decoding.py``) drives Snowflake's
``arctic_inference.suffix_decoding.SuffixDecodingCache`` (0.3.0, a C++ suffix tree). Per request:
``start_request`` puts the prompt into a per-request (local) tree and allocates the request a
sequence in the *global* tree, evicting the oldest cached response beyond
``suffix_decoding_max_cached_requests``; every step ``add_active_response`` feeds the tokens just
sampled to both trees (the global tree gets the response only, never the prompt); then
``speculate`` matches the last ``suffix_decoding_max_tree_depth`` tokens of the context against
each tree and keeps the draft with the higher score (the local one on a tie). Finished requests'
responses stay in the global tree until evicted — the history across requests is the point.

This port keeps the same semantics without the C++ build (a slim install must work), as an
uncompressed trie of every substring of up to ``max_tree_depth`` tokens: a node's count is how
many suffixes pass through it, exactly the count of the library's path-compressed node that holds
that position. What makes it draw-for-draw equal and not just close:

- siblings are kept in the library's order — decreasing count, ties in the order its
  increment/decrement rules leave them (an incremented node moves to the head of its new count's
  group when the sibling before it already had that count, else to that group's tail; a
  decremented node moves behind the rest of its old count's group) — because the draft follows
  the first child;
- probabilities and scores are float32, as in the library, and compared as float32;
- ``speculate`` tries every match length ``1 … len(context) − 1`` (context already cut to the tree
  depth), caps each draft at ``min(max_spec_tokens, ⌊match_len × max_spec_factor + offset⌋)`` and
  keeps the last draft whose score is ``>=`` the best so far.

A test holds it to the library on real traces where the library is built
(tests/counterfactual/test_suffix.py). How vLLM feeds it along a recorded request, and the knobs
as matrix axes: :mod:`.suffix_replay`.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_CACHED_REQUESTS",
    "DEFAULT_MAX_SPEC_FACTOR",
    "DEFAULT_MAX_TREE_DEPTH",
    "DEFAULT_MIN_TOKEN_PROB",
    "SuffixCache",
    "SuffixDraft",
    "SuffixTree",
]

# vLLM 0.32's defaults for speculative_config.suffix_decoding_*.
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """``x`` rounded to float32 (the library's arithmetic)."""
    return float(_F32.unpack(_F32.pack(x))[0])


class _Node:
    __slots__ = ("children", "count", "order")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.order: list[int] = []  # child tokens, in the library's sibling order


def _increment(parent: _Node, token: int) -> None:
    """``_increment_count``: +1, moved within the parent's sibling order as the library does."""
    child = parent.children[token]
    order, children = parent.order, parent.children
    c = child.count
    i = order.index(token)
    if i > 0:
        prev = children[order[i - 1]].count
        if prev in (c, c + 1):
            # Move before the head of the previous sibling's count group.
            h = i - 1
            while h > 0 and children[order[h - 1]].count == prev:
                h -= 1
            del order[i]
            order.insert(h, token)
    child.count = c + 1


def _decrement(parent: _Node, token: int) -> None:
    """``_decrement_count``: −1; behind the rest of its count group when a sibling after it has
    the same count."""
    child = parent.children[token]
    order, children = parent.order, parent.children
    c = child.count
    i = order.index(token)
    if i + 1 < len(order) and children[order[i + 1]].count == c:
        e = i + 1
        while e < len(order) and children[order[e]].count == c:
            e += 1
        order.insert(e, token)
        del order[i]
    child.count = c - 1


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Every substring of up to ``max_depth`` tokens of each sequence, with counts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        root, depth = self.root, self.max_depth
        for token in tokens:
            active.append(root)
            root.count += 1
            if len(active) > depth:
                active.popleft()
            seq.append(token)
            for i, node in enumerate(active):
                child = node.children.get(token)
                if child is None:
                    child = _Node()
                    child.count = 1
                    node.children[token] = child
                    node.order.append(token)
                else:
                    _increment(node, token)
                active[i] = child

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, [])
        self._active.pop(seq_id, None)
        root = self.root
        for start in range(len(seq)):
            node = root
            node.count -= 1
            for idx in range(start, len(seq)):
                token = seq[idx]
                child = node.children.get(token)
                if child is None:
                    break
                if child.count > 1:
                    _decrement(node, token)
                else:
                    del node.children[token]
                    node.order.remove(token)
                    break
                node = child

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
        max_spec_offset: float = 0.0,
        min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
    ) -> SuffixDraft:
        """The library's path speculation (``use_tree_spec=False``, what vLLM uses)."""
        factor, offset, floor = f32(max_spec_factor), f32(max_spec_offset), f32(min_token_prob)
        best = SuffixDraft()
        root, n = self.root, len(context)
        for match_len in range(1, n):
            node: _Node | None = root
            for t in context[n - match_len :]:
                node = node.children.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is None:
                break
            cap = min(max_spec_tokens, int(f32(f32(match_len * factor) + offset) + 1e-6))
            tokens: list[int] = []
            probs: list[float] = []
            prob, score = 1.0, 0.0
            while len(tokens) < cap and prob >= floor:
                if not node.order:
                    break
                token = node.order[0]
                child = node.children[token]
                if child.count != node.count:
                    prob = f32(prob * f32(f32(child.count) / f32(node.count)))
                    if prob < floor:
                        break
                tokens.append(token)
                probs.append(prob)
                score = f32(score + prob)
                node = child
            if score >= best.score:
                best = SuffixDraft(tuple(tokens), tuple(probs), score, match_len)
        return best


def _paths(
    tree: SuffixTree, context: Sequence[int], max_tokens: int, floor: float
) -> list[tuple[int, list[int], list[float], list[float]]]:
    """Per match length (``1 … len(context) − 1``, up to the first that fails): the draft path
    of up to ``max_tokens`` tokens with probabilities ``>= floor``, and its running float32
    score. Every (k, factor, floor ≥ this floor) draft is a prefix of it (probabilities never
    rise along a path), so one walk serves every configuration of a step."""
    out: list[tuple[int, list[int], list[float], list[float]]] = []
    root, n = tree.root, len(context)
    for match_len in range(1, n):
        node: _Node | None = root
        for t in context[n - match_len :]:
            node = node.children.get(t)  # type: ignore[union-attr]
            if node is None:
                return out
        assert node is not None
        tokens: list[int] = []
        probs: list[float] = []
        scores: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and node.order:
            token = node.order[0]
            child = node.children[token]
            if child.count != node.count:
                prob = f32(prob * f32(f32(child.count) / f32(node.count)))
                if prob < floor:
                    break
            tokens.append(token)
            probs.append(prob)
            score = f32(score + prob)
            scores.append(score)
            node = child
        out.append((match_len, tokens, probs, scores))
    return out


def _pick(
    paths: list[tuple[int, list[int], list[float], list[float]]],
    cap: int,
    factor: float,
    floor: float,
) -> tuple[list[int], float]:
    """:meth:`SuffixTree.speculate`'s choice among the match lengths, from :func:`_paths`."""
    best: list[int] = []
    best_score = 0.0
    for match_len, tokens, probs, scores in paths:
        limit = min(cap, int(f32(match_len * factor) + 1e-6), len(tokens))
        length = 0
        while length < limit and probs[length] >= floor:
            length += 1
        score = scores[length - 1] if length else 0.0
        if score >= best_score:
            best, best_score = tokens[:length], score
    return best, best_score


class SuffixCache:
    """``SuffixDecodingCache``: a local tree per active request, one global tree of responses."""

    def __init__(
        self,
        max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
    ) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_tree_depth)
        self._local: dict[Hashable, SuffixTree] = {}
        self._req_to_seq: dict[Hashable, int] = {}  # insertion order = eviction order
        self._seq_to_req: dict[int, Hashable] = {}
        self._next_seq = 0

    @property
    def cached_requests(self) -> list[Hashable]:
        return list(self._req_to_seq)

    def start_request(self, req_id: Hashable, prompt: Sequence[int]) -> None:
        if req_id in self._local:
            raise ValueError(f"request {req_id!r} is already active")
        tree = self._local[req_id] = SuffixTree(self.max_tree_depth)
        tree.extend(0, prompt)
        if self.max_cached_requests != 0:
            if req_id in self._req_to_seq:
                self.evict(req_id)
            self._allocate(req_id)

    def stop_request(self, req_id: Hashable) -> None:
        del self._local[req_id]

    def add_active_response(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._local[req_id].extend(0, tokens)
        seq = self._req_to_seq.get(req_id)
        if seq is not None:
            self.global_tree.extend(seq, tokens)

    def evict(self, req_id: Hashable) -> None:
        seq = self._req_to_seq.pop(req_id)
        del self._seq_to_req[seq]
        self.global_tree.remove(seq)

    def speculate(
        self,
        req_id: Hashable,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
        min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
    ) -> SuffixDraft:
        if len(context) > self.max_tree_depth:
            context = context[-self.max_tree_depth :]
        local = self._local[req_id].speculate(
            context, max_spec_tokens, max_spec_factor, 0.0, min_token_prob
        )
        shared = self.global_tree.speculate(
            context, max_spec_tokens, max_spec_factor, 0.0, min_token_prob
        )
        return local if local.score >= shared.score else shared

    def _allocate(self, req_id: Hashable) -> None:
        while True:
            seq = self._next_seq
            self._next_seq = (self._next_seq + 1) & 0x7FFFFFFF
            if seq not in self._seq_to_req or self._seq_to_req[seq] not in self._local:
                break
        if seq in self._seq_to_req:
            del self._req_to_seq[self._seq_to_req.pop(seq)]
            self.global_tree.remove(seq)
        self._req_to_seq[req_id] = seq
        self._seq_to_req[seq] = req_id
        if self.max_cached_requests > 0:
            while len(self._req_to_seq) > self.max_cached_requests:
                for old, s in self._req_to_seq.items():
                    if s != seq:
                        self.evict(old)
                        break
