"""Dynamic lookahead: rules that choose the draft length step by step, replayed beside fixed k.

A rule is a small state machine: it says how many tokens to draft (``k``) before a step and
hears back, after the target verified the step, how many tokens were drafted and accepted.
Rules of the accept counts alone replay *exactly* from a verified output (greedy, engine ids):
the replay knows every step's drafted and accepted counts. The laws, with their constants as
parameters (docs/counterfactual.md, "Dynamic lookahead"):

- ``heuristic`` — Hugging Face transformers' ``num_assistant_tokens_schedule="heuristic"``:
  after each verification ``n += up`` if the accepted count equals ``n``, else
  ``n = max(floor, n − down)``; a draft that came out shorter than ``n`` (the proposer had less
  to offer, or the output's end cut it) counts as a miss. ``start`` (transformers'
  ``num_assistant_tokens``), ``floor``, ``cap``.
- ``ema_tiers`` — SGLang-style adaptive steps at batch 1: ``ema ← (1 − w)·ema + w·accepted``
  after each drafting step; one tier up when ``ema ≥ up·k``, one down when ``ema < down·k``
  (the gap between ``up`` and ``down`` is the hysteresis).
- ``elastic`` — vLLM's elastic speculation (a closed PR): an EWMA of the draft acceptance rate
  (accepted / drafted) picks a depth by thresholds 30 / 50 / 70 %.
- ``confidence`` — a draft model stops drafting after the first token whose probability is
  under ``threshold`` (transformers' ``assistant_confidence_threshold``, 0.4). Needs the
  drafter's probability at each drafted position: exact on the accepted prefix given the
  teacher-forced pass (``exact_given_drafter``).
- ``batch_schedule`` — ``k`` from the batch size (vLLM's ``num_speculative_tokens_per_batch_size``,
  SGLang's tiers above batch 1): needs each step's batch, which no record holds, so the replay
  gives a ``bound`` between the schedule's smallest and largest ``k``.

Every rule here is a pure value (hashable, ordered) so it can sit in a :class:`~.grid.Config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "RULE_NAMES",
    "Controller",
    "ReplayClass",
    "Rule",
    "batch_schedule",
    "confidence",
    "elastic",
    "ema_tiers",
    "heuristic",
    "parse_rule",
]

ReplayClass = Literal["exact", "exact_given_drafter", "exact_given_history", "bound", "approximate"]
RuleName = Literal["heuristic", "ema_tiers", "elastic", "confidence", "batch_schedule"]
RULE_NAMES: tuple[str, ...] = ("heuristic", "ema_tiers", "elastic", "confidence", "batch_schedule")
Param = tuple[str, float | tuple[float, ...]]


@dataclass(frozen=True, slots=True, order=True)
class Rule:
    """A draft-length rule and its constants (``params``: ``(name, value)`` pairs, in order)."""

    name: RuleName
    params: tuple[Param, ...]

    def get(self, key: str) -> float:
        value = dict(self.params)[key]
        assert not isinstance(value, tuple), key
        return value

    def tiers(self, key: str = "tiers") -> tuple[int, ...]:
        value = dict(self.params)[key]
        assert isinstance(value, tuple), key
        return tuple(int(v) for v in value)

    @property
    def cap(self) -> int:
        """The most tokens the rule ever drafts in one step."""
        if self.name in ("heuristic", "confidence"):
            return int(self.get("cap"))
        return max(self.tiers())

    @property
    def text(self) -> str:
        """``heuristic start=4 floor=1 cap=8``: the rule and its constants, as labels say it."""
        parts = []
        for key, value in self.params:
            shown = "/".join(_num(v) for v in value) if isinstance(value, tuple) else _num(value)
            parts.append(f"{key}={shown}")
        return " ".join([self.name, *parts])

    def params_json(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}

    def controller(self) -> Controller:
        return Controller(self)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def heuristic(start: int = 4, floor: int = 1, cap: int = 8, up: int = 2, down: int = 1) -> Rule:
    """Hugging Face's heuristic schedule (see the module doc)."""
    if not 1 <= floor <= start <= cap:
        raise ValueError(
            f"heuristic: expected 1 <= floor <= start <= cap, got {floor}, {start}, {cap}"
        )
    return Rule(
        "heuristic",
        (("start", start), ("floor", floor), ("cap", cap), ("up", up), ("down", down)),
    )


