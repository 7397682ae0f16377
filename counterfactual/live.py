"""The live check: a live candidate running a scored configuration, predicted against measured.

For every candidate leg whose backend runs a configuration the replay scores, on the same
requests: the replay on production's output (**predicted**) against its engine's per-request
counts (**measured**), split greedy / sampled, and the **engine check** (the configuration
replayed on the candidate's *own* generated ids against what it reported).

**Drift.** Greedy agreement is exact only where the candidate answered production's very text.
Under batching it need not: engines are not batch-invariant, and on real vLLM 20 of 23 greedy
answers drifted from production's after ~35 characters with back-to-back traffic. So the greedy
rule compares only the greedy requests whose candidate output equals production's (by ids where
the token tap kept the candidate's, else by the output's hash), says how many drifted, and lets
the engine check judge the rest. **Adaptive verification** (vLLM's ``enable_adaptive_verification``:
each step verifies a budget chosen per request, at most the configured depth): the fixed-depth
replay is then an upper bound, so the check flags only a measured acceptance above it. A baseline leg (a second plain server) that drifted on greedy
requests too says the drift is the engines', not the replay's: the note says so, and drift never
raises the flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.stats import RatioStats, paired_ratio_test
from counterfactual.grid import Config, config_json
from counterfactual.replay import Replay
from records.reader import Leg, Record

__all__ = [
    "SAMPLED_ALPHA",
    "LiveCheck",
    "agrees",
    "baseline_agrees",
    "compare",
    "interval_json",
    "live_json",
]


@dataclass(slots=True)
class LiveCheck:
    """A live candidate running a scored configuration: predicted vs measured, same requests."""

    backend: str
    config: Config
    predicted: RatioStats = field(default_factory=RatioStats)
    measured: RatioStats = field(default_factory=RatioStats)
    # The same split by greedy / sampled: exact per request on greedy traffic (the candidate's
    # output is production's), equal only in expectation on sampled traffic.
    by_kind: dict[str, tuple[RatioStats, RatioStats]] = field(default_factory=dict)
    # Sampled requests one by one — (predicted drafts, accepted, measured drafts, accepted) — for
    # the paired test that judges them (see :func:`_compare`).
    sampled_pairs: list[tuple[float, float, float, float]] = field(default_factory=list)
    # The engine check: the configuration replayed on the candidate's *own* generated ids
    # against what it reported — exact per request when the ids are there, but for the last
    # pass: vLLM drafts whole and counts acceptances past max_tokens (docs/counterfactual.md).
    engine: tuple[RatioStats, RatioStats] = field(
        default_factory=lambda: (RatioStats(), RatioStats())
    )

    # Greedy requests whose candidate output differed from production's (not compared), and
    # the baseline's own greedy divergence on the same requests: (greedy with a baseline, drifted).
    drifted: int = 0
    baseline: list[int] = field(default_factory=lambda: [0, 0])
    # The backend verifies an adaptive budget: the configured depth is a cap, the replay a bound.
    upper_bound: bool = False

    def add(
        self,
        greedy: bool,
        predicted: Replay,
        drafts: float,
        accepted: float,
        agrees: bool = True,
        baseline_agrees: bool | None = None,
    ) -> None:
        """One request. ``agrees``: the candidate's output is production's; ``baseline_agrees``:
        the baseline's is (None: no baseline leg)."""
        if greedy and baseline_agrees is not None:
            self.baseline[0] += 1
            self.baseline[1] += not baseline_agrees
        if greedy and not agrees:
            # The replay ran on production's text, the candidate decoded another: no pairing.
            self.drifted += 1
            return
        pair = self.by_kind.setdefault(
            "greedy" if greedy else "sampled", (RatioStats(), RatioStats())
        )
        for target in (self.predicted, pair[0]):
            target.add(predicted.drafts, predicted.accepted)
        for target in (self.measured, pair[1]):
            target.add(drafts, accepted)
        if not greedy:
            self.sampled_pairs.append((predicted.drafts, predicted.accepted, drafts, accepted))


def _same(
    a: Leg | None, ids: list[int] | None, output: list[int], primary: Leg | None
) -> bool | None:
    """Whether a leg's output is production's: by ids where kept, else by the output's hash."""
    if ids is not None:
        return list(ids) == list(output)
    if a is None or primary is None:
        return None
    mine, theirs = a.output_sha256, primary.output_sha256
    return None if mine is None or theirs is None else mine == theirs


def agrees(
    record: Record,
    leg: Leg,
    own: list[int] | None,
    output: list[int],
    own_ids: Mapping[str, list[int]],
) -> bool:
    """The candidate answered production's output (unknown: assumed, as before drift was told)."""
    same = _same(leg, own, output, record.primary)
    return True if same is None else same


def baseline_agrees(
    record: Record, output: list[int], own_ids: Mapping[str, list[int]]
) -> bool | None:
    base = record.baseline
    if base is None or not base.ok:
        return None
    return _same(base, own_ids.get(base.backend or "") or None, output, record.primary)


