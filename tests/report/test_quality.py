"""The quality-equivalence tests held to a known truth (report.quality, docs/quality.md).

A synthetic "model" writes texts from a known word distribution (a Zipf law over a vocabulary,
a refusal probability, a length law); records carry what the evidence worker would compute from
them (evidence.quality's scalars and sketch). A/A — candidate and baseline draw from the same
model — measures the false-alarm rate; a candidate from a shifted model measures power. Every
rate below is measured over many seeds and asserted against the rate docs/quality.md states,
with the binomial slack written next to it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from core.quality import DEFAULT_MARGINS
from evidence.compare import similarity
from evidence.quality import repetition_stats, sketch
from records.reader import read_all
from report.quality import MIN_EXCHANGES, collect, holm, judge, rate_test

VOCAB = [f"w{i}" for i in range(400)]


@dataclass(frozen=True)
class Model:
    zipf: float = 1.1  # word law exponent
    refusal: float = 0.02
    mean_words: float = 60.0
    loop: float = 0.0  # probability each word repeats the previous 6-word span (greedy-ish)
    shift: int = 0  # rotates the vocabulary ranks (a different model's preferred words)

    def text(self, rng: random.Random, prompt: int) -> str:
        if rng.random() < self.refusal:
            return "I'm sorry, but I can't help with that."
        # The prompt fixes a topic (a few words it favours) and most of the length; the draw
        # adds ±15 % — as an LLM's sampled answers to one prompt vary around its typical length.
        topic = random.Random(prompt)
        base = self.mean_words * topic.uniform(0.4, 1.6)
        n = max(4, int(base * (1 + rng.gauss(0, 0.15))))
        favoured = [topic.randrange(len(VOCAB)) for _ in range(8)]
        cum = _cum_weights(self.zipf, self.shift)
        words: list[str] = []
        while len(words) < n:
            if self.loop and len(words) >= 6 and rng.random() < self.loop:
                words.extend(words[-6:])
                continue
            if rng.random() < 0.3:
                words.append(VOCAB[rng.choice(favoured)])
            else:
                words.append(VOCAB[bisect.bisect(cum, rng.random() * cum[-1])])
        return " ".join(words[:n]) + "."


@functools.cache
def _cum_weights(zipf: float, shift: int) -> list[float]:
    w = [1 / (1 + ((i + shift) % len(VOCAB))) ** zipf for i in range(len(VOCAB))]
    return list(itertools.accumulate(w))


def quality_of(text: str, primary: str | None) -> dict[str, Any]:
    d2, rep, longest = repetition_stats(text)
    sim = None
    if primary is not None:
        sim, _ = similarity(text.split(), primary.split())
    return {
        "units": len(text.split()),
        "finish_length": False,
        "distinct_2": d2,
        "repetition": rep,
        "longest_repeat": longest,
        "refusal": text.startswith("I'm sorry"),
        "json_valid": None,
        "tool_calls": 0,
        "tool_valid": None,
        "citations": 0,
        "similarity": sim,
        "sketch": list(sketch(text) or ()),
    }


def records(n: int, candidate: Model, baseline: Model, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randrange(10**9)
        p = baseline.text(rng, prompt)
        c = candidate.text(rng, prompt)
        b = baseline.text(rng, prompt)
        legs = [
            {"role": "primary", "backend": "prod", "outcome": "completed", "quality": quality_of(p, None)},
            {"role": "candidate", "backend": "cand", "outcome": "completed", "quality": quality_of(c, p)},
            {"role": "baseline", "backend": "base", "outcome": "completed", "quality": quality_of(b, p)},
        ]  # fmt: skip
        out.append(
            {"exchange_id": f"{seed}-{i}", "greedy": False, "category": "chat", "legs": legs}
        )
    return out


def verdict(n: int, candidate: Model, seed: int, margins: dict[str, float] | None = None) -> Any:
    pairs = collect(read_all(records(n, candidate, Model(), seed)), "cand")["all"]
    return judge(pairs, None, seed=seed, margins={**DEFAULT_MARGINS, **(margins or {})})


def test_holm_steps_down_and_stops_at_the_first_acceptance() -> None:
    assert holm({"a": 0.001, "b": 0.02, "c": 0.04}, 0.05) == {"a", "b", "c"}
    assert holm({"a": 0.001, "b": 0.03, "c": 0.04}, 0.05) == {"a"}
    assert holm({"a": 0.03, "b": 0.04}, 0.05) == set()


def test_an_all_zero_rate_table_does_not_prove_a_one_point_margin() -> None:
    zeros = np.zeros(60)
    t = rate_test("refusal_rate", zeros, zeros, 0.01, 0.05, np.random.default_rng(0))
    assert t.difference == 0 and not t.inside  # ±1.645/(n+2) ≈ ±2.7 pts
    big = np.zeros(400)
    assert rate_test("refusal_rate", big, big, 0.01, 0.05, np.random.default_rng(0)).inside


SEEDS = 80


def test_an_identical_candidate_is_rarely_called_not_equivalent() -> None:
    """A/A at n=60 over 80 seeds: ≤ α = 5 % stated; asserted ≤ 12.5 % (binomial 99.5 % slack)."""
    bad = sum(verdict(60, Model(), seed).verdict == "not_equivalent" for seed in range(SEEDS))
    assert bad / SEEDS <= 0.125, bad


@pytest.mark.parametrize(
    ("name", "candidate", "n", "power"),
    [
        ("different model", Model(shift=40), 60, 0.9),
        ("greedy loops", Model(loop=0.25), 60, 0.9),
        ("refusals +15 pts", Model(refusal=0.17), 120, 0.8),
        ("outputs 20 % longer", Model(mean_words=72), 120, 0.8),
    ],
)
def test_a_different_candidate_is_called_not_equivalent(
    name: str, candidate: Model, n: int, power: float
) -> None:
    hits = sum(verdict(n, candidate, seed).verdict == "not_equivalent" for seed in range(20))
    assert hits / 20 >= power, (name, hits)


def test_equivalence_is_reached_with_enough_exchanges_and_says_how_many_before() -> None:
    """Small samples say not_enough_data with a count; that count (roughly) suffices."""
    loose = {"refusal_rate": 0.06, "length_ratio": 0.08, "longest_repeat_ratio": 0.3}
    small = verdict(40, Model(), 3, loose)
    assert small.verdict == "not_enough_data" and small.needed is not None and small.needed > 0
    target = small.n + small.needed
    assert target < 400, small.reasons
    reached = sum(
        verdict(target, Model(), seed, loose).verdict == "equivalent" for seed in range(100, 110)
    )
    assert reached >= 6, (target, reached)  # 80 % power stated; 6/10 leaves binomial slack


def test_metric_fields_are_those_report_json_promises() -> None:
    eq = verdict(MIN_EXCHANGES + 10, Model(loop=0.3), seed=1)
    js = eq.to_json()
    assert {"verdict", "decided_by", "n", "needed", "metrics", "mmd"} <= set(js)
    for m in js["metrics"].values():
        assert {"candidate", "baseline", "difference", "low", "high", "margin"} <= set(m)
        assert m["low"] <= m["high"]
    assert js["mmd"]["p_value"] <= 1 and js["mmd"]["statistic"] is not None


def test_memory_is_bounded_the_tests_run_on_a_uniform_sample() -> None:
    from report.quality import MAX_PAIRS

    q = quality_of("a plain answer of a few words.", None) | {"sketch": None}
    leg = {"outcome": "completed", "quality": q}
    recs = [
        {
            "exchange_id": str(i),
            "greedy": False,
            "category": "chat",
            "legs": [
                {**leg, "role": "primary", "backend": "prod"},
                {**leg, "role": "candidate", "backend": "cand", "quality": {**q, "units": i}},
                {**leg, "role": "baseline", "backend": "base"},
            ],
        }
        for i in range(MAX_PAIRS + 2000)
    ]
    pairs = collect(read_all(recs), "cand")["all"]
    assert pairs.n == MAX_PAIRS + 2000 and len(pairs.rows) == MAX_PAIRS
    kept = [c for c, _ in pairs.values["length_ratio"]]
    assert max(kept) >= MAX_PAIRS  # later exchanges do enter the sample