def ema_tiers(
    tiers: tuple[int, ...] = (1, 2, 4, 8),
    start: int = 4,
    weight: float = 0.2,
    up: float = 0.8,
    down: float = 0.4,
) -> Rule:
    """SGLang-style adaptive steps: the EMA of accepted tokens against the current depth."""
    if start not in tiers or list(tiers) != sorted(set(tiers)) or tiers[0] < 1:
        raise ValueError(f"ema_tiers: start {start} must be one of ascending tiers {tiers}")
    if not 0 < weight <= 1 or not 0 <= down < up:
        raise ValueError("ema_tiers: expected 0 < weight <= 1 and 0 <= down < up")
    return Rule(
        "ema_tiers",
        (("tiers", tuple(float(t) for t in tiers)), ("start", start), ("weight", weight),
         ("up", up), ("down", down)),
    )  # fmt: skip


def elastic(
    tiers: tuple[int, ...] = (1, 2, 4, 8),
    thresholds: tuple[float, ...] = (0.3, 0.5, 0.7),
    weight: float = 0.2,
    initial: float = 0.5,
) -> Rule:
    """vLLM's elastic speculation: an EWMA of the acceptance rate, depth by thresholds."""
    if len(thresholds) != len(tiers) - 1 or list(thresholds) != sorted(thresholds):
        raise ValueError("elastic: one ascending threshold between each pair of tiers")
    return Rule(
        "elastic",
        (("tiers", tuple(float(t) for t in tiers)), ("thresholds", tuple(thresholds)),
         ("weight", weight), ("initial", initial)),
    )  # fmt: skip


def confidence(threshold: float = 0.4, cap: int = 8) -> Rule:
    """Draft up to ``cap``, stopping after a token the drafter gave less than ``threshold``."""
    if not 0 < threshold < 1 or cap < 1:
        raise ValueError("confidence: expected 0 < threshold < 1 and cap >= 1")
    return Rule("confidence", (("threshold", threshold), ("cap", cap)))


def batch_schedule(schedule: tuple[tuple[int, int], ...]) -> Rule:
    """``((batch, k), …)``: from each batch size on, draft ``k`` (a bound: see the module doc)."""
    if not schedule or any(b < 1 or k < 0 for b, k in schedule):
        raise ValueError("batch_schedule: expected BATCH:K pairs with BATCH >= 1")
    ordered = tuple(sorted(schedule))
    return Rule(
        "batch_schedule",
        (("batches", tuple(float(b) for b, _ in ordered)),
         ("tiers", tuple(float(k) for _, k in ordered))),
    )  # fmt: skip


def replay_class(rule: Rule | None, proposer: str) -> ReplayClass:
    """What the replay of a configuration is: exact, exact given the drafter, or a bound."""
    if rule is not None and rule.name == "batch_schedule":
        return "bound"
    if proposer in ("suffix", "ngram-mod", "ngram-map-k"):
        return "exact_given_history"
    return "exact" if proposer == "ngram" else "exact_given_drafter"


