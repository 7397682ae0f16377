"""Rollout guards: is the candidate still safe to serve? (pure; the controller calls it).

Each guard looks at a rolling window of the rule's exchanges that had a candidate leg — served to
the client or mirrored — and compares the candidate with the primary legs of the same window.
The rule is a **fixed window with a one-sided confidence bound**, re-evaluated after every
exchange, chosen over a sequential test (SPRT) because every bound here is exact or
distribution-free for the statistic the operator wrote down, the window forgets an old episode
by itself, and the number of bad observations that trips a guard at a given window size is a
closed form the operator can read in ``/admin/rollout`` (``needs``). Re-evaluation means many
looks at overlapping data, so the default confidence is 0.99, not 0.95.

- ``e2e_p99_ratio`` / ``tpot_p99_ratio``: the candidate's p99 *lower* bound — the order
  statistic ``x(r)`` with the largest ``r`` such that ``P(Binomial(n, 0.99) ≥ r) ≥ confidence``,
  valid for any distribution — against ``max`` × the primary's p99 point estimate. A candidate
  that turns uniformly slower trips it after ``n − r + 1`` slow observations.
- ``error_rate_delta``: the candidate's error rate, Wilson lower bound, minus the primary's
  error rate; a failover counts as a candidate error.
- ``divergence_rate``: the candidate's greedy divergence from the primary, Wilson lower bound,
  minus the noise floor (the baseline leg's divergence rate in the window, 0 without one).
- ``tokens_per_event``: the candidate's mean tokens per event, upper bound (mean +
  z·s/√n), against ``min`` — acceptance collapse.
- ``kv_usage``: the candidate's scraped KV-cache usage, fires when its last three scrapes are all
  at or above ``max`` (sustained, not a spike).

:func:`observe` turns one finished exchange into the guards' :class:`Observation`.

A guard is ``waiting`` until it has ``min_samples`` observations on each side it compares,
``unavailable`` when a full window brought none at all (e.g. no streamed candidate leg, or no
metrics URL), ``ok`` or ``breach``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist, fmean, stdev
from typing import Literal

from core.evidence import Evidence
from core.exchange import Exchange, LegResult, Role
from core.stats import percentile_sorted, wilson
from policies.compiled import GuardSpec

GuardName = Literal[
    "e2e_p99_ratio", "tpot_p99_ratio", "error_rate_delta", "divergence_rate",
    "tokens_per_event", "kv_usage",
]  # fmt: skip
GuardStatus = Literal["ok", "breach", "waiting", "unavailable"]
KV_SUSTAINED = 3  # consecutive scrapes


@dataclass(frozen=True, slots=True)
class Observation:
    """One exchange of a rolling-out rule, as the guards see it (``None``: not observed)."""

    served_by: Role
    candidate_ok: bool | None
    primary_ok: bool | None
    candidate_e2e: float | None
    candidate_tpot: float | None
    primary_e2e: float | None
    primary_tpot: float | None
    candidate_tokens_per_event: float | None
    diverged: bool | None  # candidate vs primary, greedy and comparable
    baseline_diverged: bool | None  # baseline vs primary: the noise floor


@dataclass(frozen=True, slots=True)
class GuardState:
    name: GuardName
    status: GuardStatus
    value: float | None  # the statistic as the operator reads it
    bound: float | None  # the confidence bound the decision used
    threshold: float
    samples: int  # candidate observations
    reference_samples: int | None  # primary (or baseline) observations; None: no reference
    needs: int | None  # bad observations that would trip it at this window size
    detail: str

    def to_json(self) -> dict[str, object]:
        return {
            "guard": self.name,
            "status": self.status,
            "value": self.value,
            "bound": self.bound,
            "threshold": self.threshold,
            "samples": self.samples,
            "reference_samples": self.reference_samples,
            "needs": self.needs,
            "detail": self.detail,
        }


def z_value(confidence: float) -> float:
    return NormalDist().inv_cdf(confidence)


def wilson_lower(k: int, n: int, z: float) -> float:
    """The Wilson score interval's lower end (0 when n = 0)."""
    interval = wilson(k, n, z)
    return interval[0] if interval is not None else 0.0


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    return (
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        + k * math.log(p) + (n - k) * math.log1p(-p)
    )  # fmt: skip


