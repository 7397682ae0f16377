"""llama.cpp's ``ngram-mod`` and ``ngram-map-k`` (counterfactual/llamacpp_ngram.py) on small
sequences whose every step is worked out by hand in the comments; the real-server check is
tests/llamacpp/test_counterfactual.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core import jsonx
from counterfactual.llamacpp_ngram import (
    MOD_POOL_SIZE,
    LlamaKnobs,
    LlamaServer,
    NgramMap,
    NgramModPool,
)
from counterfactual.llamacpp_replay import parse_llamacpp_knobs, server_args
from counterfactual.matrix import ALL, build_matrix
from counterfactual.render import render_markdown
from specshadow.main import main as cli_main


def mod(n_match: int, n_min: int, n_max: int, slots: int = 1) -> LlamaServer:
    return LlamaServer(LlamaKnobs("ngram-mod", n_match, n_min, n_max, slots))


def mapk(size_n: int, size_m: int, slots: int = 1) -> LlamaServer:
    return LlamaServer(LlamaKnobs("ngram-map-k", size_n, 1, size_m, slots))


def test_the_pool_hash_is_the_64_bit_lcg_modulo_the_pool_size() -> None:
    pool = NgramModPool(2)
    assert pool.size == MOD_POOL_SIZE == 4_194_304
    # h = (0·M + 1)·M + 2 over 64 bits, M = 6364136223846793005
    m = 6364136223846793005
    assert pool.idx([1, 2], 0) == ((1 * m + 2) % 2**64) % 4_194_304
    assert pool.idx([7, 1, 2], 1) == pool.idx([1, 2], 0)


def test_the_pool_keeps_no_key_colliding_ngrams_overwrite_and_count_as_used() -> None:
    pool = NgramModPool(2, size=1)  # every n-gram lands in the one entry
    pool.add([1, 2, 3], 0)
    assert pool.used == 0  # the entry was empty
    pool.add([4, 5, 6], 0)
    assert pool.used == 1  # an overwrite
    assert pool.get([1, 2], 0) == 6  # (1, 2) answers what followed (4, 5)
    pool.reset()
    assert pool.get([1, 2], 0) == -1 and pool.used == 0


def test_ngram_mod_chains_lookups_from_the_prompt() -> None:
    # n_match 2: the prompt [1,2,3,1,2] adds (1,2)→3, (2,3)→1, (3,1)→2 when the request starts.
    # Step j=1: context = the prompt, sampled = output[0] = 3; key (2,3)→1, (3,1)→2, (1,2)→3:
    # the draft [1,2,3] (n_max 3), cut to n − j − 1 = 3; output[1:4] = [1,2,3]: all accepted,
    # and j jumps to 5, the end. Two passes: the prefill and one verification.
    r = mod(2, 1, 3).serve([1, 2, 3, 1, 2], [3, 1, 2, 3, 9])
    assert (r.passes, r.drafts, r.draft_tokens, r.accepted) == (2, 1, 3, 3)
    assert r.accepted_by_position == (1, 1, 1)
    assert r.rejected_at == ()


def test_ngram_mod_drafts_nothing_below_n_min() -> None:
    # The prompt [1,2,3] adds only (1,2)→3: a chain from key (1,2) stops after one token.
    assert mod(2, 2, 4).serve([1, 2, 3], [1, 2, 3, 4, 5]).drafts == 0
    # With n_min 1 the one-token draft is made at j=2 (key (1,2) → 3) and accepted.
    r = mod(2, 1, 4).serve([1, 2, 3], [1, 2, 3, 4, 5])
    assert (r.drafts, r.draft_tokens, r.accepted) == (1, 1, 1)


def test_ngram_mod_adds_generated_tokens_in_chunks_of_more_than_32() -> None:
    # Prompt [5,6]: nothing to add (no window of 3 inside it), i_last = 0. The output repeats
    # 7,5,6: with j tokens emitted the context holds 2 + j − 1 tokens, and the pool takes them
    # only when i_last + 32 < context, i.e. at j = 32. Steps j = 1…31 are plain; at j = 32 the
    # pool learns the period, the draft (8 tokens) is cut to 40 − 32 − 1 = 7 and all are
    # accepted. vLLM's n-gram proposer would have drafted from j = 3 on.
    output = [(7, 5, 6)[i % 3] for i in range(40)]
    r = mod(2, 1, 8).serve([5, 6], output)
    assert (r.drafts, r.draft_tokens, r.accepted) == (1, 7, 7)
    assert r.passes == 1 + 31 + 1


def test_ngram_mod_shares_its_pool_across_requests_and_slots() -> None:
    # Request A's prompt teaches (1,2)→3 and (2,3)→4; request B's prompt does not hold them,
    # but B's output runs into them: on the same server B drafts [3,4] at j=2 — on a fresh
    # server it drafts nothing (its own tokens reach the pool only in chunks of 33).
    server = mod(2, 1, 2, slots=2)
    server.serve([1, 2, 3, 4], [4])
    b_prompt, b_output = [9, 9], [1, 2, 3, 4, 8]
    on_fresh = mod(2, 1, 2, slots=2).serve(b_prompt, b_output)
    after_a = server.serve(b_prompt, b_output)
    assert on_fresh.drafts == 0
    assert (after_a.drafts, after_a.draft_tokens, after_a.accepted) == (1, 2, 2)
    # B went to the other slot (A's slot shares no prefix with B's prompt; the LRU slot is the
    # unused one): the pool is the server's, not the slot's.
    assert server.slots[0].last_used == 2 and server.slots[1].last_used == 1


def test_five_low_acceptance_rounds_on_a_slot_wipe_the_pool() -> None:
    # Prompt [1,2,3] teaches (1,2)→3; the output repeats 1,2,4, so the key (1,2) comes back
    # every third step and its one-token draft [3] is rejected: at j = 2, 5, 8, 11, 14. The
    # fifth low round (accepted/drafted < 1/4) resets the pool, so at j = 17 — where the key
    # comes back again — there is nothing to draft (the context has 3 + 16 tokens, under the
    # 33 that would re-add them).
    output = [(1, 2, 4)[i % 3] for i in range(20)]
    server = mod(2, 1, 1)
    r = server.serve([1, 2, 3], output)
    assert (r.drafts, r.draft_tokens, r.accepted) == (5, 5, 0)
    assert r.rejected_at == (2, 5, 8, 11, 14)
    assert server.mod is not None and server.mod.resets == 1


def test_ngram_map_k_drafts_what_followed_the_latest_earlier_key() -> None:
    # size_n 2, size_m 3, prompt [1,2,3,4,5,6,1,2]. Step j=1: key = [prompt[-1], sampled 3] =
    # (2,3); the scan over the prompt (positions 2 down to 1) finds it at 1: the draft is what
    # followed it, [4,5,6], capped at 6 − 1 − 1 = 4 tokens. output[1:4] = [4,5,9]: 2 accepted,
    # j = 4. Key (5,9) is nowhere: a plain step; at j = 5 the cap 6 − 5 − 1 is 0: no draft.
    r = mapk(2, 3).serve([1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 9, 9, 9])
    assert (r.passes, r.drafts, r.draft_tokens, r.accepted) == (4, 1, 3, 2)
    assert r.rejected_at == (3,)


def test_ngram_map_k_keys_outlive_the_request_on_their_slot_and_only_shrink() -> None:
    # The same request twice on one slot: the key (2,3) at position 1 is kept (below the last
    # prompt's length), with the 2 tokens its last draft had accepted — so the second request
    # drafts [4,5] where a fresh server drafts [4,5,6].
    prompt, output = [1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 9, 9, 9]
    server = mapk(2, 3)
    first = server.serve(prompt, output)
    second = server.serve(prompt, output)
    assert (first.draft_tokens, first.accepted) == (3, 2)
    assert (second.drafts, second.draft_tokens, second.accepted) == (1, 2, 2)
    # Per slot: on a second slot the same request starts from a fresh map.
    two = mapk(2, 3, slots=2)
    two.serve(prompt, output)
    assert two.serve([7, *prompt[1:]], output).draft_tokens == 3  # no shared prefix: slot 0


def test_a_map_keeps_hash_entries_below_the_last_prompt_length() -> None:
    m = NgramMap(2, 3)
    m.begin([1, 2, 3, 4, 5, 6, 1, 2])
    assert m.draft([1, 2, 3, 4, 5, 6, 1, 2], 3) == [4, 5, 6]
    assert set(m.key_map.values()) == {1, 2}
    m.accept(1)
    m.begin([1, 2, 3])  # shorter than the last context: entries at or past 3 − 2 − 3 → none kept
    assert m.key_map == {} and m.keys == []


def test_slots_are_chosen_by_prompt_prefix_else_least_recently_used() -> None:
    server = mod(2, 1, 2, slots=2)
    assert server.pick_slot([1, 2, 3]) == 1  # both unused: the last one wins the tie
    server.serve([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12])
    # 2 of 10 prompt tokens in common (0.2 > 0.1): slot 1; 1 of 10 (0.1, not above): LRU → 0.
    assert server.pick_slot([1, 2, 0, 0, 0, 0, 0, 0, 0, 0]) == 1
    assert server.pick_slot([1, 0, 0, 0, 0, 0, 0, 0, 0, 0]) == 0
    # The slot holds the prompt and every output token but the last (never decoded).
    assert server.slots[1].tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_the_draft_is_cut_to_the_tokens_left_and_the_context() -> None:
    # As in the first ngram-mod case: max_tokens 5 for an output cut at 5 changes nothing. A
    # context of 8 per slot leaves 8 − 5 − 2 = 1 draft token at j = 1 (accepted), and at j = 3
    # the context (7) leaves none.
    full = mod(2, 1, 3).serve([1, 2, 3, 1, 2], [3, 1, 2, 3, 9], max_tokens=5)
    assert (full.draft_tokens, full.accepted) == (3, 3)
    tight = LlamaServer(LlamaKnobs("ngram-mod", 2, 1, 3, n_ctx=8))
    r = tight.serve([1, 2, 3, 1, 2], [3, 1, 2, 3, 9])
    assert (r.drafts, r.draft_tokens, r.accepted) == (1, 1, 1)


def test_knobs_parse_llamacpp_names_and_refuse_others() -> None:
    k = parse_llamacpp_knobs("ngram-mod:n_match=4,n_min=1,n_max=8,slots=2")
    assert k == (LlamaKnobs("ngram-mod", 4, 1, 8, 2), True)
    assert parse_llamacpp_knobs("ngram-mod") == (LlamaKnobs("ngram-mod", 24, 48, 64), False)
    m, depth = parse_llamacpp_knobs("ngram-map-k:size_n=2,size_m=8")
    assert (m.n_match, m.n_max, m.n_min, depth) == (2, 8, 1, True)
    assert server_args(m) == ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "2",
                              "--spec-ngram-map-k-size-m", "8", "--spec-ngram-map-k-min-hits",
                              "1", "--parallel", "1"]  # fmt: skip
    with pytest.raises(ValueError, match="ngram-map-k knob 'n_match=2'"):
        parse_llamacpp_knobs("ngram-map-k:n_match=2")
    with pytest.raises(ValueError, match="expected one of ngram-mod, ngram-map-k"):
        parse_llamacpp_knobs("ngram-cache")
    with pytest.raises(ValueError, match="expected an integer"):
        parse_llamacpp_knobs("ngram-mod:n_max=x")


def _record(i: int, prompt: list[int], output: list[int], category: str, legs: list[Any]) -> Any:
    return {
        "exchange_id": f"x{i}",
        "category": category,
        "greedy": True,
        "legs": legs,
        "tokens": {
            "source": "test",
            "leg": "primary",
            "prompt": prompt,
            "output": output,
            "drafters": {},
            "legs": {},
        },
    }


def _llama_leg(drafted: int | None, accepted: int | None, k: int = 3) -> dict[str, Any]:
    acceptance = (
        {}
        if drafted is None
        else {
            "source": "llamacpp_timings",
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
        }
    )
    return {
        "role": "candidate",
        "backend": "cand",
        "outcome": "completed",
        "status": 200,
        "acceptance": acceptance,
        "speculative": {"method": "ngram-mod", "num_speculative_tokens": k},
        "engine": {"settings": {"engine": "llamacpp", "max_num_seqs": 2}},
    }


def _traffic() -> list[tuple[list[int], list[int], str]]:
    # Request 0 teaches the pool (1,2)→3, (2,3)→4; request 1's output runs into them (see the
    # shared-pool case above); request 2, in another category, drafts from its own prompt.
    return [([1, 2, 3, 4], [4, 5], "a"), ([9, 9], [1, 2, 3, 4, 8], "a"),
            ([5, 6, 7, 5, 6], [7, 5, 6, 7, 5, 6], "b")]  # fmt: skip


def test_matrix_rows_replay_one_llamacpp_server_per_configuration_in_record_order() -> None:
    knobs = LlamaKnobs("ngram-mod", 2, 1, 3, slots=2)
    traffic = _traffic()
    records = [_record(i, p, o, c, []) for i, (p, o, c) in enumerate(traffic)]
    m = build_matrix(lambda: iter(records), depths=(1, 2), windows=((2, 2),), llamacpp=(knobs,))
    # Ground truth: the same server fed the same requests in the same order.
    server = knobs.server()
    expected = [server.serve(p, o) for p, o, _ in traffic]
    rows = {(r["category"], r["output_length_bucket"]): r for r in m.rows
            if r["proposer"] == "ngram-mod"}  # fmt: skip
    overall = rows[(ALL, ALL)]
    assert overall["replay_class"] == "exact_given_history"
    assert overall["num_speculative_tokens"] == 3
    assert overall["llamacpp"]["n_match"] == 2 and overall["llamacpp"]["slots"] == 2
    assert overall["llamacpp"]["server_args"][:2] == ["--spec-type", "ngram-mod"]
    assert "exact given the history" in overall["replay_note"]
    drafted = sum(r.draft_tokens for r in expected)
    accepted = sum(r.accepted for r in expected)
    assert accepted > 0  # the history made request 1 draft
    assert overall["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    a = list(expected[:2])
    assert rows[("a", ALL)]["draft_acceptance_rate"] == pytest.approx(
        sum(r.accepted for r in a) / sum(r.draft_tokens for r in a)
    )
    # Read in another order, the history differs and so do the counts: order is part of the
    # replay (request 1 before request 0 drafts nothing).
    backwards = build_matrix(lambda: iter(records[::-1]), depths=(1,), windows=((2, 2),),
                             llamacpp=(knobs,))  # fmt: skip
    row = next(r for r in backwards.rows if r["proposer"] == "ngram-mod"
               and r["category"] == ALL and r["output_length_bucket"] == ALL)  # fmt: skip
    assert row["drafted_per_pass"] < overall["drafted_per_pass"]


def test_a_llamacpp_candidate_is_checked_request_by_request_against_its_timings() -> None:
    knobs = LlamaKnobs("ngram-mod", 2, 1, 3, slots=2)
    traffic = _traffic()
    server = knobs.server()
    truth = [server.serve(p, o) for p, o, _ in traffic]
    legs = [_llama_leg(r.draft_tokens, r.accepted) if r.drafts else _llama_leg(None, None)
            for r in truth]  # fmt: skip
    legs[2] = _llama_leg(truth[2].draft_tokens + 1, truth[2].accepted)  # one request off
    records = [_record(i, p, o, c, [legs[i]]) for i, (p, o, c) in enumerate(traffic)]
    # The candidate's n_match and n_min are not served: the declared knob set of its type and
    # depth is taken.
    m = build_matrix(lambda: iter(records), depths=(3,), windows=((2, 2),), llamacpp=(knobs,))
    (live,) = m.live_llamacpp
    assert live["backend"] == "cand" and live["proposer"] == "ngram-mod"
    assert (live["requests"], live["requests_equal"], live["greedy_requests_equal"]) == (3, 2, 2)
    assert live["predicted"]["draft_tokens"] == sum(r.draft_tokens for r in truth)
    assert live["measured"]["draft_tokens"] == sum(r.draft_tokens for r in truth) + 1
    assert "cand" not in m.live_skipped
    assert m.as_json()["live_llamacpp"] == [live]
    assert "llama.cpp n-gram candidates" in render_markdown(m)
    # Not declared: llama.cpp's defaults for n_match and n_min (24 and 48) with the recorded
    # depth and slots — which draft nothing on these short requests.
    d = build_matrix(lambda: iter(records), depths=(3,), windows=((2, 2),))
    (default,) = d.live_llamacpp
    assert default["llamacpp"]["n_match"] == 24 and default["llamacpp"]["slots"] == 2
    assert default["predicted"]["draft_tokens"] == 0


def test_the_cli_scores_llamacpp_knob_sets_at_every_depth_and_refuses_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "records.jsonl"
    records = [_record(i, p, o, c, []) for i, (p, o, c) in enumerate(_traffic())]
    store.write_bytes(b"".join(jsonx.dumps(r) + b"\n" for r in records))
    out = tmp_path / "out"
    args = ["counterfactual", "--store", str(store), "--out", str(out), "--no-rejections",
            "--depths", "1-2", "--windows", "2-2"]  # fmt: skip
    assert cli_main([*args, "--llamacpp", "ngram-mod:n_match=2,n_min=1,n_max=5"]) == 0
    rows = jsonx.loads((out / "counterfactual.json").read_bytes())
    depths = sorted(
        r["num_speculative_tokens"]
        for r in rows
        if r["proposer"] == "ngram-mod"
        and r["category"] == ALL
        and r["output_length_bucket"] == ALL
    )
    assert depths == [1, 2, 5]  # every --depths depth, and the one the knobs name
    capsys.readouterr()
    assert cli_main([*args, "--llamacpp", "ngram-map-k:size_n=x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "specshadow counterfactual: ngram-map-k knob 'size_n=x': expected an integer"
    )
