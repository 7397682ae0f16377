"""Suffix decoding's pure-Python port (counterfactual/suffix.py): hand-computed drafts, the global
tree's history, eviction at max_cached_requests, and draw-for-draw equality with arctic-inference
where the library is importable."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from counterfactual.replay import replay
from counterfactual.suffix import (
    SuffixCache,
    SuffixSpec,
    SuffixTree,
    _increment,
    _Node,
    f32,
    suffix_offers,
)

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def test_hand_computed_draft() -> None:
    tree = SuffixTree(24)
    tree.extend(0, [1, 2, 3, 1, 2, 4])
    # Context [1, 2]: only match length 1 ([2]); "2" was followed by 3 and 4 once each: the first
    # inserted (3) leads, prob 1/2; the cap is ⌊1 × 1.0⌋ = 1.
    d = tree.speculate([1, 2], 8)
    assert (d.token_ids, d.probs, d.score, d.match_len) == ((3,), (0.5,), 0.5, 1)
    # Context [0, 1, 2]: match length 2 ([1, 2]) caps at 2: 3 (1/2) then 1 (1/1, same prob).
    d = tree.speculate([0, 1, 2], 8)
    assert (d.token_ids, d.probs, d.score, d.match_len) == ((3, 1), (0.5, 0.5), 1.0, 2)
    # A floor above 1/2 drafts nothing; the empty draft of the longest match wins the tie.
    d = tree.speculate([0, 1, 2], 8, min_token_prob=0.6)
    assert (d.token_ids, d.match_len) == ((), 2)
    # No match at all: the empty draft, match length 0.
    assert tree.speculate([9, 9], 8).token_ids == ()


def test_counts_and_depth() -> None:
    tree = SuffixTree(2)
    tree.extend(0, [1, 1, 1])
    assert tree.root.count == 3
    one = tree.root.children[1]
    assert one.count == 3 and one.children[1].count == 2
    assert not one.children[1].children  # depth 2: no third level
    tree.remove(0)
    assert tree.root.count == 0 and not tree.root.children


def test_sibling_order_follows_the_library() -> None:
    """An incremented node goes to the tail of its new count's group when the sibling before it
    had its old count, to the head when that sibling already had the new count."""
    parent = _Node()
    for token, count in ((10, 2), (11, 1), (12, 1)):
        node = _Node()
        node.count = count
        parent.children[token] = node
        parent.order.append(token)
    _increment(parent, 12)
    assert parent.order == [10, 12, 11]
    _increment(parent, 11)
    assert parent.order == [11, 10, 12]


def test_history_across_requests() -> None:
    """The second request's output repeats the first's: with the first's response in the global
    tree it is drafted from the first token on; a fresh cache (no history) drafts nothing."""
    out = [5, 6, 7, 8, 9, 10, 11, 12]
    spec = [SuffixSpec(4)]
    warm = SuffixCache()
    suffix_offers(warm, "a", [1, 2], out, spec)
    ((available, match),) = suffix_offers(warm, "b", [3, 4], out, spec)
    cold = SuffixCache()
    ((cold_available, _),) = suffix_offers(cold, "b", [3, 4], out, spec)
    assert sum(cold_available) == 0
    # j = 1: context ends in 5, matched once in the global tree → 6, 7, … capped by ⌊1 × 1.0⌋.
    assert available[1] == 1 and match[1] == 1
    r = replay(len(out), 4, available, match)
    assert r.accepted == r.draft_tokens > 0
    assert warm.cached_requests == ["a", "b"]
    # The prompt never enters the global tree: only responses do.
    assert 1 not in warm.global_tree.root.children and 5 in warm.global_tree.root.children


def test_eviction_oldest_first() -> None:
    cache = SuffixCache(max_cached_requests=2)
    for i, req in enumerate(("a", "b", "c")):
        suffix_offers(cache, req, [0], [100 + i, 200 + i], [SuffixSpec(2)])
    assert cache.cached_requests == ["b", "c"]
    assert 100 not in cache.global_tree.root.children
    assert {101, 102} <= set(cache.global_tree.root.children)
    # max_cached_requests = 0: no global tree at all.
    off = SuffixCache(max_cached_requests=0)
    suffix_offers(off, "a", [0], [1, 2, 3], [SuffixSpec(2)])
    assert off.cached_requests == [] and not off.global_tree.root.children


def test_float32_arithmetic() -> None:
    assert f32(0.1) != 0.1 and f32(f32(0.1)) == f32(0.1)
    tree = SuffixTree(24)
    tree.extend(0, [1, 2, 1, 3, 1, 4])
    d = tree.speculate([0, 1], 4, min_token_prob=0.0)
    assert d.probs == (f32(1 / 3),)


def _word_requests(limit: int) -> list[tuple[list[int], list[int]]]:
    """Real text (tests/data/traces) as word ids: repetitive across requests like production."""
    vocab: dict[str, int] = {}
    out: list[tuple[list[int], list[int]]] = []
    for name in ("healthbench_chat.jsonl", "id_sentiment_structured.jsonl"):
        for line in (TRACES / name).read_text().splitlines()[:limit]:
            row: Any = jsonx.loads(line)
            text = str(row)
            words = re.findall(r"\w+|[^\w\s]", text)
            ids = [vocab.setdefault(w, len(vocab)) for w in words][:400]
            if len(ids) > 8:
                cut = len(ids) // 3
                out.append((ids[:cut], ids[cut:]))
    return out


@pytest.mark.skipif(
    importlib.util.find_spec("arctic_inference") is None,
    reason="arctic-inference is not importable here (built in the vLLM environment)",
)
@pytest.mark.parametrize("max_cached", [3, 10000])
def test_draw_for_draw_equal_to_arctic_inference(max_cached: int) -> None:
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found]

    lib = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=max_cached)
    port = SuffixCache(24, max_cached)
    compared = 0
    for i, (prompt, output) in enumerate(_word_requests(12)):
        for cache in (lib, port):
            cache.start_request(i, prompt)
            cache.add_active_response(i, output[:1])
        for j in range(1, len(output)):
            context = [*prompt, *output[:j]][-24:]
            for k, factor, floor in ((4, 1.0, 0.1), (8, 0.5, 0.3), (24, 2.0, 0.05)):
                a = lib.speculate(i, context, k, factor, 0.0, floor)
                b = port.speculate(i, context, k, factor, floor)
                assert (list(a.token_ids), a.match_len) == (list(b.token_ids), b.match_len)
                assert [f32(x) for x in a.probs] == list(b.probs) and f32(a.score) == b.score
                compared += 1
            for cache in (lib, port):
                cache.add_active_response(i, output[j : j + 1])
        lib.stop_request(i)
        port.stop_request(i)
        assert list(lib.cached_requests) == port.cached_requests
    assert compared > 1000
