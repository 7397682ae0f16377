"""Rollout state: where each rule stands, and the file it survives restarts in.

:class:`RuleState` is one rule's stage, promotion step, whether a guard rolled it back, and its
last :class:`Transition`; :func:`load_state` / :func:`save_state` read and write all of them as
one JSON document (``{"version": 1, "rules": {name: state}}``), written atomically (a temporary
file in the same folder, fsync, rename) so a crash leaves the old state or the new, never half.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from core import jsonx
from policies.compiled import STAGES, RolloutSpec, Stage

log = logging.getLogger(__name__)

STATE_VERSION = 1
Actor = Literal["guard", "operator", "schedule", "policy"]


@dataclass(frozen=True, slots=True)
class Transition:
    rule: str
    from_stage: Stage
    to_stage: Stage
    serve_ratio: float
    at_unix: float
    by: Actor
    reason: str
    guard: str | None = None
    exchange_id: str | None = None  # the exchange whose evidence caused it (guards, schedule)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RuleState:
    """Where one rule's rollout stands (persisted)."""

    stage: Stage
    fingerprint: str  # of the policy block this state follows
    step: int | None = None  # promotion step index (canary with steps)
    rolled_back: bool = False
    since_unix: float = 0.0  # when this stage or step began
    served_at_step: int = 0  # candidate answers since then
    last: Transition | None = None
    # An operator's serve ratio (``promote --ratio``): replaces the policy's ratio or steps for
    # this episode, and automatic stepping stops; persisted like the rest, so a restart or a
    # reload of the same policy keeps it.
    ratio: float | None = None
    # The guards' evidence belongs to one episode: a new one starts with a changed policy block
    # or an operator's promotion (a step up or a rollback keeps it). Shared stores tag every
    # pooled observation with it (rollout.fleet).
    episode: str = ""
    # The candidate's engine configuration fingerprint this state was reached with (None: not
    # known yet). A change restarts a canary (or holds it) and lifts a guard's rollback.
    engine: str | None = None
    # The candidate's acceptance reference levels (``""``: overall, else per category) and the
    # episode they were fixed in: ``acceptance_drop`` judges against them, and a restart keeps
    # them (a level relearned after a restart would be learned from the decayed candidate).
    acceptance_levels: dict[str, float] | None = None
    acceptance_episode: str = ""

    def levels_for(self, episode: str) -> dict[str, float] | None:
        """The reference levels, if they belong to ``episode``."""
        return self.acceptance_levels if self.acceptance_episode == episode else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["last"] = self.last.to_json() if self.last is not None else None
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RuleState:
        last = data.get("last")
        return cls(
            stage=data["stage"] if data.get("stage") in STAGES else "shadow",
            fingerprint=str(data.get("fingerprint", "")),
            step=data.get("step") if isinstance(data.get("step"), int) else None,
            rolled_back=bool(data.get("rolled_back", False)),
            since_unix=float(data.get("since_unix", 0.0)),
            served_at_step=int(data.get("served_at_step", 0)),
            last=Transition(**last) if isinstance(last, Mapping) else None,
            ratio=jsonx.as_number(data.get("ratio")),
            episode=str(data.get("episode") or ""),
            engine=str(data["engine"]) if data.get("engine") else None,
            acceptance_levels=_levels(data.get("acceptance_levels")),
            acceptance_episode=str(data.get("acceptance_episode") or ""),
        )


def _levels(value: object) -> dict[str, float] | None:
    if not isinstance(value, Mapping):
        return None
    out = {str(k): float(v) for k, v in value.items() if isinstance(v, int | float) and v >= 1}
    return out or None


def serve_ratio(spec: RolloutSpec, state: RuleState) -> float:
    """The share of the rule's traffic the candidate answers in ``state``: every request in
    ``live``, the operator's ratio or the policy's (step's) ratio in ``canary``, none in
    ``shadow``. Written once: the controller's plan, its transitions and status, and the fleet's
    policy writes all read it here."""
    if state.stage == "live":
        return 1.0
    if state.stage == "canary":
        return state.ratio if state.ratio is not None else spec.ratio_at(state.step)
    return 0.0


def new_episode() -> str:
    return uuid.uuid4().hex[:16]


def load_state(path: Path | None) -> dict[str, RuleState]:
    """The persisted states (empty without a file). A damaged file must not keep the gateway
    from starting — but must not silently re-promote either: every rule then starts in the stage
    its policy states, and the problem is logged."""
    if path is None or not path.exists():
        return {}
    try:
        data = jsonx.loads(path.read_bytes())
        rules = data.get("rules", {}) if isinstance(data, dict) else {}
        return {name: RuleState.from_json(s) for name, s in rules.items()}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.error(
            "rollout state %s unreadable (%s): rollouts start as their policy says", path, exc
        )
        return {}


def save_state(path: Path | None, states: Mapping[str, RuleState]) -> None:
    """Write every rule's state atomically (nothing without a path)."""
    if path is None:
        return
    body = {"version": STATE_VERSION, "rules": {n: s.to_json() for n, s in states.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".rollout-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(jsonx.dumps(body, indent=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
