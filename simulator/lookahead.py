"""Dynamic lookahead for the simulator's replayed drafts (pure): the draft length, step by step.

``SimConfig.lookahead`` names a rule (``heuristic:start=4,floor=1,cap=8``, ``ema_tiers``,
``elastic``, ``confidence:threshold=0.7,cap=8``); :func:`schedule` makes a fresh one per
request, and :func:`simulator.acceptance.replay_steps` asks it for each step's ``k`` and tells
it what the step drafted and accepted. Written from the laws themselves (docs/counterfactual.md,
"Dynamic lookahead"), apart from the product's replay (``counterfactual.rules``), so that a
simulated candidate running a rule is ground truth for the replay of that rule:

- ``heuristic`` (Hugging Face): ``n += up`` when the whole draft of ``n`` tokens was accepted,
  else ``n = max(floor, n − down)`` — a shorter draft, or none, is a miss.
- ``ema_tiers`` (SGLang-style): ``ema ← (1 − weight)·ema + weight·accepted`` per drafting step,
  starting halfway between the thresholds; a tier up at ``ema ≥ up·k``, down at ``ema < down·k``.
- ``elastic`` (vLLM's EWMA): ``rate ← (1 − weight)·rate + weight·accepted/drafted`` per drafting
  step; ``k`` = the tier above as many thresholds as ``rate`` reaches.
- ``confidence``: ``k`` is the cap; the drafter stops after a token under the threshold (the
  proposer does that, :func:`simulator.drafter.drafter_proposer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Schedule", "parse", "schedule"]

_DEFAULTS: dict[str, dict[str, object]] = {
    "heuristic": {"start": 4, "floor": 1, "cap": 8, "up": 2, "down": 1},
    "ema_tiers": {"tiers": (1, 2, 4, 8), "start": 4, "weight": 0.2, "up": 0.8, "down": 0.4},
    "elastic": {
        "tiers": (1, 2, 4, 8),
        "thresholds": (0.3, 0.5, 0.7),
        "weight": 0.2,
        "initial": 0.5,
    },
    "confidence": {"threshold": 0.4, "cap": 8},
}


def parse(text: str) -> tuple[str, dict[str, object]]:
    """``name:key=value,…`` (tuples as ``1/2/4``) → (name, every constant).

    Raises:
        ValueError: an unknown rule or constant.
    """
    name, _, rest = text.partition(":")
    if name not in _DEFAULTS:
        raise ValueError(f"lookahead {text!r}: expected one of {', '.join(_DEFAULTS)}")
    params = dict(_DEFAULTS[name])
    for piece in filter(None, rest.split(",")):
        key, _, value = piece.partition("=")
        if key not in params:
            raise ValueError(f"lookahead {text!r}: no constant {key!r}")
        numbers = [float(v) for v in value.split("/")]
        params[key] = tuple(numbers) if isinstance(params[key], tuple) else numbers[0]
    return name, params


@dataclass(slots=True)
class Schedule:
    """One request's rule: :attr:`k` before a step, :meth:`verified` after it."""

    name: str
    params: dict[str, object]
    history: list[tuple[int, int, int]] = field(default_factory=list)  # (wanted, drafted, ok)

    def _f(self, key: str) -> float:
        value = self.params[key]
        assert isinstance(value, int | float)
        return float(value)

    def _tiers(self, key: str = "tiers") -> list[float]:
        value = self.params[key]
        assert isinstance(value, tuple)
        return [float(v) for v in value]

    @property
    def k(self) -> int:
        if self.name == "heuristic":
            n = self._f("start")
            for wanted, drafted, ok in self.history:
                full = drafted == wanted and ok == wanted
                n = (
                    min(self._f("cap"), n + self._f("up"))
                    if full
                    else max(self._f("floor"), n - self._f("down"))
                )
            return int(n)
        if self.name == "ema_tiers":
            tiers = self._tiers()
            i = tiers.index(self._f("start"))
            ema = tiers[i] * (self._f("up") + self._f("down")) / 2
            for _, drafted, ok in self.history:
                if not drafted:
                    continue
                ema = (1 - self._f("weight")) * ema + self._f("weight") * ok
                if ema >= self._f("up") * tiers[i] and i < len(tiers) - 1:
                    i += 1
                elif ema < self._f("down") * tiers[i] and i > 0:
                    i -= 1
            return int(tiers[i])
        if self.name == "elastic":
            rate = self._f("initial")
            for _, drafted, ok in self.history:
                if drafted:
                    rate = (1 - self._f("weight")) * rate + self._f("weight") * ok / drafted
            passed = len([t for t in self._tiers("thresholds") if rate >= t])
            return int(self._tiers()[passed])
        return int(self._f("cap"))

    def verified(self, wanted: int, drafted: int, accepted: int) -> None:
        self.history.append((wanted, drafted, accepted))


def schedule(text: str | None) -> Schedule | None:
    """A fresh schedule for one request (None: fixed ``num_speculative_tokens``)."""
    if text is None:
        return None
    name, params = parse(text)
    return Schedule(name, params)
