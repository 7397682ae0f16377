"""Suffix decoding's pure-Python port (counterfactual/suffix.py): hand-computed drafts, the global
tree's history, eviction at max_cached_requests, and draw-for-draw equality with arctic-inference
where the library is importable."""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from counterfactual.grid import Config
from counterfactual.matrix import ALL, build_matrix, live_config
from counterfactual.replay import replay
from counterfactual.suffix import SuffixCache, SuffixTree, _increment, _Node, f32
from counterfactual.suffix_replay import SuffixKnobs, SuffixSpec, parse_suffix_knobs, suffix_offers

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


def _agent_records(n: int, seed: int) -> list[dict[str, Any]]:
    """Agent-like traffic: 'tool' outputs repeat one of three templates with small edits, 'chat'
    outputs are fresh."""
    from tests.counterfactual.test_matrix import record

    rng = random.Random(seed)
    templates = [[rng.randrange(1000, 2000) for _ in range(30)] for _ in range(3)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(500) for _ in range(20)]
        if i % 2:
            output = list(rng.choice(templates))
            output[rng.randrange(30)] = rng.randrange(3000, 4000)
            out.append(record(i, prompt, output, "tool"))
        else:
            out.append(record(i, prompt, [rng.randrange(4000, 9000) for _ in range(30)], "chat"))
    return out


def test_matrix_rows_per_category_with_the_history() -> None:
    records = _agent_records(40, 3)
    m = build_matrix(lambda: iter(records), depths=(2, 8), suffix=(SuffixKnobs(),))
    rows = {
        (r["category"], r["num_speculative_tokens"]): r
        for r in m.rows
        if r["proposer"] == "suffix" and r["output_length_bucket"] == ALL
    }
    assert set(rows) == {(c, k) for c in ("tool", "chat", ALL) for k in (2, 8)}
    for r in rows.values():
        assert r["replay_class"] == "exact_given_history"
        assert r["suffix_decoding_max_tree_depth"] == 24 and "order" in r["replay_note"]
    # Each row equals the port driven by hand over the records in order.
    cache = SuffixCache()
    drafts = accepted = 0
    for i, rec in enumerate(records):
        prompt, output = rec["tokens"]["prompt"], rec["tokens"]["output"]
        ((available, match),) = suffix_offers(cache, i, prompt, output, [SuffixSpec(8)])
        rp = replay(len(output), 8, available, match)
        if rec["category"] == "tool":
            drafts, accepted = drafts + rp.drafts, accepted + rp.accepted
    tool = rows[("tool", 8)]["mean_acceptance_length"]
    assert tool["estimate"] == pytest.approx(1 + accepted / drafts)
    # Repeated tool outputs are drafted from earlier responses; fresh chat barely at all.
    assert tool["estimate"] > 3 > rows[("chat", 8)]["mean_acceptance_length"]["estimate"]
    # Opt-in: no knob sets, no suffix rows.
    assert not [r for r in build_matrix(lambda: iter(records)).rows if r["proposer"] == "suffix"]


def test_live_suffix_candidate_is_checked() -> None:
    from tests.counterfactual.test_matrix import leg

    records = _agent_records(30, 4)
    cache = SuffixCache()
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    for i, rec in enumerate(records):
        prompt, output = rec["tokens"]["prompt"], rec["tokens"]["output"]
        ((available, match),) = suffix_offers(cache, i, prompt, output, [SuffixSpec(8)])
        r = replay(len(output), 8, available, match)
        acc = {"num_drafts": r.drafts, "num_accepted_tokens": r.accepted}
        rec["legs"] = [leg("candidate", 0.01, 1, len(output), speculative=spec, acceptance=acc)]
    (check,) = build_matrix(lambda: iter(records), depths=(8,)).live
    assert check["relative_gap"] == pytest.approx(0.0, abs=1e-12) and not check["flag"]
    assert live_config({"speculative": spec}) == Config("suffix", 8, suffix=SuffixKnobs())


def test_knobs_parse() -> None:
    assert parse_suffix_knobs("") == SuffixKnobs()
    assert parse_suffix_knobs("depth=16,min_prob=0.3") == SuffixKnobs(16, 10000, 1.0, 0.3)
    for bad in ("deep=3", "depth=x", "depth=0"):
        with pytest.raises(ValueError, match="suffix knob"):
            parse_suffix_knobs(bad)


def test_offers_share_one_walk_and_equal_speculate_per_spec() -> None:
    """suffix_offers walks each tree once per step for every spec; each spec's drafts equal the
    cache's own speculate with that spec's knobs."""
    rng = random.Random(8)
    specs = [SuffixSpec(2), SuffixSpec(8, 0.5, 0.3), SuffixSpec(24, 2.0, 0.05), SuffixSpec(5)]
    fast, slow = SuffixCache(12, 4), SuffixCache(12, 4)
    base = [rng.randrange(30) for _ in range(60)]
    for i in range(12):
        prompt = [rng.randrange(30) for _ in range(15)]
        output = [t if rng.random() < 0.8 else rng.randrange(30) for t in base][: 20 + 3 * i]
        offers = suffix_offers(fast, i, prompt, output, specs, max_model_len=15 + 60)
        slow.start_request(i, prompt)
        slow.add_active_response(i, output[:1])
        for j in range(1, len(output)):
            for spec, (available, _) in zip(specs, offers, strict=True):
                cap = min(spec.k, 75 - (15 + j) - 1)
                want = (
                    slow.speculate(
                        i, [*prompt, *output[:j]], cap, spec.max_spec_factor, spec.min_token_prob
                    ).token_ids
                    if cap > 0
                    else ()
                )
                assert available[j] == len(want), (i, j, spec)
            slow.add_active_response(i, output[j : j + 1])
        slow.stop_request(i)


def test_policy_fragment_names_the_suffix_method() -> None:
    from counterfactual.render import policy_fragment

    records = _agent_records(30, 5)
    m = build_matrix(lambda: iter(records), depths=(4, 8), suffix=(SuffixKnobs(),))
    if not any(c.proposer == "suffix" for c in m.deploy):
        pytest.skip("no suffix pick on this traffic")
    text = policy_fragment(m)
    assert text is not None
    assert "method: suffix" in text and '"method":"suffix"' in text and "suffix-k" in text
