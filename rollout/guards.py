"""Rollout guards: is the candidate still safe to serve? (pure; the controller calls it).

Every exchange of a rolling-out rule that had a candidate leg — served to the client or
mirrored — becomes one :class:`Observation` (:func:`observe`). A :class:`GuardBank` feeds each
observation to every enabled guard and is asked, after each one, whether a guard has breached.
Because it is asked after *every* exchange for as long as the rule rolls out, each statistical
guard is an **anytime-valid** test (:mod:`rollout.sequential`): a betting e-process — restarted
when a healthy stretch has handicapped it or when its evidence is older than ``window`` and no
longer growing, the ``j``-th one held to ``1/α_j`` with ``α_j = α_g / (j (j + 1))`` — breach at
the first e-value that reaches its threshold. ``α = 1 − confidence`` is split evenly over the
enabled statistical guards (``α_g = α / K``), so

    P(a candidate within every threshold is ever rolled back by a guard) ≤ 1 − confidence

over an arbitrarily long canary, with every exchange looked at — provided, for each guard, the
null inequality below holds for every observation (given the past) while the candidate is within
that guard's threshold. ``window`` is the forgetting horizon: evidence older than ``window`` of
the guard's observations that has stopped growing is dropped. ``min_samples``: a guard does not
breach before it has tested that many observations (it is ``waiting``), which only removes
rejections.

Each guard's ``x`` (positive: evidence against the candidate), its null and its bound:

- ``e2e_p99_ratio`` / ``tpot_p99_ratio`` (``max`` = r): on each pair — the candidate's and the
  primary's latency of one exchange when it has both (a canary: nearly always), else a value
  with the newest one of the other side still waiting for a partner —
  ``x = 1{c > r·ρ} − 1{p > ρ}``, ``ρ`` the primary's p99 over the previous ``window`` pairs.
  Null: ``P(c > r·ρ) ≤ P(p > ρ)`` at the thresholds ``ρ`` used — at ``ρ`` = the primary's p99
  exactly this is "the candidate's p99 ≤ r × the primary's". It holds for any candidate whose
  latency over ``r`` is no heavier-tailed than the primary's, in particular an identical one or
  one up to ``r`` times slower, and on pairs from one exchange under any load pattern (both legs
  see the same load); a pair from two exchanges assumes the latencies' law did not change between
  them. ``x ≥ −1``. (In ``live`` pairs come only from the ``reference_ratio`` share mirrored to
  the primary: the comparative guards are that much slower there.)
- ``error_rate_delta`` (``max`` = δ): ``x = err_c − err_p − δ`` on pairs as above (a failover
  counts as a candidate error). Null: the candidate's error probability exceeds the primary's
  by at most δ. ``x ≥ −1 − δ``.
- ``divergence_rate`` (``max`` = δ): on greedy comparable exchanges, ``x = div_c − div_b − δ``
  where the exchange also has a baseline comparison (its noise floor), else ``x = div_c − δ``
  (floor 0). Null: the candidate diverges from the primary at most δ more often than a plain
  copy does on the same exchanges. ``x ≥ −1 − δ``.
- ``tokens_per_event`` (``min`` = m): ``x = m − min(tpe, 2m)`` per streamed candidate leg.
  Null: the mean of the per-request tokens per event, each counted up to ``2m``, is ≥ m. (A mean
  over an unbounded range cannot be tested at all — one request that arrives in one event can
  hide any collapse — so each request counts at most ``2m``; that changes nothing unless
  collapsed requests are mixed with ones above ``2m``.) ``x ≥ −m``.
- ``sampled_divergence`` (``max`` = δ): on consecutive disjoint pairs ``(i, j)`` of sampled
  exchanges with a completed candidate leg (served or mirrored) and a completed reference — the
  baseline leg's output where the exchange has one, else the primary's own answer to the same
  request (mirrored behind a canary answer, or at ``reference_ratio`` at ``live``) — both
  sketched, ``b`` the reference and ``k`` the dot product of sketches (a string kernel), mixed
  (weights 2:3:1:1:1:1:1:1:1):

  - ``h = k(cᵢ,cⱼ) + k(bᵢ,bⱼ) − k(cᵢ,bⱼ) − k(bᵢ,cⱼ)``, whose mean is the MMD² between the
    candidate's and the baseline's output distributions averaged over prompts (``|h| ≤ 4``) —
    a shift in what is said across requests;
  - ``g = k(b, p) − k(c, p)`` on each exchange that also has the primary's output ``p`` (mean of
    the pair's): the candidate is farther from (or closer to) production's answer to the same
    request than the plain copy is (``|g| ≤ 2``). The primary is production, a third draw from
    the same distribution, so ``c`` and ``b`` stay exchangeable given it — and this sees a
    per-request change that averages out over prompts (another model with the same word
    statistics), which ``h`` cannot;
  - the normalised length difference ``(u_c − u_b)/(u_c + u_b)``, the repetition difference and
    the distinct-bigram difference, each two-sided. (``g`` needs a baseline leg: with the primary
    as the reference there is no third draw, and only what is said across requests is compared.)

  With ``δ = 0`` (default) the null is **exchangeability**: the candidate's and the baseline's
  outputs for one request are two independent draws from one distribution, what a lossless
  candidate promises. Swapping them flips the sign of every statistic (of ``h`` by swapping in
  one exchange, of the others by swapping in both), so each is symmetric about 0 and its
  clipped, self-scaled value ``clip(s / scale, −1, 1)`` (the scale from past pairs) has mean 0 —
  full-strength bets, staked only on a recent mean one standard error above 0 (the null sits at
  0). With ``δ > 0`` the null is ``MMD² ≤ δ`` and every other statistic's mean within ``±√δ``
  (the MMD of a one-dimensional feature is its mean difference; ``|E g|`` is at most the
  per-request MMD), tested on ``h − δ ≥ −4 − δ`` etc.: valid, and far weaker (the bets are limited
  by ``h``'s worst case). The primary is as valid a reference as a baseline: for a lossless
  candidate its answer and the candidate's are independent draws from the target's distribution
  given the request, whichever of them answered the client. Without either the guard is
  ``unavailable``; on sampled traffic that blocks promotion (``GuardState.blocks_promotion``).
- ``acceptance_drop`` (``max`` = d): per acceptance reading ``a`` of the candidate (its mean
  tokens per verification pass: the engine's per-request counts, else the stream's shape),
  ``x = (1 − d)·L − min(a, cap)`` against a reference level ``L`` — the mean of the episode's
  first :data:`REFERENCE_READINGS` readings, or a level kept from before a restart — with
  ``cap = max(2L, L + 2)``; one test overall (α/2) and one per category (the k-th category
  α/2 · 6/(π²k²)). Null: the mean reading is at least ``(1 − d)·L``. ``x ≥ (1 − d)·L − cap``.
- ``speculation_off``: not a statistical test — :data:`SPECULATION_OFF_MIN` engine-counted
  answers in a row (each with room to draft) with no draft, or none accepted; outside the α.
  A breach of either drift guard does what ``rollout.on_drift`` says (the controller).
- ``kv_usage``: not a statistical test — a sustained gauge. Fires when the candidate's last
  three scraped KV-cache usages are all ≥ ``max``; outside the α above.

What a state reports (``GuardState``; ``/admin/rollout``): ``value`` the statistic as the
operator reads it (point estimate over the rule's last ``window`` observations), ``bound`` the
e-value of the running e-process (1 = no evidence; its threshold ``1/α_j`` is in ``detail``), ``needs`` how many worst-case observations in a row would trip it now (None
where there is no single worst case: ``sampled_divergence``, ``kv_usage`` its 3 scrapes).
A guard is ``waiting`` until it has tested ``min_samples`` observations, ``unavailable`` when the
rule's last ``window`` observations brought it none (no streamed candidate leg, no metrics URL,
no baseline leg for sampled traffic), else ``ok`` or ``breach``.

:func:`observe` turns one finished exchange into an :class:`Observation` (cheap: it runs on the
evidence worker's thread); :func:`evaluate` replays a sequence of them into a fresh bank.

Size: every guard, the bank that splits α over them and the observation they read, as one unit — a
sixth of the file is this docstring, which states each guard's null and bound that the classes below
implement; the e-process itself is in :mod:`rollout.sequential`.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from core.evidence import Evidence, LegQuality
from core.exchange import Exchange, LegResult, Role
from core.stats import percentile_sorted
from core.timings import EXACT_TOKENS, Recording
from policies.compiled import GuardSpec
from rollout.sequential import SequentialTest

GuardName = Literal[
    "e2e_p99_ratio", "tpot_p99_ratio", "error_rate_delta", "divergence_rate",
    "tokens_per_event", "sampled_divergence", "kv_usage", "acceptance_drop", "speculation_off",
]  # fmt: skip
# The guards that judge what the candidate says: an unavailable one blocks promotion.
QUALITY_GUARDS: frozenset[GuardName] = frozenset({"divergence_rate", "sampled_divergence"})
# The guards that watch the candidate's speed decay: a breach does what ``rollout.on_drift`` says.
DRIFT_GUARDS: frozenset[GuardName] = frozenset({"acceptance_drop", "speculation_off"})
REFERENCE_READINGS = 50  # acceptance readings that fix a reference level (overall, per category)
ACCEPTANCE_CAP = 2.0  # each reading counts up to max(2 L, L + 2), L the reference level
SPECULATION_OFF_MIN = 32  # engine-counted candidate legs in a row with no draft landed
SPECULATION_OFF_TOKENS = 8  # … each with at least this many output tokens (room to draft)
GuardStatus = Literal["ok", "breach", "waiting", "unavailable"]
KV_SUSTAINED = 3  # consecutive scrapes
REFERENCE_MIN = 5  # paired primary values before the p99 guards test (ρ needs some)
TPE_CAP = 2.0  # tokens per event count up to this multiple of the minimum
SCALE_MEMORY = 20  # pairs the sampled guard's scales remember
SAMPLED_SHRINK = 1.0  # its bets stake on a recent mean one standard error above 0 (a null at 0)
# The sampled guard's mixture: MMD² h, similarity gap g (farther, closer), length ±, repetition ±
SAMPLED_WEIGHTS = (2.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
NEEDS_MAX = 10_000  # worst-case observations simulated for ``needs`` at most
T = TypeVar("T")


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
    sampled: bool = False  # a sampled (not greedy) exchange
    # Sampled exchanges only: the candidate's, the first baseline leg's and the primary's
    # output, where that leg completed with a sketch (``LegQuality.sketch``).
    candidate_output: LegQuality | None = None
    baseline_output: LegQuality | None = None
    primary_output: LegQuality | None = None
    # The candidate leg's mean acceptance length (tokens per verification pass): the engine's own
    # per-request counts where it reports them (``acceptance_exact``), else the stream's shape;
    # None where neither says, or where the request's parameters made the engine decode plainly.
    acceptance: float | None = None
    acceptance_exact: bool = False
    # The engine's per-request draft counts (None: not reported) and the leg's output tokens.
    drafted: int | None = None
    accepted: int | None = None
    output_tokens: int | None = None
    category: str | None = None
    # Where ``acceptance`` came from when the answer carried none: the candidate's own
    # ``/metrics`` over the scrape interval that ended since the last such reading (its whole
    # traffic, pass-weighted — judged against a level of its own, never a category's).
    acceptance_window: float | None = None


# The reference level's key for the candidate's /metrics readings (a unit apart: pass-weighted).
BACKEND_LEVEL = "@metrics"


@dataclass(frozen=True, slots=True)
class GuardState:
    name: GuardName
    status: GuardStatus
    value: float | None  # the statistic as the operator reads it
    bound: float | None  # the e-value of the test (kv_usage: the lowest recent scrape)
    threshold: float
    samples: int  # candidate observations
    reference_samples: int | None  # primary (or baseline) observations; None: no reference
    needs: int | None  # worst-case observations in a row that would trip it now
    detail: str
    # An unavailable quality guard on traffic it should judge: promotion waits (``detail`` says why).
    blocks_promotion: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "blocks_promotion": self.blocks_promotion,
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


class _Pairs:
    """Pairs a candidate value with a reference value: the two of one exchange when it has both,
    else the newest unpaired value of the other side (values from exchanges close in time; each
    used once; at most ``maxlen`` kept waiting, the oldest dropped). Which values pair depends
    only on which exchanges had which legs, never on the values."""

    __slots__ = ("c", "r")

    def __init__(self, maxlen: int) -> None:
        self.c: deque[float] = deque(maxlen=maxlen)
        self.r: deque[float] = deque(maxlen=maxlen)

    def add(self, c: float | None, r: float | None) -> tuple[float, float] | None:
        if c is not None and r is not None:
            return c, r
        if c is not None:
            if self.r:
                return c, self.r.pop()
            self.c.append(c)
        elif r is not None:
            if self.c:
                return self.c.pop(), r
            self.r.append(r)
        return None


class _Guard:
    """One statistical guard: its test, the observations it tested, its worst-case ``x``."""

    name: GuardName
    threshold: float
    test: SequentialTest
    bad: float | None = None  # the worst-case x, for ``needs``
    what = ""

    def __init__(self, alpha: float, spec: GuardSpec) -> None:
        self.alpha = alpha
        self.spec = spec
        self.tested = 0

    def update(self, o: Observation) -> None:
        raise NotImplementedError

    def _step(self, xs: Sequence[float | None]) -> None:
        self.test.step(xs)
        self.tested += 1

    def rejects(self) -> bool:
        return self.tested >= self.spec.min_samples and self.test.rejected

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        """``(value, samples, reference_samples)`` over the rule's recent observations."""
        raise NotImplementedError

    def unavailable_detail(self, window: Sequence[Observation]) -> str:
        return self.what

    def needs(self) -> int | None:
        if self.bad is None or self.bad <= 0:
            return None
        test, tested = self.test.copy(), self.tested
        for k in range(NEEDS_MAX + 1):
            if tested >= self.spec.min_samples and test.rejected:
                return k
            test.step((self.bad,))
            tested += 1
        return None

    def state(self, window: Sequence[Observation], with_needs: bool) -> GuardState:
        value, samples, reference = self.summary(window)
        e, threshold = self.test.evidence()
        detail = (
            f"{self.what}; e-value {e:.3g}, trips at {threshold:.3g} "
            f"(anytime-valid, α {self.alpha:.2g} for this guard)"
        )
        status: GuardStatus
        blocks = False
        if self.rejects():
            status = "breach"
        elif samples == 0 and (reference or 0) == 0 and len(window) >= self.spec.min_samples:
            status, detail = "unavailable", self.unavailable_detail(window)
            blocks = self.name in QUALITY_GUARDS and self.has_traffic(window)
        elif self.tested < self.spec.min_samples:
            status = "waiting"
            detail = f"{self.what}; {self.tested} of {self.spec.min_samples} observations tested"
        else:
            status = "ok"
        return GuardState(
            self.name, status, value, e, self.threshold, samples, reference,
            self.needs() if with_needs else None, detail, blocks,
        )  # fmt: skip

    def has_traffic(self, window: Sequence[Observation]) -> bool:
        """The rule's recent traffic has exchanges this guard should judge (a quality guard
        unavailable on them leaves them unjudged: promotion waits)."""
        return False


