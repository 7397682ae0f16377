"""Token counts on one footing (evidence.counts): every leg of an exchange in one unit before
anything compares them — matched, tokenized, or estimated alike; never an estimate against an
exact count. The tokenizer tap runs against the simulator's real ``/tokenize``."""

from __future__ import annotations

import dataclasses
import math

import pytest

from core.exchange import Recount
from core.sinks import MemorySink
from evidence.counts import CountPlan, CountTap, Tokenizer, reconcile, to_count
from evidence.worker import build_evidence
from simulator.tokens import text_ids
from tests.evidence.legs import exchange, leg, some

WORDS = tuple(f" word{i:02d}" for i in range(40))  # 7 characters each: estimated ≈ 70 tokens
OTHER = tuple(f" other{i:02d}" for i in range(30))


def test_all_exact_legs_pass_untouched():
    ex = exchange(
        primary=leg("primary", WORDS, usage=40), shadows=[leg("candidate", WORDS, usage=40)]
    )
    assert reconcile(ex) is ex


def test_an_exchange_with_no_shadow_is_not_recounted():
    ex = exchange(primary=leg("primary", WORDS), shadows=[])
    assert reconcile(ex) is ex
    assert to_count(ex) == ()


def test_the_same_output_takes_the_exact_count_and_every_timing_follows():
    primary = leg("primary", WORDS, gap_ms=10)  # no usage: the SDK's default
    cand = leg("candidate", WORDS, usage=40, per_event=2, gap_ms=8)
    p0 = some(primary.recording)
    assert p0.tokens_source == "estimated" and p0.output_tokens == math.ceil(7 * 40 / 4)
    out = reconcile(exchange(primary=primary, shadows=[cand]))
    p = some(out.primary.recording)
    assert (p.output_tokens, p.tokens_source) == (40, "matched")
    assert (p.reported_tokens, p.reported_source) == (70, "estimated")
    # (e2e − ttft) / (tokens − 1): 39 gaps of 10 ms over 39 token intervals
    assert p.timings.tpot_s == pytest.approx(0.010)
    assert p.timings.tokens_per_event == pytest.approx(1.0)
    assert out.shadows[0] is cand  # exact legs keep their own count
    assert to_count(exchange(primary=primary, shadows=[cand])) == ()


def test_different_outputs_with_no_tokenizer_are_all_estimated_the_same_way():
    primary = leg("primary", WORDS)
    cand = leg("candidate", OTHER, usage=30)
    out = reconcile(exchange(primary=primary, shadows=[cand]))
    p, c = some(out.primary.recording), some(out.shadows[0].recording)
    assert p.tokens_source == c.tokens_source == "estimated"
    assert c.output_tokens == math.ceil(8 * 30 / 4)  # the same rule as the primary's
    assert (c.reported_tokens, c.reported_source) == (30, "usage")
    assert to_count(exchange(primary=primary, shadows=[cand])) == (0, 1)


def test_a_recount_puts_every_leg_on_the_tokenizer():
    primary = leg("primary", WORDS)
    cand = leg("candidate", OTHER, usage=31)  # the engine counted an end-of-sequence token too
    ex = dataclasses.replace(
        exchange(primary=primary, shadows=[cand]), recount=Recount("candidate", (40, 30))
    )
    out = reconcile(ex)
    p, c = some(out.primary.recording), some(out.shadows[0].recording)
    assert (p.output_tokens, p.tokens_source) == (40, "tokenize")
    assert (c.output_tokens, c.tokens_source) == (30, "tokenize")
    assert c.reported_tokens == 31


def test_a_failed_leg_with_no_output_is_left_alone():
    primary = leg("primary", WORDS)
    broken = leg("baseline", (), outcome="upstream_error")
    cand = leg("candidate", WORDS, usage=40)
    out = reconcile(exchange(primary=primary, shadows=[broken, cand]))
    assert out.shadows[0] is broken
    assert some(out.primary.recording).tokens_source == "matched"


def test_acceptance_reads_the_legs_own_count_comparisons_read_one_footing():
    primary = leg("primary", WORDS)
    cand = leg("candidate", OTHER, usage=30, per_event=3)
    ev = build_evidence(exchange(primary=primary, shadows=[cand], temperature=0.7))
    # tokens per pass from the candidate's own exact count: 30 tokens in 10 events
    assert ev.acceptance[1].tokens_per_pass == pytest.approx(3.0)
    assert {some(leg.recording).tokens_source for leg in ev.exchange.legs} == {"estimated"}
    units = [some(q).units for q in ev.quality]
    assert units == [some(leg.recording).output_tokens for leg in ev.exchange.legs]


async def test_the_tap_counts_outputs_on_the_simulators_tokenizer(sims):
    sim = await sims(model="m")  # the model the legs were sent (tests.evidence.legs)
    tokenizer = {"candidate": Tokenizer(sim.base_url)}
    sink = MemorySink()
    tap = CountTap(sink, lambda: CountPlan(tokenizer))
    await tap.start()
    try:
        primary = leg("primary", WORDS)
        cand = leg("candidate", OTHER, usage=30)
        same = leg("candidate", WORDS, usage=40)
        tap.submit(exchange(1, primary=primary, shadows=[cand]))
        tap.submit(exchange(2, primary=primary, shadows=[same]))  # matched: no call
        got = await sink.wait_for(lambda e: e.exchange_id == "ex-000001")
        through = await sink.wait_for(lambda e: e.exchange_id == "ex-000002")
    finally:
        await tap.stop()
    assert through.recount is None
    recount = some(got.recount)
    assert recount.source == "candidate"
    # The simulator's tokenizer, asked directly, for each output text
    assert recount.counts == (len(text_ids("".join(WORDS))), len(text_ids("".join(OTHER))))
    assert tap.counted == 1 and tap.failed == 0
    out = reconcile(got)
    assert {some(leg.recording).tokens_source for leg in out.legs} == {"tokenize"}


async def test_an_unreachable_tokenizer_hands_the_exchange_on_estimated(unused_tcp_port):
    sink = MemorySink()
    drops: list[str] = []
    plan = CountPlan({"candidate": Tokenizer(f"http://127.0.0.1:{unused_tcp_port}")}, timeout_s=2)
    tap = CountTap(sink, lambda: plan, on_drop=drops.append)
    await tap.start()
    try:
        tap.submit(
            exchange(primary=leg("primary", WORDS), shadows=[leg("candidate", OTHER, usage=30)])
        )
        got = await sink.wait_for()
    finally:
        await tap.stop()
    assert got.recount is None and drops == ["error"] and tap.failed == 1
    assert {some(leg.recording).tokens_source for leg in reconcile(got).legs} == {"estimated"}
