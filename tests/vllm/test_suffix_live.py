"""Suffix decoding on real vLLM (``pytest -m vllm``): the matrix's suffix replay against a live
``method: "suffix"`` candidate (k = 8, vLLM's default suffix knobs; arctic-inference built once
into the cache by backends.setup.ensure_arctic).

A plain vLLM (the session's ``baseline`` server) is the primary, the suffix vLLM the candidate and tokenizer; the traffic is
test_counterfactual's greedy requests (code rewritten twice, structured answers, chat: repeated
across requests, as agent traffic is), one at a time, so the engine's global tree saw whole
responses in the order the records hold them — the case the replay is exact for (the engine also
saw its two warm-up requests, which no record holds). What must hold: the predicted mean
acceptance length within 10 % of vLLM's own per-request counts; the pure-Python port and the
library predicting the same drafts on the served ids.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from backends.server import VllmServer
from backends.setup import ensure_arctic
from counterfactual.matrix import build_matrix
from counterfactual.replay import replay
from counterfactual.suffix import SuffixCache
from counterfactual.suffix_replay import SuffixSpec, suffix_offers
from records.sqlite_store import query_records
from tests.vllm.conftest import VllmServerPool
from tests.vllm.test_counterfactual import run

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_extra("suffix"), pytest.mark.timeout(900)]


def test_suffix_prediction_meets_the_engine(
    vllm_servers: dict[str, VllmServer], vllm_server: VllmServerPool, tmp_path: Path
) -> None:
    # The primary is ``baseline``, a plain server on the other core than the suffix server's.
    servers = {"plain": vllm_servers["baseline"], "suffix": vllm_server("suffix")}
    store = tmp_path / "r.sqlite"
    n = asyncio.run(run(servers, store, candidate="suffix", sampled_copies=0))
    records: list[dict[str, Any]] = list(query_records(store))
    assert len(records) == n
    matrix = build_matrix(lambda: iter(records), depths=(8,))
    (live,) = matrix.live
    gap = live["relative_gap"]
    print(f"live suffix k=8: predicted {live['predicted_mean_acceptance_length']}, "
          f"measured {live['measured_mean_acceptance_length']}, gap {gap:.3%}")  # fmt: skip
    assert live["proposer"] == "suffix" and live["replay_class"] == "exact_given_history"
    assert abs(gap) <= 0.10, live

    # The library on the same ids, in the same order: the port's drafts, draw for draw.
    sys.path.insert(0, str(ensure_arctic(servers["suffix"].env.venv)))
    try:
        from arctic_inference.suffix_decoding import (  # type: ignore[import-not-found]
            SuffixDecodingCache,
        )
    finally:
        sys.path.pop(0)
    lib, port = SuffixDecodingCache(24, 10000), SuffixCache()
    compared = 0
    for i, rec in enumerate(records):
        t = rec["tokens"]
        if not t or not t["prompt"] or not t["output"]:
            continue
        prompt, output = t["prompt"], t["output"]
        ((available, match),) = suffix_offers(port, i, prompt, output, [SuffixSpec(8)])
        lib.start_request(i, prompt)
        lib.add_active_response(i, output[:1])
        for j in range(1, len(output)):
            draft = list(lib.speculate(i, [*prompt, *output[:j]][-24:], 8, 1.0, 0.0, 0.1).token_ids)
            assert available[j] == len(draft), (i, j)
            lib.add_active_response(i, output[j : j + 1])
            compared += 1
        lib.stop_request(i)
        assert replay(len(output), 8, available, match).output_tokens == len(output)
    assert compared > 200