def live_json(check: LiveCheck) -> dict[str, Any]:
    bound = check.upper_bound
    out = {
        "backend": check.backend,
        **config_json(check.config),
        **compare(check.predicted, check.measured, upper_bound=bound),
        "adaptive_verification": bound,
    }
    for kind in ("greedy", "sampled"):
        pair = check.by_kind.get(kind)
        out[kind] = (
            None
            if pair is None
            else compare(
                *pair,
                paired=check.sampled_pairs if kind == "sampled" and not bound else None,
                upper_bound=bound,
            )
        )
    # The pooled figures mix exact (greedy) and in-expectation (sampled) agreement: the flag is
    # each kind's own rule's.
    flagged = [
        kind for kind in ("greedy", "sampled") if out[kind] is not None and out[kind]["flag"]
    ]
    out["flag"] = bool(flagged)
    out["note"] = (
        f"{' and '.join(flagged)} requests: " + " / ".join(out[k]["note"] for k in flagged)
        if flagged
        else "predicted and measured agree on every kind of request"
    )
    out["engine_check"] = compare(*check.engine, upper_bound=bound) if check.engine[0].n else None
    out["drift"] = _drift_json(check)
    sampled = out["sampled"]
    engine = out["engine_check"]
    if engine is not None and not engine["flag"] and sampled is not None and sampled["flag"]:
        # Exact on the candidate's own output: what differs is the answers, not the replay.
        more = (sampled["relative_gap"] or 0.0) < 0
        out["note"] = sampled["note"] = (
            f"sampled requests: the candidate's own answers repeated {'more' if more else 'less'}"
            f" than production's (p = {sampled['p_value']:.3g}); the engine check passed (the "
            "replay is exact on the candidate's own output), so the difference is in what it "
            "answered — see the quality section"
        )
    if out["engine_check"] is not None and out["engine_check"]["flag"]:
        out["flag"] = True
        out["note"] = (
            "replayed on the candidate's own output, the configuration predicts acceptance its "
            "engine did not report: the engine does not run what it declares"
        )
    return out


def _drift_json(check: LiveCheck) -> dict[str, Any]:
    compared = check.by_kind.get("greedy")
    n = compared[0].n if compared is not None else 0
    with_base, base_drifted = check.baseline
    note = (
        "every greedy answer was production's"
        if not check.drifted
        else f"{check.drifted} of {n + check.drifted} greedy answers drifted from production's; "
        "the greedy comparison holds the other "
        f"{n}, and the engine check (the replay on the candidate's own ids) holds every one"
    )
    if check.drifted and base_drifted:
        note += (
            f"; the baseline's own greedy answers drifted on {base_drifted} of {with_base}: "
            "the engines are not batch-invariant, so the drift is theirs, not the replay's"
        )
    return {
        "greedy_compared": n,
        "greedy_drifted": check.drifted,
        "baseline_greedy": with_base,
        "baseline_drifted": base_drifted,
        "note": note,
    }


def interval_json(stats: RatioStats, offset: float = 0.0) -> dict[str, Any]:
    est, ci = stats.estimate(), stats.interval()
    return {
        "estimate": None if est is None else est + offset,
        "low": None if ci is None else ci[0] + offset,
        "high": None if ci is None else ci[1] + offset,
        "n": stats.n,
    }


SAMPLED_ALPHA = 0.01  # the sampled requests' paired test's false-alarm rate


def compare(
    predicted_stats: RatioStats,
    measured_stats: RatioStats,
    paired: list[tuple[float, float, float, float]] | None = None,
    *,
    upper_bound: bool = False,
) -> dict[str, Any]:
    """Predicted against measured. Exact per request (greedy, the engine check): the flag is two
    95 % intervals that do not overlap. Sampled (``paired``): the candidate answered other draws
    than production's, so agreement holds only in expectation and per-request acceptance is
    mostly zero with a few large values — a delta-method interval there can have no width at all
    (48 requests, none accepted anything). The flag is then a paired sign-flip permutation test
    (:func:`core.stats.paired_ratio_test`) at ``SAMPLED_ALPHA``. ``upper_bound`` (adaptive
    verification): the prediction is a cap, flagged only when measured lies wholly above it."""
    predicted = interval_json(predicted_stats, 1.0)
    measured = interval_json(measured_stats, 1.0)
    gap = None
    if predicted["estimate"] is not None and measured["estimate"] is not None:
        gap = predicted["estimate"] / measured["estimate"] - 1.0
    out: dict[str, Any] = {
        "predicted_mean_acceptance_length": predicted,
        "measured_mean_acceptance_length": measured,
        "relative_gap": gap,
    }
    if paired is not None:
        p = paired_ratio_test(paired)
        flag = p is not None and p < SAMPLED_ALPHA
        out["p_value"] = p
        out["flag"] = flag
        out["note"] = (
            f"predicted and measured differ (paired permutation test, p = {p:.3g} < "
            f"{SAMPLED_ALPHA}): the replay is wrong for this traffic, or the engine does not run "
            "what it declares"
            if flag and p is not None
            else "predicted and measured agree in expectation (paired permutation test, p "
            + ("n/a" if p is None else f"= {p:.3g}")
            + ")"
        )
        return out
    known = None not in (predicted["low"], predicted["high"], measured["low"], measured["high"])
    if upper_bound:
        above = known and predicted["high"] < measured["low"]
        out["flag"] = bool(above)
        out["note"] = (
            "measured acceptance lies above the fixed-depth replay, which bounds an adaptive "
            "verification budget: the engine does not run what it declares"
            if above
            else "adaptive verification: the fixed-depth replay is an upper bound, and measured "
            "acceptance is within it"
        )
        return out
    disjoint = (
        None
        if not known
        else predicted["high"] < measured["low"] or measured["high"] < predicted["low"]
    )
    out["flag"] = bool(disjoint)
    out["note"] = (
        "predicted and measured intervals do not overlap: the replay is wrong for this "
        "traffic, or the engine does not run what it declares"
        if disjoint
        else "predicted and measured agree within their intervals"
    )
    return out
