"""The guards' anytime-valid rules, measured: how often an identical candidate is ever rolled back
over a long canary, and how many exchanges each kind of regression takes to roll back.

Pure simulation of the :class:`~rollout.guards.Observation` stream the controller feeds the
guards — no sockets, seeded, numpy for the draws. One exchange per step, a canary where every
exchange has a candidate, a primary and a baseline leg:

- latency: a load factor shared by all legs of an exchange (a geometric random walk, σ = 0.02 per
  exchange) × independent per-leg noise: e2e ``LogNormal(0, 0.3)`` (p99 ≈ 2 × median), TPOT
  ``0.02 × LogNormal(0, 0.2)``;
- errors: 1 % per leg, independent (a failed leg has no latency and no output);
- half the exchanges greedy: candidate and baseline each diverge from the primary with
  probability 2 %. The other half sampled: the request is about one of :data:`TOPICS` topics,
  each with its own word law (a Zipf(1.1) law over a seeded 300-word vocabulary, permuted per
  topic); the primary's, the baseline's and the candidate's outputs are independent draws of a
  30–80-word text from it, sketched by :func:`evidence.quality.sketch` (the real feature map),
  with the length and repetition of :func:`evidence.quality.repetition_stats`;
- the candidate's tokens per event: ``Uniform(1.8, 3.2)``.

An **identical candidate** is that stream unchanged, for every guard at its default threshold.
Each **regression** starts at exchange :data:`CHANGE` and is measured by the guards it concerns
(run alone, at the α the full bank gives each of its six statistical guards: another guard can
only roll back sooner): 2× and 5× slower (e2e and TPOT), errors 1 % → 10 % and → 30 %, greedy
divergence 2 % → 20 %, acceptance collapse (tokens per event 1.0), and sampled outputs from
another law — a share of every topic's law moved to one common law (what is said across requests
changes: the MMD term sees it), or another model (every topic's law another permutation: across
requests the word statistics stay the same, only the answer to each request changes — the
similarity-to-production term sees it). The baseline and the primary keep drawing from the
target. The delay is counted in exchanges from the change to the rollback.

``python -m tests.rollout.test_guards_anytime [SEEDS NULL_SEEDS NULL_EXCHANGES]`` runs the long
version and prints the table in docs/rollout.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import pytest

from core.evidence import LegQuality
from evidence.quality import repetition_stats, sketch
from policies.compiled import GuardSpec
from rollout.guards import GuardBank, GuardName, Observation

CHANGE = 500  # exchanges of a healthy candidate before a regression starts
HORIZON = 2_000  # exchanges after the change before a regression counts as missed
TOPICS = 40  # a sampled request is about one of these; each has its own word law
PER_TOPIC = 15  # sketched texts per topic and model


@cache
def vocabulary() -> tuple[str, ...]:
    rng = np.random.default_rng(12345)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "pa", "gu", "te", "ri"]
    words = {"".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(3000)}
    return tuple(sorted(words)[:300])


@cache
def texts(model: str) -> tuple[tuple[LegQuality, ...], ...]:
    """:data:`PER_TOPIC` sketched texts per topic, drawn from ``model``'s word law for it:
    ``target`` (production: the primary, the baseline and an identical candidate), ``shift-W``
    (a share W of every topic's law moved to one common law), ``other`` (another model: each
    topic's law another permutation of the words)."""
    words = vocabulary()
    n = len(words)
    zipf = 1.0 / np.arange(1, n + 1) ** 1.1
    zipf /= zipf.sum()
    common = zipf[np.random.default_rng(7).permutation(n)]
    shift = float(model.removeprefix("shift-")) if model.startswith("shift-") else 0.0
    # ``temp-T``: the same model sampled at temperature T where production asks 0.7 (its
    # word law is the T = 0.7 one: p_T ∝ p_0.7^(0.7 / T))
    temperature = float(model.removeprefix("temp-")) if model.startswith("temp-") else 0.7
    offset = 1_000 if model == "other" else 0
    rng = np.random.default_rng(sum(model.encode()))
    pools = []
    for topic in range(TOPICS):
        law = zipf[np.random.default_rng(100 + offset + topic).permutation(n)]
        law = (1.0 - shift) * law + shift * common
        if temperature != 0.7:
            law = law ** (0.7 / temperature)
            law /= law.sum()
        pool = []
        for _ in range(PER_TOPIC):
            text = " ".join(words[i] for i in rng.choice(n, size=rng.integers(30, 80), p=law))
            distinct, repetition, longest = repetition_stats(text)
            pool.append(
                LegQuality(
                    len(text.split()),
                    False,
                    distinct,
                    repetition,
                    longest,
                    False,
                    None,
                    0,
                    None,
                    0,
                    None,
                    sketch(text),
                )
            )
        pools.append(tuple(pool))
    return tuple(pools)


@dataclass(frozen=True)
class Change:
    name: str
    guards: tuple[GuardName, ...]
    slower: float = 1.0
    errors: float | None = None
    divergence: float | None = None
    collapse: bool = False
    outputs: str = "target"  # the candidate's sampled outputs after the change (texts())
    bound: int = 0  # asserted: the 90th percentile of the delay is at most this


LATENCY: tuple[GuardName, ...] = ("e2e_p99_ratio", "tpot_p99_ratio")
SAMPLED: tuple[GuardName, ...] = ("sampled_divergence",)
CHANGES = (
    Change("2× slower (e2e, TPOT)", LATENCY, slower=2.0, bound=400),
    Change("5× slower", LATENCY, slower=5.0, bound=25),
    Change("errors 1 % → 10 %", ("error_rate_delta",), errors=0.10, bound=1000),
    Change("errors 1 % → 30 %", ("error_rate_delta",), errors=0.30, bound=120),
    Change("greedy divergence 2 % → 20 %", ("divergence_rate",), divergence=0.20, bound=1000),
    Change("acceptance collapse (1 token per event)", ("tokens_per_event",), collapse=True,
           bound=110),
    Change("sampled: half of every topic's word law moved to one law", SAMPLED,
           outputs="shift-0.5", bound=200),
    Change("sampled: 30 % of every topic's word law moved", SAMPLED, outputs="shift-0.3",
           bound=400),
    Change("sampled: another model, the same word statistics across requests", SAMPLED,
           outputs="other", bound=250),
)  # fmt: skip


def stream(seed: int, n: int, change: Change | None = None) -> list[Observation]:
    """``n`` observations of the model in the module doc; ``change`` from :data:`CHANGE` on."""
    rng = np.random.default_rng(seed)
    after = np.arange(n) >= (CHANGE if change is not None else n)
    load = np.exp(np.cumsum(rng.normal(0.0, 0.02, n)))
    slower = np.where(after, change.slower if change else 1.0, 1.0)
    c_e2e = load * rng.lognormal(0.0, 0.3, n) * slower
    p_e2e = load * rng.lognormal(0.0, 0.3, n)
    c_tpot = 0.02 * load * rng.lognormal(0.0, 0.2, n) * slower
    p_tpot = 0.02 * load * rng.lognormal(0.0, 0.2, n)
    c_err_p = np.where(after, change.errors or 0.01, 0.01) if change else np.full(n, 0.01)
    c_err = rng.random(n) < c_err_p
    p_err = rng.random(n) < 0.01
    greedy = rng.random(n) < 0.5
    div_p = np.where(after, change.divergence or 0.02, 0.02) if change else np.full(n, 0.02)
    c_div = rng.random(n) < div_p
    b_div = rng.random(n) < 0.02
    tpe = rng.uniform(1.8, 3.2, n)
    if change is not None and change.collapse:
        tpe = np.where(after, 1.0, tpe)
    same = texts("target")
    changed = texts(change.outputs) if change is not None else same
    topic = rng.integers(0, TOPICS, n).tolist()
    c_pick, b_pick, p_pick = (rng.integers(0, PER_TOPIC, n).tolist() for _ in range(3))
    # Python scalars in bulk (numpy scalars one by one cost more than the guards)
    ce, pe, ct, pt, tp = (a.tolist() for a in (c_e2e, p_e2e, c_tpot, p_tpot, tpe))
    c_ok, p_ok = (~c_err).tolist(), (~p_err).tolist()
    cd, bd, gr, af = c_div.tolist(), b_div.tolist(), greedy.tolist(), after.tolist()
    out = []
    for t in range(n):
        cok, pok, g, k = c_ok[t], p_ok[t], gr[t], topic[t]
        sampled = not g
        out.append(
            Observation(
                "primary", cok, pok,
                ce[t] if cok else None, ct[t] if cok else None,
                pe[t] if pok else None, pt[t] if pok else None,
                tp[t] if cok else None,
                cd[t] if g and cok and pok else None,
                bd[t] if g and pok else None,
                sampled,
                (changed if af[t] else same)[k][c_pick[t]] if sampled and cok else None,
                same[k][b_pick[t]] if sampled else None,
                same[k][p_pick[t]] if sampled and pok else None,
            )
        )  # fmt: skip
    return out


def rolled_back_at(
    spec: GuardSpec, observations: Sequence[Observation], only: Sequence[GuardName] = ()
) -> tuple[int, GuardName] | None:
    """The exchange whose observation first breached a guard (of ``only``, when given)."""
    bank = GuardBank(spec)
    if only:
        bank.guards = [g for g in bank.guards if g.name in only]
    for t, o in enumerate(observations):
        bank.update(o)
        for g in bank.guards:  # GuardBank.breached(), without a call per guard
            if g.rejects():
                return t, g.name
    return None


def false_rollbacks(spec: GuardSpec, seeds: int, n: int) -> tuple[int, dict[str, int]]:
    by: dict[str, int] = {}
    for seed in range(seeds):
        hit = rolled_back_at(spec, stream(seed, n))
        if hit is not None:
            by[hit[1]] = by.get(hit[1], 0) + 1
    return sum(by.values()), by


DEFAULTS = GuardSpec()


def delays(change: Change, seeds: int, spec: GuardSpec = DEFAULTS) -> np.ndarray:
    """Exchanges from the change to the rollback, per seed (-1: before the change; a miss counts
    as :data:`HORIZON`)."""
    out = []
    for seed in range(seeds):
        hit = rolled_back_at(spec, stream(10_000 + seed, CHANGE + HORIZON, change), change.guards)
        out.append(-1 if hit is not None and hit[0] < CHANGE else
                   HORIZON if hit is None else hit[0] - CHANGE)  # fmt: skip
    return np.array(out)


def binomial_upper(n: int, p: float, tail: float = 1e-3) -> int:
    """The smallest k with P(Binomial(n, p) > k) ≤ ``tail``: the slack the assertions allow."""
    from math import comb

    total = 0.0
    for k in range(n + 1):
        total += comb(n, k) * p**k * (1 - p) ** (n - k)
        if 1.0 - total <= tail:
            return k
    return n


def test_an_identical_candidate_is_rarely_ever_rolled_back_over_a_long_canary() -> None:
    """200 canaries of 2,000 exchanges each, every guard on, at confidence 0.9 (α = 0.1, so that
    the bound is tight enough to mean something at 200 seeds): the number ever rolled back is at
    most what Binomial(200, 0.1) exceeds with probability 10⁻³."""
    spec = GuardSpec(confidence=0.9)
    count, by = false_rollbacks(spec, 200, 2_000)
    assert count <= binomial_upper(200, 0.1), (count, by)
    assert count <= 4, (count, by)  # measured: 0 (the guards' nulls hold with room to spare)


def test_a_candidate_exactly_at_its_thresholds_is_rarely_ever_rolled_back() -> None:
    """The nulls' edge, where a guard's statistic has mean exactly 0: a candidate 1.5× slower
    than the primary in distribution (its p99 exactly 1.5× the primary's), one with an error rate
    exactly 2 points above the primary's, one whose tokens per event average exactly ``min``
    (each guard alone at α = 0.1; 200 canaries of 600 exchanges each)."""
    off = GuardSpec(
        confidence=0.9, e2e_p99_ratio_max=None, tpot_p99_ratio_max=None,
        error_rate_delta_max=None, divergence_rate_max=None, tokens_per_event_min=None,
        sampled_divergence_max=None,
    )  # fmt: skip
    specs: dict[GuardName, GuardSpec] = {
        "e2e_p99_ratio": replace(off, e2e_p99_ratio_max=1.5),
        "error_rate_delta": replace(off, error_rate_delta_max=0.02),
        "tokens_per_event": replace(off, tokens_per_event_min=1.2),
    }
    edge = dict.fromkeys(specs, 0)
    n = 600
    for seed in range(200):
        rng = np.random.default_rng(seed)
        c_ok = rng.random(n) >= 0.03
        p_ok = rng.random(n) >= 0.01
        c_e2e = 1.5 * rng.lognormal(0.0, 0.3, n)
        p_e2e = rng.lognormal(0.0, 0.3, n)
        tpe = np.where(rng.random(n) < 0.5, 1.0, 1.4)  # mean 1.2, all within the cap
        observations = [
            Observation("primary", bool(c_ok[t]), bool(p_ok[t]), float(c_e2e[t]), None,
                        float(p_e2e[t]), None, float(tpe[t]), None, None)
            for t in range(n)
        ]  # fmt: skip
        for name, spec in specs.items():
            if rolled_back_at(spec, observations) is not None:
                edge[name] += 1
    assert all(k <= binomial_upper(200, 0.1) for k in edge.values()), edge


@pytest.mark.parametrize("change", CHANGES, ids=[c.name for c in CHANGES])
def test_a_regression_is_rolled_back_within_its_stated_delay(change: Change) -> None:
    d = delays(change, 40)
    early = int((d < 0).sum())
    assert early <= 1, (change.name, early)  # a rollback before the change is a false one
    assert np.percentile(d[d >= 0], 90) <= change.bound, (change.name, sorted(d))


def table(seeds: int, null_seeds: int, null_n: int) -> str:
    """The measurements as docs/rollout.md shows them (the long run)."""
    lines = []
    for confidence in (0.99, 0.9):
        started = time.perf_counter()
        count, by = false_rollbacks(GuardSpec(confidence=confidence), null_seeds, null_n)
        lines.append(
            f"| identical candidate, {null_n:,} exchanges, confidence {confidence} | "
            f"{count}/{null_seeds} rolled back ({by or 'none'}) | α = {1 - confidence:g} | "
            f"{time.perf_counter() - started:.0f} s |"
        )
    for change in CHANGES:
        d = delays(change, seeds)
        ok = d[d >= 0]
        missed = int((d >= HORIZON).sum())
        lines.append(
            f"| {change.name} | median {np.median(ok):.0f}, p90 {np.percentile(ok, 90):.0f} "
            f"exchanges | {missed}/{seeds} missed in {HORIZON:,}, {int((d < 0).sum())} early | "
            f"{', '.join(change.guards)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print(table(seeds, null_seeds=int(sys.argv[2]) if len(sys.argv) > 2 else 500,
                null_n=int(sys.argv[3]) if len(sys.argv) > 3 else 5_000))  # fmt: skip