@lru_cache(maxsize=4096)
def quantile_lower_rank(n: int, q: float, confidence: float) -> int:
    """The largest ``r`` (1-based) with ``P(Binomial(n, q) ≥ r) ≥ confidence``, 0 if none: then
    ``x(r)`` of a sorted sample is a distribution-free lower bound of the ``q`` quantile."""
    tail = 0.0  # P(B >= r), accumulated from r = n downwards
    for r in range(n, 0, -1):
        tail += math.exp(_log_binom_pmf(r, n, q))
        if tail >= confidence:
            return r
    return 0


def _wilson_needs(n: int, reference: float, threshold: float, z: float) -> int | None:
    """Bad observations among ``n`` that lift the Wilson lower bound over ``reference + threshold``."""
    for k in range(n + 1):
        if wilson_lower(k, n, z) - reference > threshold:
            return k
    return None


def _status(
    samples: int, reference: int | None, spec: GuardSpec, window_len: int
) -> GuardStatus | None:
    """``waiting``/``unavailable`` before a guard may decide, None when it may."""
    if samples == 0 and (reference or 0) == 0 and window_len >= spec.min_samples:
        return "unavailable"
    if samples < spec.min_samples or (reference is not None and reference < spec.min_samples):
        return "waiting"
    return None


def _ratio_guard(
    name: GuardName,
    candidate: list[float],
    primary: list[float],
    limit: float,
    spec: GuardSpec,
    window_len: int,
) -> GuardState:
    candidate.sort()
    primary.sort()
    early = _status(len(candidate), len(primary), spec, window_len)
    if early is not None:  # min_samples >= 5: past here both sides have observations
        return GuardState(name, early, None, None, limit, len(candidate), len(primary), None,
                          "p99 candidate ÷ p99 primary")  # fmt: skip
    reference = percentile_sorted(primary, 99.0) or 0.0
    value = (percentile_sorted(candidate, 99.0) or 0.0) / reference if reference > 0 else math.inf
    r = quantile_lower_rank(len(candidate), 0.99, spec.confidence)
    lower = candidate[r - 1] if r else None
    bound = lower / reference if lower is not None and reference > 0 else None
    breach = bound is not None and bound > limit
    needs = len(candidate) - r + 1 if r else None
    return GuardState(
        name, "breach" if breach else "ok", value, bound, limit, len(candidate), len(primary),
        needs, f"lower bound of the candidate's p99 (order statistic {r} of {len(candidate)}) ÷ primary p99",
    )  # fmt: skip


def _rate_guard(
    name: GuardName,
    bad: int,
    n: int,
    reference_rate: float,
    reference_n: int | None,
    limit: float,
    spec: GuardSpec,
    window_len: int,
    what: str,
) -> GuardState:
    early = _status(n, reference_n, spec, window_len)
    if early is not None:
        return GuardState(name, early, None, None, limit, n, reference_n, None, what)
    z = z_value(spec.confidence)
    value = bad / n - reference_rate
    bound = wilson_lower(bad, n, z) - reference_rate
    return GuardState(
        name, "breach" if bound > limit else "ok", value, bound, limit, n, reference_n,
        _wilson_needs(n, reference_rate, limit, z), what,
    )  # fmt: skip