class _QuantileRatio(_Guard):
    """``x = 1{c > r·ρ} − 1{p > ρ}`` on pairs, ``ρ`` the paired primary's recent p99."""

    bad = 1.0

    def __init__(
        self, name: GuardName, limit: float, c: str, p: str, alpha: float, spec: GuardSpec
    ) -> None:
        super().__init__(alpha, spec)
        self.name, self.threshold, self.c, self.p = name, limit, c, p
        self.test = SequentialTest(alpha, spec.window, (-1.0,))
        self.pairs = _Pairs(spec.window)
        self.ref_sorted: list[float] = []
        self.ref_fifo: deque[float] = deque()
        self.what = f"p99 candidate ÷ p99 primary ({p.split('_')[1]})"

    def update(self, o: Observation) -> None:
        pair = self.pairs.add(getattr(o, self.c), getattr(o, self.p))
        if pair is None:
            return
        c, p = pair
        ref = self.ref_sorted
        n = len(ref)
        if n >= REFERENCE_MIN:  # ρ: the p99 of the reference, as percentile_sorted has it
            rank = (n - 1) * 0.99
            lo = int(rank)
            rho = ref[lo] + (ref[min(lo + 1, n - 1)] - ref[lo]) * (rank - lo)
            self.test.step(((c > self.threshold * rho) - (p > rho),))
            self.tested += 1
        insort(ref, p)
        self.ref_fifo.append(p)
        if n >= self.spec.window:
            del ref[bisect_left(ref, self.ref_fifo.popleft())]

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        cand = sorted(v for o in window if (v := getattr(o, self.c)) is not None)
        prim = sorted(v for o in window if (v := getattr(o, self.p)) is not None)
        value = None
        if cand and prim:
            reference = percentile_sorted(prim, 99.0) or 0.0
            top = percentile_sorted(cand, 99.0) or 0.0
            value = top / reference if reference > 0 else math.inf
        return value, len(cand), len(prim)


