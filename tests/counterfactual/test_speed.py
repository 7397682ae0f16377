"""The step-time model against a continuous-batching simulator whose step time is known.

The simulators' engine steps every running request together: a step costs ``step_s`` plus
``step_slot_s`` per verification slot (1 per plain request, drafted + 1 per speculative one) —
the shape the model assumes. Mirrored traffic at a few concurrencies gives the legs a spread of
batches; the model fitted from the records must recover the two constants, and its predicted
TPOT speed-up for the live configuration must agree with the speed-up measured on the same pairs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from counterfactual.matrix import ALL, build_matrix
from counterfactual.speed import leg_batch
from gateway.settings import Settings
from records.readback import iter_records
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

STEP_S, SLOT_S = 0.004, 0.001
COPY = {"category_copy": {"code": 0.8}}
PROMPT = "def area(w, h):\n    return w * h\n\nclass Box:\n    def __init__(self, w, h):\n        self.w = w\n"


def policy(primary: str, candidate: str) -> str:
    return (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary}', kind: sim}}\n  cand: {{url: '{candidate}', kind: sim}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: cand, role: candidate}]}\n"
        "budgets: {max_in_flight: 1000}\n"
        "counterfactual: {tokenizer: cand, share: 1.0}\n"
    )


async def test_the_fitted_step_model_recovers_the_engines_constants(
    sims: Any, write_policy: Any, tmp_path: Path
) -> None:
    engine = {"batching": "continuous", "step_s": STEP_S, "step_slot_s": SLOT_S, "prefill_base_s": 0.0,
              "min_output_tokens": 48, "max_output_tokens": 48, **COPY}  # fmt: skip
    primary = await sims(**engine)
    candidate = await sims(mode="speculative", drafting="replay", proposer="ngram",
                           num_speculative_tokens=4, **engine)  # fmt: skip
    store = tmp_path / "r.sqlite"
    settings = Settings(
        policy_path=write_policy(policy(primary.base_url, candidate.base_url)),
        store_path=str(store), scrape_interval_s=0.05, shutdown_timeout_s=5.0, upstream=FAST_UPSTREAM,
    )  # fmt: skip
    server = await start_server(build_app(settings))
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": "sim-model", "max_tokens": 48, "stream": True,
                    "messages": [{"role": "user", "content": f"{PROMPT}# variant {i}\nAdd a perimeter method."}]}  # fmt: skip
            headers = {"x-request-id": f"s{i}", "x-specshadow-category": "code"}
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()

        n = 0
        for concurrency in (1, 3, 6, 10):
            for _ in range(3):
                await asyncio.gather(*(one(n + j) for j in range(concurrency)))
                n += concurrency
        await asyncio.sleep(0.5)
    await server.close()
    m = build_matrix(lambda: iter_records([store]))
    model = m.model
    assert model is not None and model.identified, model
    # The slope is the engine's per-slot cost; the floor is the engine's plus what serving a step
    # costs on the socket (timings are read at the gateway), so it is at least ``step_s``. On a
    # loaded 2-core machine serving costs grow with the batch too: the constants are held loosely,
    # the prediction — what the model is for — tightly.
    # (A clean CI run fitted 0.46x the slot and 3.6x the floor: serving costs moved into the floor.)
    assert 0.4 * SLOT_S <= model.slot_s <= 2 * SLOT_S, model
    assert STEP_S <= model.base_s <= 6 * STEP_S, model
    # The prediction for the live configuration against the TPOT ratio measured on the pairs.
    (live,) = m.live
    row = next(
        r for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL and r["num_speculative_tokens"] == 4
        and (r["prompt_lookup_min"], r["prompt_lookup_max"]) == (2, 4)
    )  # fmt: skip
    # Like for like: the model's speed-up at each pair's own batch (the primary leg's), against
    # that pair's measured TPOT ratio, both averaged on the log scale. (The row's own figure is at
    # production's median batch, which these four concurrency levels do not represent.)
    tpp, drafted = row["tokens_per_pass"]["estimate"], row["drafted_per_pass"]
    measured_logs, predicted_logs = [], []
    for record in iter_records([store]):
        legs = {leg["role"]: leg for leg in record["legs"]}
        batch = leg_batch(legs["primary"])
        if legs["primary"].get("tpot_s") and legs["candidate"].get("tpot_s") and batch:
            measured_logs.append(math.log(legs["primary"]["tpot_s"] / legs["candidate"]["tpot_s"]))
            at = dataclasses.replace(model, batch=batch).speedup(tpp, drafted)
            assert at is not None
            predicted_logs.append(math.log(at))
    measured = math.exp(sum(measured_logs) / len(measured_logs))
    predicted = math.exp(sum(predicted_logs) / len(predicted_logs))
    print(f"predicted TPOT speed-up {predicted:.3f}, measured {measured:.3f}, {model}")
    # The model leaves out what a speculative sequence costs beyond its verification slots
    # (serving more tokens per event, the proposer's own work), so the prediction is an upper
    # bound: 11-26 % high here on a quiet machine, more on a loaded one. Held to that direction
    # and size: it fails if the model turns pessimistic or more than 60 % optimistic.
    assert 0.95 * measured <= predicted <= 1.6 * measured, (predicted, measured, model)
    assert live["relative_gap"] == pytest.approx(0.0, abs=1e-9)