class Controller:
    """One request's run of a rule: ``k`` before each step, :meth:`update` after it."""

    __slots__ = ("_ema", "_i", "_n", "rule")

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self._n = 0
        self._i = 0
        self._ema = 0.0
        if rule.name == "heuristic":
            self._n = int(rule.get("start"))
        elif rule.name == "ema_tiers":
            tiers = rule.tiers()
            self._i = tiers.index(int(rule.get("start")))
            # Start neutral: between the thresholds that would move it.
            self._ema = tiers[self._i] * (rule.get("up") + rule.get("down")) / 2
        elif rule.name == "elastic":
            self._ema = rule.get("initial")

    @property
    def k(self) -> int:
        r = self.rule
        if r.name == "heuristic":
            return self._n
        if r.name == "ema_tiers":
            return r.tiers()[self._i]
        if r.name == "elastic":
            thresholds = dict(r.params)["thresholds"]
            assert isinstance(thresholds, tuple)
            return r.tiers()[sum(self._ema >= t for t in thresholds)]
        return r.cap  # confidence: the cap, cut short by the drafter; batch: the caller's bound

    def update(self, wanted: int, drafted: int, accepted: int) -> None:
        """After a verification: ``wanted`` = :attr:`k` before the step."""
        r = self.rule
        if r.name == "heuristic":
            if drafted == wanted and accepted == wanted:
                self._n = min(int(r.get("cap")), self._n + int(r.get("up")))
            else:
                self._n = max(int(r.get("floor")), self._n - int(r.get("down")))
        elif r.name == "ema_tiers":
            if drafted == 0:
                return
            w = r.get("weight")
            self._ema = (1 - w) * self._ema + w * accepted
            tiers = r.tiers()
            k = tiers[self._i]
            if self._ema >= r.get("up") * k and self._i + 1 < len(tiers):
                self._i += 1
            elif self._ema < r.get("down") * k and self._i > 0:
                self._i -= 1
        elif r.name == "elastic":
            if drafted == 0:
                return
            w = r.get("weight")
            self._ema = (1 - w) * self._ema + w * accepted / drafted


def parse_rule(text: str) -> Rule:
    """``heuristic:start=4,floor=1,cap=8`` / ``ema_tiers:tiers=1/2/4/8`` / ``elastic`` /
    ``confidence:threshold=0.4`` / ``batch_schedule:1=8/8=4/32=2`` → a rule.

    Raises:
        ValueError: an unknown rule or parameter, naming it.
    """
    name, _, rest = text.strip().partition(":")
    kwargs: dict[str, object] = {}
    if name == "batch_schedule":
        try:
            pairs = tuple((int(b), int(k)) for b, k in (p.split("=") for p in rest.split("/") if p))
        except ValueError:
            raise ValueError(f"rule {text!r}: expected batch_schedule:BATCH=K/BATCH=K…") from None
        return batch_schedule(pairs)
    for piece in filter(None, rest.split(",")):
        key, sep, value = piece.partition("=")
        if not sep:
            raise ValueError(f"rule {text!r}: expected KEY=VALUE, got {piece!r}")
        try:
            kwargs[key] = (
                tuple(float(v) if "." in v else int(v) for v in value.split("/"))
                if "/" in value or key in ("tiers", "thresholds")
                else (float(value) if "." in value else int(value))
            )
        except ValueError:
            raise ValueError(f"rule {text!r}: {key} is not a number") from None
    makers: dict[str, Callable[..., Rule]] = {"heuristic": heuristic, "ema_tiers": ema_tiers, "elastic": elastic,
              "confidence": confidence}  # fmt: skip
    if name not in makers:
        raise ValueError(f"rule {text!r}: expected one of {', '.join(RULE_NAMES)}")
    try:
        return makers[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"rule {text!r}: {exc}") from None


DEFAULT_RULES: tuple[Rule, ...] = (heuristic(), ema_tiers(), elastic())
DRAFTER_RULES: tuple[Rule, ...] = (confidence(),)


def how_to_run(rule: Rule) -> str:
    """Where the rule runs, and how to configure it there (the policy fragment's comment)."""
    if rule.name == "heuristic":
        return (
            "Hugging Face transformers (assisted generation): generation_config."
            f"num_assistant_tokens_schedule='heuristic', num_assistant_tokens={int(rule.get('start'))}"
            " (transformers' floor is 1 and it has no cap); vLLM and SGLang draft a fixed k"
        )
    if rule.name == "ema_tiers":
        return (
            "SGLang's adaptive speculative steps (batch 1), with the constants replayed here: "
            + rule.text
        )
    if rule.name == "elastic":
        return (
            "vLLM's elastic speculation was proposed and closed, not released: no engine runs "
            "it as replayed; a vLLM candidate runs a fixed k"
        )
    if rule.name == "confidence":
        return (
            "Hugging Face transformers: generation_config.assistant_confidence_threshold="
            f"{rule.get('threshold'):g} (with num_assistant_tokens={rule.cap})"
        )
    return (
        "a batch-size schedule (vLLM's num_speculative_tokens_per_batch_size, SGLang's tiers "
        "above batch 1): a bound only, the replay cannot know each step's batch"
    )