class _ErrorRate(_Guard):
    """``x = err_c − err_p − δ`` on pairs."""

    name: GuardName = "error_rate_delta"
    what = "candidate error rate − primary error rate"

    def __init__(self, limit: float, alpha: float, spec: GuardSpec) -> None:
        super().__init__(alpha, spec)
        self.threshold = limit
        self.bad = 1.0 - limit
        self.test = SequentialTest(alpha, spec.window, (-1.0 - limit,))
        self.pairs = _Pairs(spec.window)

    def update(self, o: Observation) -> None:
        c = None if o.candidate_ok is None else float(not o.candidate_ok)
        p = None if o.primary_ok is None else float(not o.primary_ok)
        pair = self.pairs.add(c, p)
        if pair is not None:
            self._step((pair[0] - pair[1] - self.threshold,))

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        cand = [o.candidate_ok for o in window if o.candidate_ok is not None]
        prim = [o.primary_ok for o in window if o.primary_ok is not None]
        value = None
        if cand:
            value = cand.count(False) / len(cand) - (prim.count(False) / len(prim) if prim else 0.0)
        return value, len(cand), len(prim)


class _Divergence(_Guard):
    """``x = div_c − div_b − δ`` (the exchange's own noise floor), ``div_c − δ`` without one."""

    name: GuardName = "divergence_rate"

    def __init__(self, limit: float, alpha: float, spec: GuardSpec) -> None:
        super().__init__(alpha, spec)
        self.threshold = limit
        self.bad = 1.0 - limit
        self.test = SequentialTest(alpha, spec.window, (-1.0 - limit,))

    def update(self, o: Observation) -> None:
        if o.diverged is None:
            return
        floor = float(o.baseline_diverged) if o.baseline_diverged is not None else 0.0
        self._step((float(o.diverged) - floor - self.threshold,))

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        div = [o.diverged for o in window if o.diverged is not None]
        base = [o.baseline_diverged for o in window if o.baseline_diverged is not None]
        floor = base.count(True) / len(base) if base else 0.0
        self.what = (
            f"candidate greedy divergence − noise floor {floor:.1%} "
            f"({len(base)} baseline comparisons)"
        )
        return (div.count(True) / len(div) - floor if div else None), len(div), None


