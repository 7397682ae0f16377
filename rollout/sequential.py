"""Anytime-valid sequential tests for the rollout guards: betting e-processes (pure, no numpy).

A guard is looked at after every exchange for as long as a canary (or a live rule) runs. A
fixed-sample rule re-evaluated that way rejects a healthy candidate sooner or later with
probability one; the test here does not.

**The e-process.** A guard reduces each observation (an exchange, or a pair of them) to a number
``x`` whose conditional mean, given everything seen before, is **≤ 0 while the candidate is
within the operator's threshold** (the guard's *null*), and that is bounded below by a known
``x_min < 0``. A gambler who starts with wealth 1 and stakes a fraction ``λ ≥ 0`` of it on each
``x`` — ``W ← W · (1 + λ·x)``, ``λ`` chosen from the past only (a *predictable* bet) — holds a
nonnegative supermartingale under the null, so by **Ville's inequality** ``P(sup_n W_n ≥ 1/α) ≤
α``: ``W`` is an e-process, and rejecting the first time ``W ≥ 1/α`` is valid however often and
however long one looks (Shafer 2021; Waudby-Smith & Ramdas 2023; Ramdas et al. 2023). A fixed
weighted average of e-processes on the same observations is an e-process (a mixture): each
guard mixes several bets, and may mix several statistics.

**The bets** (in :class:`SequentialTest`): aGRAPA (Waudby-Smith & Ramdas 2023), ``λ = m / (v + m²)`` with
``m``, ``v`` the mean and variance of past ``x``, estimated with exponential forgetting; the
mixture holds one bettor with a short memory (:data:`BET_MEMORIES`: 5 observations, quick to
turn after a long healthy stretch) and one with a longer one (40: steady on a small effect).
Each bet is clipped to ``[0, 0.75 / |x_min|]`` — one worst-case ``x`` costs at most 75 % of that
bettor's wealth. ``shrink`` > 0 stakes only on a recent mean more than ``shrink`` standard errors
above 0 (for a null that sits exactly at mean 0, where an unshrunk bet bleeds wealth on noise).
Any predictable bet keeps the guarantee; the choice only decides how fast a real regression is
found.

**Restarts and spending** (:class:`SequentialTest`). Evidence should not be held against a
candidate forever, and an e-process that a healthy stretch has pushed below 1 starts handicapped.
So the running e-process is replaced by a fresh one (wealth 1, same bettors' estimates):

- as soon as its e-value falls below ½ (a handicap of more than a factor 2), and
- at every ``window / 2`` of its age from ``window`` on, if its e-value is above 2 but has not
  doubled over the last ``window / 2`` observations: evidence older than the window that is no
  longer growing is forgotten. (Evidence that keeps growing is kept — a slow, persistent
  regression is found however long it takes to show.)

The ``j``-th e-process started is tested at ``α_j = α / (j (j + 1))``; the levels sum to ``α``.
Every start is a stopping time and each e-process is a nonnegative supermartingale from its start
under the null, so by Ville's inequality for each and a union bound

    P(any of them ever reaches its threshold | the null holds throughout) ≤ Σ α_j = α

over an arbitrarily long canary, every observation looked at. Under a healthy candidate the
e-value mostly sits near 1 (the bets are 0 when the recent mean is negative), so restarts are
rare and the threshold stays near ``2/α``; each restart raises it (``log(1/α_j)`` grows like
``2 log j``). Once an e-process has reached its threshold the test has rejected, for good.

What this assumes: the null's conditional-mean inequality, ``E[x_n | past] ≤ 0``, for every
observation while the candidate is within threshold (each guard says what that requires of the
traffic), and ``x_n ≥ x_min``. Nothing about distributions, independence of successive
exchanges, or stationarity beyond that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BET_FRACTION = 0.75  # of the largest bet that keeps the wealth positive at the worst x
BET_MEMORIES = (5, 40)  # observations each bettor's running mean and variance remember
RESTART_BELOW = 0.5  # an e-value under this restarts the test (a handicap)
STALE_ABOVE = 2.0  # an e-value over this that stopped doubling is forgotten after a window
_LOG_RESTART = math.log(RESTART_BELOW)
_LOG_STALE = math.log(STALE_ABOVE)
_LOG_2 = math.log(2.0)


def spending(alpha: float, j: int) -> float:
    """The level of the ``j``-th (1-based) e-process started: ``α / (j (j + 1))``, summing to α."""
    return alpha / (j * (j + 1))


class SequentialTest:
    """A restarted mixture betting e-process with α-spending (see the module doc).

    ``x_mins``: the lower bound of each statistic's ``x``; ``weights`` (default equal) mix the
    statistics, each itself a mixture of one bettor per :data:`BET_MEMORIES`. :meth:`step` takes
    one ``x`` per statistic (``None``: not observed this time; its wealth is unchanged).

    A bettor (aGRAPA with exponential forgetting) stakes ``λ = m / (v + m²)`` of its wealth,
    clipped to ``[0, BET_FRACTION / |x_min|]``, where ``m`` and ``v`` are its running mean and
    variance of the statistic (``m`` lowered by ``shrink`` standard errors first, when given); it
    updates them after the stake, so every bet is predictable. The bettors' state lives in flat
    lists: this runs once per guard per exchange on the evidence worker's thread.
    """

    __slots__ = (
        "_caps",
        "_log_weights",
        "_memories",
        "age",
        "alpha",
        "at_check",
        "log_e",
        "log_wealth",
        "means",
        "n",
        "observed",
        "rejected",
        "shrink",
        "started",
        "variances",
        "window",
    )

    def __init__(
        self,
        alpha: float,
        window: int,
        x_mins: Sequence[float],
        weights: Sequence[float] | None = None,
        shrink: float = 0.0,
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not x_mins or max(x_mins) >= 0:
            raise ValueError(f"every x_min must be negative, got {list(x_mins)}")
        w = list(weights) if weights is not None else [1.0] * len(x_mins)
        if len(w) != len(x_mins) or min(w) <= 0:
            raise ValueError("one positive weight per statistic")
        self.alpha = alpha
        self.window = max(2, window)
        self.shrink = shrink
        per = len(BET_MEMORIES)
        total = sum(w) * per
        self._caps = [BET_FRACTION / -x for x in x_mins for _ in BET_MEMORIES]
        self._memories = list(BET_MEMORIES) * len(x_mins)
        self._log_weights = [math.log(v / total) for v in w for _ in BET_MEMORIES]
        self.means = [0.0] * len(self._caps)
        self.variances = [0.0] * len(self._caps)
        self.observed = [0] * len(x_mins)  # observations of each statistic
        self.log_wealth = [0.0] * len(self._caps)  # of each bettor, since the start
        self.log_e = 0.0  # of the running e-process (the mixture)
        self.at_check = 0.0  # its log e-value at the last check point
        self.age = 0  # observations since the running e-process started
        self.started = 1  # e-processes started so far (j of the running one)
        self.n = 0  # observations taken
        self.rejected = False

    def log_threshold(self) -> float:
        return -math.log(spending(self.alpha, self.started))

    def step(self, xs: Sequence[float | None]) -> None:
        self.n += 1
        if self.rejected:  # the test has decided; nothing after that counts
            return
        means, variances, caps, memories = self.means, self.variances, self._caps, self._memories
        log_wealth, shrink, per = self.log_wealth, self.shrink, len(BET_MEMORIES)
        staked = False
        for i, x in enumerate(xs):
            if x is None:
                continue
            n = self.observed[i]
            self.observed[i] = n + 1
            for k in range(i * per, i * per + per):
                m, v, memory = means[k], variances[k], memories[k]
                edge = m - shrink * math.sqrt(v / min(n + 1, memory)) if shrink else m
                if edge > 0.0:
                    lam = edge / (v + m * m)
                    if lam > caps[k]:
                        lam = caps[k]
                    log_wealth[k] += math.log1p(lam * x)
                    staked = True
                w = 1.0 / min(n + 2, memory)  # a prior pseudo-observation at 0 damps the first
                d = x - m
                means[k] = m + w * d
                variances[k] = (1.0 - w) * (v + w * d * d)
        self.age += 1
        if staked:
            # Every log wealth stays within a few nats of 0 here (restarts below ½, a decision
            # above the threshold), so the plain sum of exponentials cannot overflow or vanish.
            self.log_e = math.log(
                sum(math.exp(lw + w) for lw, w in zip(log_wealth, self._log_weights, strict=True))
            )
            if self.log_e >= self.log_threshold():
                self.rejected = True
                return
        restart = self.log_e < _LOG_RESTART
        if not restart and self.age % (self.window // 2) == 0:
            if (
                self.age >= self.window
                and self.log_e > _LOG_STALE
                and self.log_e < self.at_check + _LOG_2
            ):
                restart = True
            self.at_check = self.log_e
        if restart:
            self.started += 1
            self.age = 0
            self.log_e = self.at_check = 0.0
            self.log_wealth = [0.0] * len(log_wealth)

    def evidence(self) -> tuple[float, float]:
        """``(e-value, 1/α_j)`` of the running e-process."""
        return math.exp(min(self.log_e, 700.0)), math.exp(self.log_threshold())

    def copy(self) -> SequentialTest:
        out = SequentialTest.__new__(SequentialTest)
        for name in SequentialTest.__slots__:
            value = getattr(self, name)
            setattr(out, name, list(value) if isinstance(value, list) else value)
        return out
