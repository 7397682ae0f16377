"""The step-time model against a continuous-batching simulator whose step time is known.

The simulators' engine steps every running request together: a step costs ``step_s`` plus
``step_slot_s`` per verification slot (1 per plain request, drafted + 1 per speculative one) —
the shape the model assumes. Mirrored traffic at a few concurrencies gives the legs a spread of
batches; the model fitted from the records must recover the two constants, and its predicted
TPOT speed-up for the live configuration must agree with the speed-up measured on the same pairs
within ±10 %.

Each leg is credited with the batch it decoded in (the gateway's in-flight count averaged over
its decode interval). The test also fits the model on the batch at dispatch, the credit it
replaced: traffic arrives in waves of c requests sent at once, so the i-th leg of a wave is
credited with i at dispatch although all c decode together. Measured over fourteen runs on a
shared 2-core machine: predicted / measured 0.93–1.06 with the decode credit, 1.02–1.38 with the
dispatch credit; the credited batch over the wave's 0.99–1.00 against 0.64–0.89 (0.93 on a clean
CI run: the dispatch credit reads the engine's scraped running count, a snapshot every 50 ms whose
lag behind a wave is the machine's, so it is printed, not held).

Timing tier (docs/testing.md): the step times the model is fitted on are the gateway's wall-clock
reading of the simulator's steps, so the fitted constants and the predicted / measured speed-up
are claims about a measurement on this machine, run alone and once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from counterfactual.matrix import ALL, build_matrix
from counterfactual.speed import StepModel, dispatch_batch, fit_step_model, leg_batch
from gateway.settings import Settings
from records.readback import iter_records
from records.reader import Leg, Record, read
from specshadow.app import build_app
from tests.conftest import FAST_UPSTREAM, start_server

STEP_S, SLOT_S = 0.004, 0.001
COPY = {"category_copy": {"code": 0.8}}
WAVE_OF: dict[str, int] = {}  # request id → the size of the wave it was sent in
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


@pytest.mark.timing
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
                WAVE_OF.update({f"s{n + j}": concurrency for j in range(concurrency)})
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
    records = [read(r) for r in iter_records([store])]
    fits = {name: fit(records, credit) for name, credit in CREDITS.items()}
    # The matrix fits on the batch a leg decoded in: the same points as the test's own fit.
    assert fits["decode"].slot_s == pytest.approx(model.slot_s, rel=1e-9), (fits, model)
    bias = {name: predicted_over_measured(records, f, CREDITS[name], tpp, drafted)
            for name, f in fits.items()}  # fmt: skip
    print(f"predicted / measured TPOT speed-up: {bias}; {fits}")
    # The batch a leg decoded in: the prediction within ±10 % of the measured speed-up.
    assert 0.9 <= bias["decode"] <= 1.1, (bias, fits)
    # The credit itself against the engine's known batch: the primary's server runs only the
    # wave a leg came in (c requests of 48 tokens, sent at once, decoding together), so the
    # batch it decoded in is c. The batch at dispatch credits the i-th leg of a wave with i —
    # the legs dispatched before it only — about (c + 1) / 2 on average.
    ratios: dict[str, list[float]] = {"decode": [], "dispatch": []}
    for r in records:
        p = r.primary
        wave = WAVE_OF.get(r.request_id or "")
        if p is None or wave is None or wave == 1:
            continue
        for name, credit in CREDITS.items():
            b = credit(p)
            assert b is not None
            ratios[name].append(b / wave)
    mean = {name: sum(v) / len(v) for name, v in ratios.items()}
    print(f"credited batch / the wave's batch, primary legs: {mean}")
    assert 0.9 <= mean["decode"] <= 1.05, mean
    # The dispatch credit is printed, not held: it reads the engine's scraped running count, and
    # where a 50 ms scrape falls against a wave is the machine's timing (0.64-0.89 over fourteen
    # runs here, 0.93 on a clean CI run).
    assert live["relative_gap"] == pytest.approx(0.0, abs=1e-9)


CREDITS: dict[str, Callable[[Leg], float | None]] = {
    "decode": leg_batch,
    "dispatch": dispatch_batch,
}


def step_points(
    records: list[Record], credit: Callable[[Leg], float | None]
) -> list[tuple[float, float, float]]:
    """(batch, slots per sequence, step seconds) of every completed leg, the batch from
    ``credit``: the primary's TPOT at one slot, the candidate's TPOT × tokens per pass at
    1 + drafted per pass (the engine's own counts)."""
    out = []
    for r in records:
        for leg in r.legs:
            tpot, b, n, acc = leg.tpot_s, credit(leg), leg.output_tokens, leg.acceptance
            if not leg.ok or tpot is None or b is None or n is None or n < 2:
                continue
            if leg.role == "primary":
                out.append((b, 1.0, tpot))
            elif acc.tokens_per_pass and acc.num_draft_tokens is not None:
                passes = n / acc.tokens_per_pass
                out.append((b, 1.0 + acc.num_draft_tokens / passes, tpot * acc.tokens_per_pass))
    return out


def fit(records: list[Record], credit: Callable[[Leg], float | None]) -> StepModel:
    model = fit_step_model(step_points(records, credit), [])
    assert model is not None and model.identified, model
    return model


def predicted_over_measured(
    records: list[Record],
    model: StepModel,
    credit: Callable[[Leg], float | None],
    tpp: float,
    drafted: float,
) -> float:
    """Geometric mean over pairs of (predicted at the pair's primary batch) / (measured)."""
    logs = []
    for r in records:
        p, c = r.primary, r.candidate_leg(None)
        batch = credit(p) if p is not None else None
        if p is None or c is None or not p.tpot_s or not c.tpot_s or batch is None:
            continue
        at = dataclasses.replace(model, batch=batch).speedup(tpp, drafted)
        assert at is not None
        logs.append(math.log(at) - math.log(p.tpot_s / c.tpot_s))
    assert len(logs) >= 50, len(logs)
    return math.exp(sum(logs) / len(logs))