class _TokensPerEvent(_Guard):
    """``x = m − min(tpe, 2m)`` per streamed candidate leg."""

    name: GuardName = "tokens_per_event"

    def __init__(self, limit: float, alpha: float, spec: GuardSpec) -> None:
        super().__init__(alpha, spec)
        self.threshold = limit
        self.cap = TPE_CAP * limit
        self.bad = limit - 1.0  # a request with no draft accepted: one token per event
        self.test = SequentialTest(alpha, spec.window, (limit - self.cap,))
        self.what = (
            f"mean tokens per event of the candidate's streamed legs (each up to {self.cap:g})"
        )

    def update(self, o: Observation) -> None:
        v = o.candidate_tokens_per_event
        if v is not None:
            self._step((self.threshold - min(v, self.cap),))

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        tpe = [v for o in window if (v := o.candidate_tokens_per_event) is not None]
        return (math.fsum(tpe) / len(tpe) if tpe else None), len(tpe), None


def _reference(o: Observation) -> LegQuality | None:
    """The sampled guard's reference output: the baseline leg's where the exchange has one (a
    plain copy of production, preferred: it leaves the primary as a third draw), else the
    primary's own answer to the same request."""
    if o.baseline_output is not None and o.baseline_output.sketch is not None:
        return o.baseline_output
    if o.primary_output is not None and o.primary_output.sketch is not None:
        return o.primary_output
    return None


def _length_difference(o: Observation) -> float | None:
    c, b = o.candidate_output, _reference(o)
    if c is None or b is None or c.units + b.units <= 0:
        return None
    return (c.units - b.units) / (c.units + b.units)


def _repetition_difference(o: Observation) -> float | None:
    c, b = o.candidate_output, _reference(o)
    if c is None or b is None or c.repetition is None or b.repetition is None:
        return None
    return c.repetition - b.repetition


def _distinct_difference(o: Observation) -> float | None:
    """Distinct word bigrams, candidate − reference: what a temperature changes first."""
    c, b = o.candidate_output, _reference(o)
    if c is None or b is None or c.distinct_2 is None or b.distinct_2 is None:
        return None
    return c.distinct_2 - b.distinct_2


def _closer(o: Observation, baseline_minus_candidate: tuple[float, ...]) -> float | None:
    """``g``: only where the reference is a baseline leg, the primary being the third draw."""
    p = o.primary_output
    if o.baseline_output is None or o.baseline_output.sketch is None:
        return None
    if p is None or p.sketch is None or len(p.sketch) != len(baseline_minus_candidate):
        return None
    return float(sum(map(operator.mul, baseline_minus_candidate, p.sketch)))