def evaluate(
    spec: GuardSpec, window: Sequence[Observation], kv_recent: Sequence[float] = ()
) -> list[GuardState]:
    """Every enabled guard's state over ``window`` (see the module doc)."""
    out: list[GuardState] = []
    size = len(window)
    for name, limit, c_attr, p_attr in (
        ("e2e_p99_ratio", spec.e2e_p99_ratio_max, "candidate_e2e", "primary_e2e"),
        ("tpot_p99_ratio", spec.tpot_p99_ratio_max, "candidate_tpot", "primary_tpot"),
    ):
        if limit is None:
            continue
        cand = [v for o in window if (v := getattr(o, c_attr)) is not None]
        prim = [v for o in window if (v := getattr(o, p_attr)) is not None]
        out.append(_ratio_guard(name, cand, prim, limit, spec, size))  # type: ignore[arg-type]
    if spec.error_rate_delta_max is not None:
        cand_ok = [o.candidate_ok for o in window if o.candidate_ok is not None]
        prim_ok = [o.primary_ok for o in window if o.primary_ok is not None]
        prim_rate = (prim_ok.count(False) / len(prim_ok)) if prim_ok else 0.0
        out.append(_rate_guard(
            "error_rate_delta", cand_ok.count(False), len(cand_ok), prim_rate, len(prim_ok),
            spec.error_rate_delta_max, spec, size,
            "candidate error rate (Wilson lower bound) − primary error rate",
        ))  # fmt: skip
    if spec.divergence_rate_max is not None:
        div = [o.diverged for o in window if o.diverged is not None]
        base = [o.baseline_diverged for o in window if o.baseline_diverged is not None]
        floor = base.count(True) / len(base) if base else 0.0
        out.append(_rate_guard(
            "divergence_rate", div.count(True), len(div), floor, None,
            spec.divergence_rate_max, spec, size,
            f"candidate divergence (Wilson lower bound) − noise floor {floor:.1%} "
            f"({len(base)} baseline comparisons)",
        ))  # fmt: skip
    if spec.tokens_per_event_min is not None:
        tpe = [v for o in window if (v := o.candidate_tokens_per_event) is not None]
        early = _status(len(tpe), None, spec, size)
        if early is not None:
            out.append(GuardState("tokens_per_event", early, None, None, spec.tokens_per_event_min,
                                  len(tpe), None, None, "mean tokens per event (upper bound)"))  # fmt: skip
        else:
            mean = fmean(tpe)
            upper = mean + z_value(spec.confidence) * stdev(tpe) / math.sqrt(len(tpe))
            out.append(GuardState(
                "tokens_per_event", "breach" if upper < spec.tokens_per_event_min else "ok",
                mean, upper, spec.tokens_per_event_min, len(tpe), None, None,
                "mean tokens per event of the candidate's streamed legs, upper bound",
            ))  # fmt: skip
    if spec.kv_usage_max is not None:
        recent = list(kv_recent)[-KV_SUSTAINED:]
        if not recent:
            out.append(GuardState("kv_usage", "unavailable", None, None, spec.kv_usage_max, 0, None,
                                  None, "no KV-cache gauge scraped from the candidate"))  # fmt: skip
        else:
            sustained = len(recent) == KV_SUSTAINED and min(recent) >= spec.kv_usage_max
            out.append(GuardState(
                "kv_usage", "breach" if sustained else "ok", recent[-1], min(recent),
                spec.kv_usage_max, len(recent), None, KV_SUSTAINED,
                f"lowest of the last {KV_SUSTAINED} scrapes of the candidate's KV-cache usage",
            ))  # fmt: skip
    return out


def _leg(exchange: Exchange, role: str, backend: str | None = None) -> LegResult | None:
    for leg in exchange.legs:
        if leg.role == role and (backend is None or leg.backend == backend):
            return leg
    return None


def _ok(leg: LegResult) -> bool:
    return (
        leg.outcome == "completed"
        and (leg.status is None or leg.status < 400)
        and leg.error_type is None
    )


def observe(evidence: Evidence, candidate_backend: str) -> Observation | None:
    """The guards' view of one exchange; None when it had no candidate leg at all."""
    exchange = evidence.exchange
    cand = _leg(exchange, "candidate", candidate_backend)
    if cand is None:
        return None
    prim = _leg(exchange, "primary")
    cand_rec = cand.recording if _ok(cand) else None
    prim_rec = prim.recording if prim is not None and _ok(prim) else None
    tpe = None
    if (
        cand_rec is not None
        and cand_rec.streaming
        and cand_rec.tokens_source in ("usage", "continuous_usage", "logprobs")
    ):
        tpe = cand_rec.timings.tokens_per_event
    diverged = baseline = None
    for c in evidence.comparisons:
        if not c.comparable or not c.greedy or c.exact_match is None:
            continue
        pair = {c.a, c.b}
        if pair == {"primary", "candidate"} and candidate_backend in (c.a_backend, c.b_backend):
            diverged = not c.exact_match
        elif pair == {"primary", "baseline"}:
            baseline = not c.exact_match
    return Observation(
        served_by=exchange.served_by,
        candidate_ok=_ok(cand)
        if cand.outcome not in ("cancelled", "deadline", "client_disconnected")
        else None,
        primary_ok=_ok(prim)
        if prim is not None and prim.outcome not in ("cancelled", "deadline", "client_disconnected")
        else None,
        candidate_e2e=cand_rec.timings.e2e_s if cand_rec is not None else None,
        candidate_tpot=cand_rec.timings.tpot_s if cand_rec is not None else None,
        primary_e2e=prim_rec.timings.e2e_s if prim_rec is not None else None,
        primary_tpot=prim_rec.timings.tpot_s if prim_rec is not None else None,
        candidate_tokens_per_event=tpe,
        diverged=diverged,
        baseline_diverged=baseline,
    )
