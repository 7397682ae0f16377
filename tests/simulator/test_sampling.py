"""Sampled answers held to their known distribution: the pure model, lossless speculative
sampling, the lossy modes, and the same properties over real sockets.

Distribution checks draw in process with seeded RNGs (so every p-value here is a fixed number,
not a coin flip) and compare with probabilities computed from the pure ground truth."""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import pytest

from simulator import SimConfig, SimServer
from simulator.cli import config_from_args, register
from simulator.config import SAMPLING_DEFECTS
from simulator.plan import plan_completion
from simulator.request import parse_request
from simulator.sampling import (
    COMMA,
    EOS,
    GREEDY_EPS,
    PERIOD,
    VOCAB,
    Speculation,
    TokenModel,
    distribution,
    distribution_from_logits,
    drafter_for,
    generate,
    logits,
    model_for,
    next_token_distribution,
    parse_text,
    pieces,
    raw_logprob,
    sequence_logprobs,
)
from simulator.textgen import digest, split_pieces

FAST: dict[str, Any] = {"prefill_base_s": 0.0, "step_s": 0.0}
TARGET = TokenModel.of()
DRAFTER = TARGET.perturbed("target/drafter", 0.7)
ALPHA = 1e-3  # an honest sampler fails a fixed-seed check with this probability, once