def _mean(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return sum(vs) / len(vs) if vs else None


def _neg(x: float | None) -> float | None:
    return None if x is None else -x


def _less(x: float | None, margin: float) -> float | None:
    return None if x is None else x - margin


class _Scale:
    """A predictable scale for a symmetric statistic: 2 × its recent mean absolute value."""

    __slots__ = ("mean_abs", "n")

    def __init__(self, prior: float) -> None:
        self.mean_abs, self.n = prior, 0

    def clip(self, s: float) -> float:
        x = max(-1.0, min(1.0, s / (2.0 * self.mean_abs)))
        self.n += 1
        self.mean_abs += (abs(s) - self.mean_abs) / min(self.n + 1, SCALE_MEMORY)
        self.mean_abs = max(self.mean_abs, 1e-6)
        return x


class _SampledDivergence(_Guard):
    """The candidate's sampled outputs against the baseline's: string-kernel MMD², similarity to
    the primary's output, length and repetition, on pairs of exchanges (see the module doc)."""

    name: GuardName = "sampled_divergence"
    what = "MMD² of the candidate's and the baseline's sampled outputs (string kernel)"

    def __init__(self, limit: float, alpha: float, spec: GuardSpec) -> None:
        super().__init__(alpha, spec)
        self.threshold = limit
        self.symmetric = limit == 0.0
        self.root = r = math.sqrt(limit)
        # h, g+, g−, length±, repetition±
        x_mins: tuple[float, ...] = (-1.0,) * 9
        if not self.symmetric:
            x_mins = (-4.0 - limit, -2.0 - r, -2.0 - r) + (-1.0 - r,) * 6
        self.test = SequentialTest(
            alpha, spec.window, x_mins, weights=SAMPLED_WEIGHTS, shrink=SAMPLED_SHRINK
        )
        self.scales = tuple(_Scale(0.25) for _ in range(5))
        self.pending: tuple[Observation, tuple[float, ...]] | None = None
        self.recent: deque[float] = deque(maxlen=spec.window)
        self.gaps: deque[float] = deque(maxlen=spec.window)
        self.by_baseline = self.by_primary = 0  # exchanges judged against each reference

    def update(self, o: Observation) -> None:
        c, b = o.candidate_output, _reference(o)
        if not o.sampled or c is None or b is None or c.sketch is None or b.sketch is None:
            return
        if b is o.baseline_output:
            self.by_baseline += 1
        else:
            self.by_primary += 1
        if len(c.sketch) != len(b.sketch):
            return
        # h = k(cᵢ,cⱼ) + k(bᵢ,bⱼ) − k(cᵢ,bⱼ) − k(bᵢ,cⱼ) = ⟨φ(cᵢ) − φ(bᵢ), φ(cⱼ) − φ(bⱼ)⟩
        diff = tuple(map(operator.sub, b.sketch, c.sketch))
        if self.pending is None or len(self.pending[1]) != len(diff):
            self.pending = (o, diff)
            return
        (first, first_diff), self.pending = self.pending, None
        h = max(-4.0, min(4.0, sum(map(operator.mul, first_diff, diff))))
        self.recent.append(h)
        pair = (first, o)
        # g = k(b, p) − k(c, p) = ⟨φ(b) − φ(c), φ(p)⟩: farther from production than the copy
        sim = _mean([_closer(x, d) for x, d in ((first, first_diff), (o, diff))])
        if sim is not None:
            self.gaps.append(sim)
        length = _mean([_length_difference(x) for x in pair])
        rep = _mean([_repetition_difference(x) for x in pair])
        distinct = _mean([_distinct_difference(x) for x in pair])
        if self.symmetric:
            hx = self.scales[0].clip(h)
            gx = None if sim is None else self.scales[1].clip(sim)
            lx = None if length is None else self.scales[2].clip(length)
            rx = None if rep is None else self.scales[3].clip(rep)
            dx = None if distinct is None else self.scales[4].clip(distinct)
            self._step((hx, gx, _neg(gx), lx, _neg(lx), rx, _neg(rx), dx, _neg(dx)))
        else:
            r = self.root
            self._step((
                h - self.threshold, _less(sim, r), _less(_neg(sim), r),
                _less(length, r), _less(_neg(length), r), _less(rep, r), _less(_neg(rep), r),
                _less(distinct, r), _less(_neg(distinct), r),
            ))  # fmt: skip

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        n = sum(
            1
            for o in window
            if o.sampled and o.candidate_output is not None and _reference(o) is not None
        )
        value = sum(self.recent) / len(self.recent) if self.recent else None
        gap = f"{sum(self.gaps) / len(self.gaps):+.3f}" if self.gaps else "n/a"
        self.what = (
            "MMD² of the candidate's sampled outputs and the reference's (string kernel; "
            f"reference: a baseline leg on {self.by_baseline}, the primary's own answer on "
            f"{self.by_primary} exchanges; similarity gap to production's answers {gap}, "
            "lengths, repetition)"
        )
        return value, n, n

    def has_traffic(self, window: Sequence[Observation]) -> bool:
        return any(o.sampled and o.candidate_output is not None for o in window)

    def unavailable_detail(self, window: Sequence[Observation]) -> str:
        if self.has_traffic(window):
            return (
                "sampled traffic with no reference: neither a baseline leg nor the primary's own "
                "answer behind the candidate's (the rule's ratio mirrors none) — promotion waits "
                "until the rule mirrors the primary behind canary answers or has a baseline leg"
            )
        return "no sampled exchanges with both outputs (greedy traffic is for divergence_rate)"


class _Level:
    """One acceptance-drop test: a reference level ``L`` fixed from the first
    :data:`REFERENCE_READINGS` readings (or given), then ``x = (1 − d)·L − min(a, cap)``."""

    __slots__ = (
        "_alpha",
        "_drop",
        "_window",
        "cap",
        "level",
        "readings",
        "recent",
        "run_n",
        "run_sum",
        "test",
        "tested",
    )

    def __init__(self, alpha: float, window: int, drop: float, level: float | None) -> None:
        self.readings: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)
        self.tested = 0
        self.level: float | None = None
        self.test: SequentialTest | None = None
        self.cap = 0.0
        # The readings since the running e-process last stood at or below 1: the ones that built
        # the evidence against the level (a breach reports their mean — the window's mean still
        # holds readings from before a fall, and may read inside the tolerance at a breach).
        self.run_n, self.run_sum = 0, 0.0
        self._alpha, self._window, self._drop = alpha, window, drop
        if level is not None:
            self._fix(level)

    def _fix(self, level: float) -> None:
        self.level = level
        self.run_n, self.run_sum = 0, 0.0
        self.cap = max(ACCEPTANCE_CAP * level, level + 2.0)
        self.test = SequentialTest(
            self._alpha, self._window, ((1.0 - self._drop) * level - self.cap,)
        )

    def add(self, a: float) -> None:
        self.recent.append(a)
        if self.test is None:
            self.readings.append(a)
            if len(self.readings) >= REFERENCE_READINGS:
                self._fix(math.fsum(self.readings) / len(self.readings))
            return
        assert self.level is not None
        if not self.test.rejected:  # once it has decided, its evidence is what it was
            if self.test.log_e <= 0.0:
                self.run_n, self.run_sum = 0, 0.0
            self.run_n += 1
            self.run_sum += a
        self.test.step(((1.0 - self._drop) * self.level - min(a, self.cap),))
        self.tested += 1

    def evidence_mean(self) -> float | None:
        """The mean reading since the evidence against the level began (None: none yet)."""
        return self.run_sum / self.run_n if self.run_n else None


class _AcceptanceDrop(_Guard):
    """The candidate's mean acceptance length against its own reference level, overall and per
    category: ``x = (1 − d)·L − min(a, cap)`` per reading ``a`` (see the module doc)."""

    name: GuardName = "acceptance_drop"

    def __init__(
        self, limit: float, alpha: float, spec: GuardSpec, levels: dict[str, float] | None = None
    ) -> None:
        super().__init__(alpha, spec)
        self.threshold = limit
        self.given = dict(levels or {})
        # Half of α for the overall level, the other half spent over categories as they appear:
        # the k-th gets α/2 · 6/(π² k²), so the sum over any number of categories stays ≤ α/2.
        self.overall = _Level(alpha / 2, spec.window, limit, self.given.get(""))
        self.categories: dict[str, _Level] = {}
        self.what = "relative fall of the candidate's mean acceptance length below its reference"

    def _category(self, name: str) -> _Level:
        level = self.categories.get(name)
        if level is None:
            k = len(self.categories) + 1
            a = self.alpha / 2 * 6 / (math.pi**2 * k * k)
            level = self.categories[name] = _Level(
                a, self.spec.window, self.threshold, self.given.get(name)
            )
        return level

    def update(self, o: Observation) -> None:
        w = o.acceptance_window
        if w is not None and math.isfinite(w) and w >= 1.0:
            self._category(BACKEND_LEVEL).add(w)
            self.tested += 1
        a = o.acceptance
        if a is None or not math.isfinite(a) or a < 1.0:
            return
        self.overall.add(a)
        if o.category:
            self._category(o.category).add(a)
        self.tested += 1

    def _levels(self) -> list[tuple[str, _Level]]:
        return [("", self.overall), *sorted(self.categories.items())]

    def references(self) -> dict[str, float]:
        """The fixed reference levels (``""``: overall), to keep across restarts and replicas."""
        return {k: lv.level for k, lv in self._levels() if lv.level is not None}

    def rejects(self) -> bool:
        return any(
            lv.test is not None and lv.tested >= self.spec.min_samples and lv.test.rejected
            for _, lv in self._levels()
        )

    def rearm(self) -> None:
        """After an ``alert``: keep the levels, start the tests afresh."""
        for _, lv in self._levels():
            if lv.level is not None:
                lv._fix(lv.level)
                lv.tested = 0

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        lv = (
            self.overall
            if self.overall.readings or self.overall.level is not None
            else (self.categories.get(BACKEND_LEVEL, self.overall))
        )
        worst: tuple[float, str, float, float, str] | None = None
        for name, level in self._levels():
            if level.level is None or not level.recent:
                continue
            mean = math.fsum(level.recent) / len(level.recent)
            rejected = level.test is not None and level.test.rejected
            since = level.evidence_mean() if rejected else None
            note = ""
            if since is not None:  # a breach: observed is what the evidence saw
                note = (f"; over the {level.run_n} readings that built the evidence, "
                        f"the last {len(level.recent)} averaging {mean:.2f}")  # fmt: skip
                mean = since
            fall = 1.0 - mean / level.level
            if worst is None or fall > worst[0] or rejected:
                where = "the candidate's /metrics" if name == BACKEND_LEVEL else name
                worst = (fall, where or "all traffic", mean, level.level, note)
                if rejected:
                    break
        n = len(lv.recent)
        if lv.level is None:
            self.what = (
                f"reference level: {len(lv.readings)} of {REFERENCE_READINGS} acceptance "
                "readings of this episode"
            )
            return None, n, len(lv.readings)
        if worst is None:
            return None, n, REFERENCE_READINGS
        fall, where, mean, ref, note = worst
        self.what = (
            f"mean acceptance length {mean:.2f} against reference {ref:.2f} ({where}; "
            f"fall {fall:.0%}, tolerated {self.threshold:.0%}{note})"
        )
        return fall, n, REFERENCE_READINGS

    def state(self, window: Sequence[Observation], with_needs: bool) -> GuardState:
        value, samples, reference = self.summary(window)
        tests = [(lv.test, lv.tested) for _, lv in self._levels() if lv.test is not None]
        e = max((t.evidence()[0] for t, _ in tests), default=1.0)
        trips = min((t.evidence()[1] for t, _ in tests), default=math.inf)
        status: GuardStatus
        if self.rejects():
            status = "breach"
        elif samples == 0 and len(window) >= self.spec.min_samples:
            return GuardState(self.name, "unavailable", None, None, self.threshold, 0, None,
                              None, self.unavailable_detail(window))  # fmt: skip
        elif not tests or max(n for _, n in tests) < self.spec.min_samples:
            status = "waiting"
        else:
            status = "ok"
        detail = self.what
        if tests:
            detail = (
                f"{self.what}; e-value {e:.3g}, trips at {trips:.3g} (anytime-valid, "
                f"α {self.alpha:.2g} for this guard, split over {len(tests)} level(s))"
            )
        return GuardState(
            self.name, status, value, e, self.threshold, samples, reference, None, detail
        )

    def unavailable_detail(self, window: Sequence[Observation]) -> str:
        return (
            "no acceptance readings: the candidate's answers carry neither the engine's "
            "per-request counts nor a stream whose shape shows its passes"
        )