# ------------------------------------------------------------------ statistics helpers


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df ≥ x), Wilson–Hilferty (accurate to well under 1e-3 for df ≥ 10)."""
    if df <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square_p(counts: Mapping[Any, int], probs: Mapping[Any, float], n: int) -> float:
    """Pearson's test of ``counts`` against ``probs``, cells under 5 expected pooled; an
    observed cell of probability 0 is an immediate 0."""
    if any(probs.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0
    stat, cells, pooled_e, pooled_o = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5.0:
            stat += (o - e) ** 2 / e
            cells += 1
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return chi2_sf(stat, cells - 1)


def pair_probs(
    model: TokenModel, d: bytes, temperature: float, top_p: float
) -> dict[tuple[int, int], float]:
    """Exact P(tokens 1 and 2 = (b, c)), summing token 0 out."""
    p0 = distribution(model, d, None, 0, temperature=temperature, top_p=top_p)
    m1 = [0.0] * len(VOCAB)
    for a, pa in enumerate(p0):
        if pa > 0:
            for b, pb in enumerate(
                distribution(model, d, a, 1, temperature=temperature, top_p=top_p)
            ):
                m1[b] += pa * pb
    out: dict[tuple[int, int], float] = {}
    for b, pb in enumerate(m1):
        if pb > 0:
            row = distribution(model, d, b, 2, temperature=temperature, top_p=top_p)
            out |= {(b, c): pb * pc for c, pc in enumerate(row) if pc > 0}
    return out


def draw_pairs(
    n: int, model: TokenModel, d: bytes, temperature: float, top_p: float, **kw: Any
) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for i in range(n):
        s = generate(
            model, d, temperature=temperature, top_p=top_p, max_tokens=4, rng=random.Random(i), **kw
        )
        counts[s.ids[1:3]] += 1
    return counts


def reference_distribution(
    values: Sequence[float], temperature: float, top_p: float
) -> list[float]:
    """The sampling rule, written independently: softmax(logits / T), then the smallest set of
    most probable tokens whose mass reaches top_p."""
    if temperature <= GREEDY_EPS or math.inf in values:
        best = values.index(max(values))
        return [float(t == best) for t in range(len(values))]
    top = max(values)
    w = [math.exp((v - top) / temperature) for v in values]
    z = sum(w)
    probs = [x / z for x in w]
    ranked = sorted(range(len(values)), key=lambda t: (-values[t], t))
    keep, mass = set(), 0.0
    for t in ranked:
        if mass >= top_p or probs[t] == 0.0:
            break
        keep.add(t)
        mass += probs[t]
    kept = sum(probs[t] for t in keep)
    return [probs[t] / kept if t in keep else 0.0 for t in range(len(values))]


# ------------------------------------------------------------------ the pure model


def test_the_vocabulary_is_the_words_then_punctuation_then_eos():
    assert (VOCAB[PERIOD], VOCAB[COMMA], VOCAB[EOS]) == (".", ",", "<eos>")
    assert len(VOCAB) == EOS + 1 == 65


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1.0, 1.0), (0.8, 1.0), (0.8, 0.9), (0.5, 0.5), (1.7, 0.95)]
)
def test_the_cached_distribution_is_the_sampling_rule_on_the_logits(temperature, top_p):
    d = digest(b"rule")
    model = TokenModel.of(min_tokens=3, max_tokens=9)
    for prev in (None, 0, 7, PERIOD, COMMA, 61):
        for position in (0, 2, 3, 5, 8, 9):
            got = distribution(model, d, prev, position, temperature=temperature, top_p=top_p)
            values = logits(model, d, prev, position)
            want = reference_distribution(values, temperature, top_p)
            assert got == pytest.approx(want, abs=1e-12)
            assert distribution_from_logits(
                values, temperature=temperature, top_p=top_p
            ) == pytest.approx(want, abs=1e-12)
            assert math.fsum(got) == pytest.approx(1.0)


def test_eos_is_impossible_before_min_tokens_and_forced_at_max_tokens():
    d = digest(b"eos")
    for prev in (None, 3):
        assert next_token_distribution(d, prev, 15, temperature=1.0)[EOS] == 0.0
        assert next_token_distribution(d, prev, 16, temperature=1.0)[EOS] > 0.0
        assert next_token_distribution(d, prev, 256, temperature=1.0)[EOS] == 1.0
    # at temperature 1 without truncation the hazard is exactly 1 / (max − position + 1)
    assert next_token_distribution(d, 3, 200, temperature=1.0)[EOS] == pytest.approx(1 / 57)


def test_punctuation_never_starts_an_answer_nor_follows_punctuation():
    d = digest(b"punct")
    for prev in (None, PERIOD, COMMA):
        probs = next_token_distribution(d, prev, 1, temperature=1.0)
        assert probs[PERIOD] == probs[COMMA] == 0.0


def test_greedy_is_the_argmax_and_is_the_same_for_every_server_with_that_model():
    d = digest(b"greedy")
    for prev in (None, 5, PERIOD):
        values = logits(TARGET, d, prev, 20)
        probs = distribution(TARGET, d, prev, 20, temperature=0.0, top_p=0.3)
        assert probs.index(1.0) == values.index(max(values)) and sum(probs) == 1.0
    one = generate(TARGET, d, temperature=0.0, max_tokens=64, rng=random.Random(1))
    other = generate(TARGET, d, temperature=0.0, max_tokens=64, rng=random.Random(2))
    spec = generate(
        TARGET,
        d,
        temperature=0.0,
        max_tokens=64,
        rng=random.Random(3),
        speculation=Speculation(k=4, drafter=DRAFTER),
    )
    assert one.ids == other.ids == spec.ids
    assert one.ids != generate(TARGET, d, temperature=1.0, max_tokens=64, rng=random.Random(1)).ids


def test_a_different_salt_is_a_different_model():
    d = digest(b"salt")
    a = next_token_distribution(d, None, 0, temperature=1.0)
    b = next_token_distribution(d, None, 0, temperature=1.0, model_salt="other")
    assert sum(abs(x - y) for x, y in zip(a, b, strict=True)) > 0.5


def test_distributions_are_moderately_peaked_and_samples_at_0_8_differ_in_most_tokens():
    tops, mismatched, total = [], 0, 0
    for i in range(30):
        d = digest(b"peak%d" % i)
        tops.append(max(next_token_distribution(d, None, 0, temperature=1.0)))
        a = generate(TARGET, d, temperature=0.8, max_tokens=64, rng=random.Random(2 * i)).ids
        b = generate(TARGET, d, temperature=0.8, max_tokens=64, rng=random.Random(2 * i + 1)).ids
        mismatched += sum(x != y for x, y in zip(a, b, strict=False))
        total += min(len(a), len(b))
    assert 0.15 < sum(tops) / len(tops) < 0.6
    assert mismatched / total > 0.6


def test_natural_lengths_spread_over_min_to_max_and_stop_at_eos():
    lengths = []
    for i in range(200):
        s = generate(
            TARGET, digest(b"len%d" % i), temperature=1.0, max_tokens=500, rng=random.Random(i)
        )
        assert s.stopped
        lengths.append(len(s.ids))
    assert min(lengths) >= 16 and max(lengths) <= 256
    assert 110 < sum(lengths) / len(lengths) < 160  # uniform on [16, 256]: 136
    capped = generate(TARGET, digest(b"len0"), temperature=1.0, max_tokens=8, rng=random.Random(0))
    assert len(capped.ids) == 8 and not capped.stopped


def test_text_round_trips_through_the_tokenizer_and_parse_text():
    ids = list(
        generate(TARGET, digest(b"text"), temperature=1.0, max_tokens=80, rng=random.Random(4)).ids
    )
    toks = pieces(ids)
    text = "".join(toks)
    assert split_pieces(text) == toks
    assert parse_text(text) == ids
    assert toks[0][0].isupper() and not toks[0].startswith(" ")
    assert parse_text("Lorem ipsum dolor") == [0, 1, 2]
    assert parse_text("lorem") is None  # the model capitalises the first word
    assert parse_text("Hello world") is None


def test_sequence_logprobs_add_up_to_the_probability_of_a_seeded_draw():
    d = digest(b"likelihood")
    model = TokenModel.of(min_tokens=2, max_tokens=3)
    probs: Counter[tuple[int, ...]] = Counter()
    n = 4000
    for i in range(n):
        probs[
            generate(model, d, temperature=0.6, top_p=0.8, max_tokens=5, rng=random.Random(i)).ids
        ] += 1
    top, count = probs.most_common(1)[0]
    lp = sequence_logprobs(model, d, top, temperature=0.6, top_p=0.8, stopped=True)
    assert len(lp) == len(top) + 1
    p = math.exp(sum(lp))
    assert abs(count / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert sequence_logprobs(model, d, [PERIOD], temperature=1.0) == [-math.inf]


# ------------------------------------------------------------------ speculative sampling


@pytest.mark.parametrize(("temperature", "top_p"), [(0.8, 1.0), (0.7, 0.9)])
def test_speculative_sampling_is_lossless(temperature, top_p):
    """Tokens 1 and 2 come from the first speculative step (up to 2 drafts); their joint
    frequencies over seeded draws match the target exactly."""
    d = digest(b"exactness")
    n = 8000
    counts = draw_pairs(
        n, TARGET, d, temperature, top_p, speculation=Speculation(k=3, drafter=DRAFTER)
    )
    assert chi_square_p(counts, pair_probs(TARGET, d, temperature, top_p), n) > ALPHA


def test_speculative_sampling_is_lossless_through_eos_and_its_steps_add_up():
    d = digest(b"lengths")
    model = TokenModel.of(min_tokens=2, max_tokens=5)
    drafter = model.perturbed("d", 0.7)
    n = 6000
    lengths: Counter[int] = Counter()
    for i in range(n):
        s = generate(
            model,
            d,
            temperature=0.9,
            max_tokens=10,
            rng=random.Random(i),
            speculation=Speculation(k=4, drafter=drafter),
        )
        assert s.stopped and sum(st.emitted for st in s.steps) == len(s.ids)
        assert all(st.accepted <= st.drafted <= 4 for st in s.steps)
        lengths[len(s.ids)] += 1
    # exact length distribution: forward over the previous token
    alpha: dict[int | None, float] = {None: 1.0}
    want: dict[int, float] = {}
    for position in range(6):
        nxt: dict[int | None, float] = {}
        for prev, mass in alpha.items():
            for t, p in enumerate(distribution(model, d, prev, position, temperature=0.9)):
                if t == EOS and p:
                    want[position] = want.get(position, 0.0) + mass * p
                elif p:
                    nxt[t] = nxt.get(t, 0.0) + mass * p
        alpha = nxt
    assert set(want) == {2, 3, 4, 5}
    assert chi_square_p(lengths, want, n) > ALPHA


def test_acceptance_comes_from_the_drafter():
    d = digest(b"acceptance")

    def rate(drafter: TokenModel, temperature: float) -> float:
        drafted = accepted = 0
        for i in range(40):
            s = generate(
                TARGET,
                d,
                temperature=temperature,
                max_tokens=64,
                rng=random.Random(i),
                speculation=Speculation(k=4, drafter=drafter),
            )
            drafted += sum(st.drafted for st in s.steps)
            accepted += sum(st.accepted for st in s.steps)
        return accepted / drafted

    assert rate(TARGET, 0.8) == 1.0  # the target as its own drafter: everything accepted
    assert rate(TARGET, 0.0) == 1.0
    assert 0.3 < rate(DRAFTER, 0.8) < 0.8
    assert rate(TARGET.perturbed("d", 3.0), 0.8) < rate(DRAFTER, 0.8)


def test_draft_temperature_ignored_is_biased_where_the_honest_drafter_is_not():
    d = digest(b"exactness")
    n = 8000
    probs = pair_probs(TARGET, d, 0.6, 1.0)
    buggy = Speculation(k=3, drafter=DRAFTER, draft_temperature=1.0)
    assert chi_square_p(draw_pairs(n, TARGET, d, 0.6, 1.0, speculation=buggy), probs, n) < 1e-9
    # at temperature 1 the bug is invisible: the draft temperature is the right one
    probs_1 = pair_probs(TARGET, d, 1.0, 1.0)
    assert chi_square_p(draw_pairs(n, TARGET, d, 1.0, 1.0, speculation=buggy), probs_1, n) > ALPHA


def test_logit_noise_and_a_different_model_are_detectably_biased():
    d = digest(b"exactness")
    n = 6000
    probs = pair_probs(TARGET, d, 0.8, 1.0)
    assert chi_square_p(draw_pairs(n, TARGET, d, 0.8, 1.0), probs, n) > ALPHA
    noisy = draw_pairs(n // 2, TARGET, d, 0.8, 1.0, noise_sigma=1.5)
    assert chi_square_p(noisy, probs, n // 2) < 1e-9
    other = TARGET.mixed("target/different", 0.5)
    assert chi_square_p(draw_pairs(n, other, d, 0.8, 1.0), probs, n) < 1e-9


def test_model_for_applies_the_server_settings_and_the_different_model_defect():
    honest = SimConfig(sampling=True, min_output_tokens=4, max_output_tokens=9, model_salt="m")
    assert model_for(honest) == TokenModel.of("m", min_tokens=4, max_tokens=9)
    assert drafter_for(SimConfig(sampling=True, draft_logit_sigma=0.0)) == TokenModel.of()
    mixed = model_for(
        SimConfig(sampling=True, sampling_defect="different_model", defect_strength=0.6)
    )
    (salt, kept), other = mixed.terms
    assert (salt, other) == ("target", ("target/different", 0.6))
    assert kept == pytest.approx(0.8)
    whole = model_for(SimConfig(sampling=True, sampling_defect="different_model"))
    assert whole.terms == (("target/different", 1.0),)


def test_top_p_is_honoured_no_token_outside_the_nucleus_is_ever_drawn():
    d = digest(b"nucleus")
    spec = Speculation(k=4, drafter=DRAFTER)
    for i in range(300):
        for speculation in (None, spec):
            s = generate(
                TARGET,
                d,
                temperature=1.0,
                top_p=0.5,
                max_tokens=24,
                rng=random.Random(i),
                speculation=speculation,
            )
            lp = sequence_logprobs(TARGET, d, s.ids, temperature=1.0, top_p=0.5)
            assert all(x > -math.inf for x in lp)


# A cost on the wall clock: the timing tier (docs/testing.md).
@pytest.mark.timing
def test_drawing_256_tokens_is_cheap():
    model = TokenModel.of(min_tokens=256, max_tokens=256)
    d = digest(b"speed")
    generate(model, d, temperature=0.8, top_p=0.95, max_tokens=256, rng=random.Random(0))
    best = math.inf
    for rep in range(3):
        start = time.perf_counter()
        for i in range(10):
            s = generate(
                model,
                d,
                temperature=0.8,
                top_p=0.95,
                max_tokens=256,
                rng=random.Random(rep * 10 + i),
            )
            assert len(s.ids) == 256
        best = min(best, (time.perf_counter() - start) / 10)
    assert best < 0.005


# ------------------------------------------------------------------ config and CLI


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampling_defect": "bogus"}, "sampling_defect: expected one of"),
        ({"sampling_defect": "greedy_collapse"}, "needs sampling=True"),
        ({"sampling": True, "sampling_defect": "draft_temperature_ignored"}, "mode='speculative'"),
        (
            {
                "sampling": True,
                "mode": "speculative",
                "drafting": "replay",
                "sampling_defect": "draft_temperature_ignored",
            },
            "drafting='probabilistic'",
        ),
        ({"sampling": True, "sampling_defect": "logit_noise"}, "logit_noise_sigma > 0"),
        ({"logit_noise_sigma": -1.0}, "logit_noise_sigma"),
        ({"defect_strength": 0.0}, "defect_strength"),
        ({"defect_strength": 1.5}, "defect_strength"),
        ({"model_salt": ""}, "model_salt"),
        ({"draft_logit_sigma": -0.1}, "draft_logit_sigma"),
    ],
)
def test_config_rejects_bad_sampling_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)


def test_the_defaults_do_not_sample():
    config = SimConfig()
    assert (config.sampling, config.sampling_defect, config.model_salt) == (False, "none", "target")
    assert set(SAMPLING_DEFECTS) == {
        "none",
        "greedy_collapse",
        "draft_temperature_ignored",
        "different_model",
        "logit_noise",
    }


def test_cli_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["simulate", "--mode", "speculative", "--sampling", "--sampling-defect", "logit_noise",
         "--logit-noise-sigma", "0.5", "--model-salt", "m2", "--defect-strength", "0.4",
         "--draft-logit-sigma", "0.2"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.sampling and config.sampling_defect == "logit_noise"
    assert (config.logit_noise_sigma, config.model_salt) == (0.5, "m2")
    assert (config.defect_strength, config.draft_logit_sigma) == (0.4, 0.2)
    plain = config_from_args(parser.parse_args(["simulate"]))
    assert not plain.sampling and plain.sampling_defect == "none"


# ------------------------------------------------------------------ planning


def chat(content: str, **extra: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **extra}).encode()


def test_structured_outputs_and_tool_calls_stay_deterministic_when_sampling():
    sampling = SimConfig(sampling=True)
    plain = SimConfig()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in (
        chat("j", response_format={"type": "json_object"}, temperature=1.0),
        chat("t", tools=tools, temperature=1.0),
    ):
        a = plan_completion(sampling, parse_request("chat", body, sampling), "chat")
        b = plan_completion(plain, parse_request("chat", body, plain), "chat")
        assert a.tokens == b.tokens and a.sampling is None


def test_greedy_collapse_serves_the_argmax_at_any_temperature():
    config = SimConfig(sampling=True, sampling_defect="greedy_collapse")
    body = chat("collapse", temperature=1.0, max_tokens=30)
    plan = plan_completion(config, parse_request("chat", body, config), "chat")
    d = bytes.fromhex(plan.prompt_hash)
    assert plan.text == "".join(
        pieces(generate(TARGET, d, temperature=0.0, max_tokens=30, rng=random.Random()).ids)
    )
    assert plan.sampling is not None and plan.sampling.temperature == 1.0


def test_logit_noise_breaks_even_greedy_exact_match():
    config = SimConfig(sampling=True, sampling_defect="logit_noise", logit_noise_sigma=2.0)
    honest = SimConfig(sampling=True)
    body = chat("noisy greedy", temperature=0, max_tokens=40)
    want = plan_completion(honest, parse_request("chat", body, honest), "chat").tokens
    got = {
        plan_completion(config, parse_request("chat", body, config), "chat").tokens
        for _ in range(5)
    }
    assert want not in got


@pytest.mark.parametrize(
    "penalty",
    [
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.2},
        {"repetition_penalty": 1.1},
        {"min_p": 0.05},
    ],
)
@pytest.mark.parametrize("sampling", [False, True])
def test_penalty_requests_are_planned_without_speculation(penalty, sampling):
    config = SimConfig(
        mode="speculative", sampling=sampling, min_output_tokens=40, max_output_tokens=40
    )
    body = chat("penalised", max_tokens=40, temperature=0, **penalty)
    req = parse_request("chat", body, config)
    assert req.spec_decode_unsupported
    plan = plan_completion(config, req, "chat")
    assert all(s.drafted == 0 for s in plan.steps) and len(plan.steps) == len(plan.tokens)
    no_penalty = plan_completion(
        config,
        parse_request("chat", chat("penalised", max_tokens=40, temperature=0), config),
        "chat",
    )
    assert no_penalty.tokens == plan.tokens  # the penalties do not change the answer
    assert any(s.drafted for s in no_penalty.steps)


def test_neutral_penalties_keep_speculation():
    config = SimConfig(mode="speculative")
    body = chat("neutral", frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1, min_p=0)
    assert not parse_request("chat", body, config).spec_decode_unsupported


# ------------------------------------------------------------------ over HTTP


async def complete(
    session: aiohttp.ClientSession, server: SimServer, body: dict[str, Any], request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    async with session.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
    ) as resp:
        assert resp.status == 200, await resp.text()
        answer = json.loads(await resp.read())
    async with session.get(f"{server.base_url}/sim/requests", params={"id": request_id}) as resp:
        record = json.loads(await resp.read())
    return answer, record


def body_for(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def spec_counters(session: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    async with session.get(f"{server.base_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


async def test_greedy_answers_match_exactly_across_plain_and_speculative_servers(
    start_sim, session
):
    plain = await start_sim(SimConfig(sampling=True, **FAST))
    spec = await start_sim(SimConfig(sampling=True, mode="speculative", **FAST))
    body = body_for("greedy over http", temperature=0, max_tokens=48, include_metrics=True)
    a, ra = await complete(session, plain, body, "g1")
    b, rb = await complete(session, spec, body, "g2")
    text = a["choices"][0]["message"]["content"]
    assert text == b["choices"][0]["message"]["content"]
    d = bytes.fromhex(ra["prompt_hash"])
    want = generate(TARGET, d, temperature=0.0, max_tokens=48, rng=random.Random())
    assert text == "".join(pieces(want.ids))
    assert a["choices"][0]["finish_reason"] == ("stop" if want.stopped else "length")
    assert rb["num_draft_tokens"] > 0 and ra["num_draft_tokens"] == 0
    assert ra["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": None, "defect": "none"}


async def test_unseeded_draws_are_independent_across_servers(start_sim, session):
    one = await start_sim(SimConfig(sampling=True, **FAST))
    two = await start_sim(SimConfig(sampling=True, mode="speculative", **FAST))
    body = body_for("independent", temperature=0.8, max_tokens=40)
    texts = [
        (await complete(session, server, body, f"i{n}"))[0]["choices"][0]["message"]["content"]
        for n, server in enumerate((one, one, two))
    ]
    assert len(set(texts)) == 3
    absent = (await complete(session, one, body_for("independent", max_tokens=40), "i3"))[1]
    assert absent["sampling"]["temperature"] == 1.0  # vLLM's default when absent


async def test_a_seed_makes_the_draw_reproducible(start_sim, session):
    one = await start_sim(SimConfig(sampling=True, **FAST))
    two = await start_sim(SimConfig(sampling=True, **FAST))
    seeded = body_for("seeded", temperature=0.9, max_tokens=40, seed=7)
    a = (await complete(session, one, seeded, "s1"))[0]["choices"][0]["message"]["content"]
    b = (await complete(session, two, seeded, "s2"))[0]["choices"][0]["message"]["content"]
    c = (await complete(session, one, {**seeded, "seed": 8}, "s3"))[0]["choices"][0]["message"][
        "content"
    ]
    assert a == b != c


async def test_sampled_text_its_logprobs_and_its_likelihood_are_the_models(start_sim, session):
    server = await start_sim(SimConfig(sampling=True, **FAST))
    body = body_for("likelihood", temperature=0.7, top_p=0.6, max_tokens=64, logprobs=True)
    answer, record = await complete(session, server, body, "lp")
    text = answer["choices"][0]["message"]["content"]
    ids = parse_text(text)
    assert ids is not None and len(ids) == answer["usage"]["completion_tokens"]
    d = bytes.fromhex(record["prompt_hash"])
    stopped = answer["choices"][0]["finish_reason"] == "stop"
    lp = sequence_logprobs(TARGET, d, ids, temperature=0.7, top_p=0.6, stopped=stopped)
    assert all(x > -math.inf for x in lp)  # every token inside the nucleus
    reported = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    raw = [
        raw_logprob(TARGET, d, p, i, t)
        for i, (p, t) in enumerate(zip([None, *ids], ids, strict=False))
    ]
    assert reported == pytest.approx(raw, abs=1e-6)


async def test_sampled_speculative_metrics_add_up_to_the_ground_truth(start_sim, session):
    server = await start_sim(SimConfig(sampling=True, mode="speculative", **FAST))
    before = await spec_counters(session, server)
    records = []
    for i in range(6):
        body = body_for(
            f"metrics {i}",
            temperature=0.8,
            max_tokens=64,
            include_metrics=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with session.post(
            f"{server.base_url}/v1/chat/completions", json=body, headers={"x-request-id": f"m{i}"}
        ) as resp:
            raw = (await resp.read()).decode()
        chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
        record = server.state.requests[f"m{i}"]
        sd = chunks[-1]["metrics"]["speculative_decoding"]
        assert sd["num_draft_tokens"] == record.num_draft_tokens
        assert sd["num_accepted_draft_tokens"] == record.num_accepted_tokens
        assert record.completion_tokens == len(record.per_step_drafted) + record.num_accepted_tokens
        records.append(record)
    after = await spec_counters(session, server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:spec_decode_num_draft_tokens_total"] == sum(
        r.num_draft_tokens for r in records
    )
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] == sum(
        r.num_accepted_tokens for r in records
    )
    assert delta["vllm:spec_decode_num_drafts_total"] == sum(r.num_drafts for r in records)
    assert (
        0 < sum(r.num_accepted_tokens for r in records) < sum(r.num_draft_tokens for r in records)
    )


@pytest.mark.parametrize("sampling", [False, True])
async def test_penalty_requests_draft_nothing_over_http(start_sim, session, sampling):
    server = await start_sim(SimConfig(mode="speculative", sampling=sampling, **FAST))
    before = await spec_counters(session, server)
    body = body_for("penalised", max_tokens=40, frequency_penalty=0.3, include_metrics=True)
    answer, record = await complete(session, server, body, "pen")
    assert record["num_draft_tokens"] == 0 and record["num_drafts"] == 0
    assert "speculative_decoding" not in answer["metrics"]
    assert await spec_counters(session, server) == before
    _, drafted = await complete(session, server, body_for("penalised", max_tokens=40), "nopen")
    assert drafted["num_draft_tokens"] > 0


async def test_a_sampling_server_refuses_bad_sampling_parameters_and_others_ignore_them(
    start_sim, session
):
    sampling = await start_sim(SimConfig(sampling=True, **FAST))
    plain = await start_sim(SimConfig(**FAST))
    for bad in (
        {"temperature": -1},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"seed": 1.5},
        {"frequency_penalty": 3},
        {"repetition_penalty": 0},
        {"min_p": 2},
    ):
        body = body_for("bad", **bad)
        async with session.post(f"{sampling.base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 400, bad
            param = json.loads(await resp.read())["error"]["param"]
            assert param == next(iter(bad))
        async with session.post(f"{plain.base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, bad