class _SpeculationOff(_Guard):
    """A candidate that stopped speculating: :data:`SPECULATION_OFF_MIN` engine-counted legs in a
    row (each with at least :data:`SPECULATION_OFF_TOKENS` output tokens) with no draft, or with
    drafts of which none was accepted. A rule, not a statistical test (outside α)."""

    name: GuardName = "speculation_off"

    def __init__(self, spec: GuardSpec) -> None:
        super().__init__(0.0, spec)
        self.threshold = float(SPECULATION_OFF_MIN)
        self.streak = 0
        self.counted = 0
        self.tripped = False
        self.last: str = ""
        self.what = (
            f"engine-counted candidate answers in a row with no draft token landed "
            f"(breach at {SPECULATION_OFF_MIN})"
        )

    def update(self, o: Observation) -> None:
        if o.drafted is None:  # the engine's own counts only: a stream's shape never trips it
            return
        if o.output_tokens is not None and o.output_tokens < SPECULATION_OFF_TOKENS:
            return
        self.counted += 1
        if o.drafted == 0:
            self.streak, self.last = self.streak + 1, "no drafts"
        elif not o.accepted:
            self.streak, self.last = self.streak + 1, "drafts, none accepted (acceptance 1.0)"
        else:
            self.streak = 0
        if self.streak >= SPECULATION_OFF_MIN:
            self.tripped = True

    def rejects(self) -> bool:
        return self.tripped

    def rearm(self) -> None:
        self.tripped, self.streak = False, 0

    def needs(self) -> int | None:
        return max(0, SPECULATION_OFF_MIN - self.streak) if not self.tripped else 0

    def summary(self, window: Sequence[Observation]) -> tuple[float | None, int, int | None]:
        return float(self.streak), self.counted, None

    def state(self, window: Sequence[Observation], with_needs: bool) -> GuardState:
        status: GuardStatus
        if self.tripped:
            status = "breach"
            detail = (
                f"{self.streak} answers in a row: {self.last} — the candidate stopped speculating"
            )
        elif self.counted == 0 and len(window) >= self.spec.min_samples:
            status = "unavailable"
            detail = "no engine per-request draft counts from the candidate (this rule needs them)"
        elif self.counted < self.spec.min_samples:
            status = "waiting"
            detail = f"{self.what}; {self.counted} of {self.spec.min_samples} answers counted"
        else:
            status, detail = "ok", self.what
        return GuardState(
            self.name, status, float(self.streak), None, self.threshold, self.counted, None,
            self.needs() if with_needs else None, detail,
        )  # fmt: skip


class GuardBank:
    """Every enabled guard of one rule over one rollout episode (see the module doc).

    :meth:`update` takes each observation (cheap: a few arithmetic steps per guard);
    :meth:`breached` says whether a guard has breached; :meth:`states` describes them all.
    """

    def __init__(self, spec: GuardSpec, levels: dict[str, float] | None = None) -> None:
        self.spec = spec
        self.window: deque[Observation] = deque(maxlen=spec.window)
        candidates: tuple[tuple[GuardName, float | None, str, str], ...] = (
            ("e2e_p99_ratio", spec.e2e_p99_ratio_max, "candidate_e2e", "primary_e2e"),
            ("tpot_p99_ratio", spec.tpot_p99_ratio_max, "candidate_tpot", "primary_tpot"),
        )
        ratios = [(n, limit, c, p) for n, limit, c, p in candidates if limit is not None]
        others: list[
            tuple[float, type[_ErrorRate | _Divergence | _TokensPerEvent | _SampledDivergence]]
        ] = [
            (limit, cls)
            for limit, cls in (
                (spec.error_rate_delta_max, _ErrorRate),
                (spec.divergence_rate_max, _Divergence),
                (spec.tokens_per_event_min, _TokensPerEvent),
                (spec.sampled_divergence_max, _SampledDivergence),
            )
            if limit is not None
        ]
        drop = spec.acceptance_drop_max
        k = len(ratios) + len(others) + (drop is not None)
        self.alpha = (1.0 - spec.confidence) / max(1, k)
        self.guards: list[_Guard] = [
            _QuantileRatio(name, limit, c, p, self.alpha, spec) for name, limit, c, p in ratios
        ]
        self.guards += [cls(limit, self.alpha, spec) for limit, cls in others]
        self.acceptance: _AcceptanceDrop | None = None
        self.speculation: _SpeculationOff | None = None
        if drop is not None:
            self.acceptance = _AcceptanceDrop(drop, self.alpha, spec, levels)
            self.speculation = _SpeculationOff(spec)
            self.guards += [self.acceptance, self.speculation]

    def references(self) -> dict[str, float]:
        """The acceptance reference levels fixed so far (``""``: overall)."""
        return self.acceptance.references() if self.acceptance is not None else {}

    def rearm(self, name: str) -> None:
        """A drift guard's breach was only alerted: watch on (reference levels kept)."""
        for g in self.guards:
            if g.name == name and isinstance(g, _AcceptanceDrop | _SpeculationOff):
                g.rearm()

    def update(self, o: Observation) -> None:
        self.window.append(o)
        for g in self.guards:
            g.update(o)

    def breached(self) -> GuardName | None:
        """The first statistical guard in breach, if any (what :meth:`states` would say)."""
        return next((g.name for g in self.guards if g.rejects()), None)

    def states(self, kv_recent: Sequence[float] = (), *, needs: bool = False) -> list[GuardState]:
        """Every enabled guard's state; ``needs`` computed only when asked (it simulates)."""
        out = [g.state(self.window, needs) for g in self.guards]
        if self.spec.kv_usage_max is not None:
            out.append(kv_state(self.spec.kv_usage_max, kv_recent))
        return out


def kv_state(limit: float, kv_recent: Sequence[float]) -> GuardState:
    """The KV-cache gauge rule: breach when the last 3 scrapes are all ≥ ``limit``."""
    recent = list(kv_recent)[-KV_SUSTAINED:]
    if not recent:
        return GuardState("kv_usage", "unavailable", None, None, limit, 0, None, None,
                          "no KV-cache gauge scraped from the candidate")  # fmt: skip
    sustained = len(recent) == KV_SUSTAINED and min(recent) >= limit
    return GuardState(
        "kv_usage", "breach" if sustained else "ok", recent[-1], min(recent), limit, len(recent),
        None, KV_SUSTAINED,
        f"lowest of the last {KV_SUSTAINED} scrapes of the candidate's KV-cache usage "
        "(a sustained gauge, not a statistical test)",
    )  # fmt: skip


def evaluate(
    spec: GuardSpec, observations: Sequence[Observation], kv_recent: Sequence[float] = ()
) -> list[GuardState]:
    """Every guard's state after ``observations``, in order, fed to a fresh bank (``needs``
    included)."""
    bank = GuardBank(spec)
    for o in observations:
        bank.update(o)
    return bank.states(kv_recent, needs=True)


def window_reading(
    seen: int | None, readings: Sequence[tuple[int, float]]
) -> tuple[int | None, float | None]:
    """The candidate's ``/metrics`` acceptance readings (``(t_ns, value)``, oldest first) not yet
    attached to an observation: ``(the newest t_ns now seen, their mean)``. The first look
    (``seen`` None) only marks where the rule's evidence starts: intervals before it are not its."""
    fresh = [(t, a) for t, a in readings if seen is None or t > seen]
    if not fresh:
        return seen, None
    newest = fresh[-1][0]
    if seen is None:
        return newest, None
    return newest, math.fsum(a for _, a in fresh) / len(fresh)


def _leg(exchange: Exchange, role: str, backend: str | None = None) -> int | None:
    for i, leg in enumerate(exchange.legs):
        if leg.role == role and (backend is None or leg.backend == backend):
            return i
    return None


def _ok(leg: LegResult) -> bool:
    return (
        leg.outcome == "completed"
        and (leg.status is None or leg.status < 400)
        and leg.error_type is None
    )


def _at(items: Sequence[T], i: int | None) -> T | None:
    return items[i] if i is not None and i < len(items) else None


_UNJUDGED = ("cancelled", "deadline", "client_disconnected")


def observe(evidence: Evidence, candidate_backend: str) -> Observation | None:
    """The guards' view of one exchange; None when it had no candidate leg at all."""
    exchange = evidence.exchange
    ci = _leg(exchange, "candidate", candidate_backend)
    if ci is None:
        return None
    cand = exchange.legs[ci]
    pi = _leg(exchange, "primary")
    prim = _at(exchange.legs, pi)
    cand_rec = cand.recording if _ok(cand) else None
    prim_rec = prim.recording if prim is not None and _ok(prim) else None
    tpe = None
    if cand_rec is not None and cand_rec.streaming and cand_rec.tokens_source in EXACT_TOKENS:
        tpe = cand_rec.timings.tokens_per_event
    # TPOT divides by the token count: an estimated count (a stream without usage) is compared
    # only with the other leg of its own exchange, estimated the same way (evidence.counts),
    # never paired with a leg of another exchange counted exactly.
    both = cand_rec is not None and prim_rec is not None

    def tpot(rec: Recording | None) -> float | None:
        if rec is None or (rec.tokens_source not in EXACT_TOKENS and not both):
            return None
        return rec.timings.tpot_s

    diverged = baseline = None
    for c in evidence.comparisons:
        if not c.comparable or not c.greedy or c.exact_match is None:
            continue
        pair = {c.a, c.b}
        if pair == {"primary", "candidate"} and candidate_backend in (c.a_backend, c.b_backend):
            diverged = not c.exact_match
        elif pair == {"primary", "baseline"}:
            baseline = not c.exact_match
    cand_out = base_out = prim_out = None
    if not evidence.greedy and evidence.quality:
        cand_out = _at(evidence.quality, ci)
        if cand_out is not None and cand_out.sketch is not None:
            base_out = next(
                (
                    q
                    for leg, q in zip(exchange.legs, evidence.quality, strict=False)
                    if leg.role == "baseline" and q is not None and q.sketch is not None
                ),
                None,
            )
            prim_out = _at(evidence.quality, pi)
    acceptance = exact = None
    drafted = accepted = None
    acc = _at(evidence.acceptance, ci)
    if acc is not None and cand_rec is not None and evidence.speculation_skip is None:
        if acc.source is not None and acc.mean_acceptance_length is not None:
            acceptance, exact = acc.mean_acceptance_length, True
        elif acc.source is None and acc.tokens_per_pass is not None:
            # (an engine that counts its drafts but not its passes — llama.cpp — streams one
            # token per event whatever it accepted: its stream's shape is not its passes)
            acceptance, exact = acc.tokens_per_pass, False
        if acc.source is not None:
            drafted, accepted = acc.num_draft_tokens, acc.num_accepted_tokens
    return Observation(
        served_by=exchange.served_by,
        candidate_ok=_ok(cand) if cand.outcome not in _UNJUDGED else None,
        primary_ok=_ok(prim) if prim is not None and prim.outcome not in _UNJUDGED else None,
        candidate_e2e=cand_rec.timings.e2e_s if cand_rec is not None else None,
        candidate_tpot=tpot(cand_rec),
        primary_e2e=prim_rec.timings.e2e_s if prim_rec is not None else None,
        primary_tpot=tpot(prim_rec),
        candidate_tokens_per_event=tpe,
        diverged=diverged,
        baseline_diverged=baseline,
        sampled=not evidence.greedy,
        candidate_output=cand_out,
        baseline_output=base_out,
        primary_output=prim_out if prim_out is not None and prim_out.sketch is not None else None,
        acceptance=acceptance,
        acceptance_exact=bool(exact),
        drafted=drafted,
        accepted=accepted,
        output_tokens=cand_rec.output_tokens if cand_rec is not None else None,
        category=evidence.category,
    )
