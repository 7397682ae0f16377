"""One rollout controller (its JSON state file) driven by the test: exchanges handed to it as the
evidence worker hands them, its clock a fake one the test moves, restarts and reloads as new
controllers and new policy generations. The control-plane halves of tests/gateway/test_rollout.py
(which shows the same over real sockets), with no wait on a thread or a wall clock:

- a step is taken when it held ``hold.min_requests`` candidate answers *and* ``hold.min_s``
  seconds on the controller's clock, not an answer or a second before; after the last, ``live``;
- a rollback is sticky across a restart and a reload of the same block; an operator's promotion
  lifts it; a changed block starts from what the new policy says;
- an operator's serve ratio survives a reload and a restart, and the steps stop there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from policies.compile import load_policy
from policies.compiled import CompiledPolicy
from rollout.controller import RolloutController
from rollout.state import load_state
from tests.rollout.test_fleet_controller import (
    GUARDS,
    FakeClock,
    StoreTelemetry,
    canary_share,
    evidence,
    served_share,
)
from tests.rollout.test_rollout_state_file import POLICY

STEPS = POLICY.replace(
    "rollout: {stage: canary, serve_ratio: 0.3}",
    "rollout: {stage: canary, steps: [0.2, 0.5, 1.0], hold: {min_requests: 8, min_s: 30}, "
    f"guards: {GUARDS}}}",
)


class Replica:
    """A controller on ``tmp/rollout.json`` under ``clock``; ``start`` again is a restart."""

    def __init__(self, tmp: Path, clock: FakeClock) -> None:
        self.tmp, self.clock, self.generation, self.fed = tmp, clock, 0, 0
        self.telemetry = StoreTelemetry()
        self.c = self.start()

    def start(self) -> RolloutController:
        self.c = RolloutController(
            self.tmp / "rollout.json", clock=self.clock, telemetry=self.telemetry
        )
        return self.c

    def policy(self, text: str) -> CompiledPolicy:
        self.generation += 1
        path = self.tmp / f"policy-{self.generation}.yaml"
        path.write_text(text)
        return replace(load_policy(path), generation=self.generation)

    def answer(self, n: int) -> None:
        """``n`` exchanges answered by the candidate, each with the primary behind it."""
        for _ in range(n):
            self.fed += 1
            self.c.handle(evidence(self.fed, fails=False, served_by="candidate"))

    def rule(self) -> dict[str, object]:
        return dict(self.c.status()["rules"]["default"])


def test_a_step_waits_for_its_answers_and_its_seconds_then_the_last_goes_live(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    r = Replica(tmp_path, clock)
    policy = r.policy(STEPS)
    r.c.reconcile(policy)
    assert (r.rule()["step"], r.rule()["serve_ratio"]) == (0, 0.2)
    assert served_share(r.c, policy) == canary_share(0.2)
    r.answer(20)  # answers enough, guards green: 0 s have passed
    assert r.rule()["step"] == 0
    clock.advance(29.9)
    r.answer(1)
    assert r.rule()["step"] == 0
    clock.advance(0.1)  # 30 s: the next answer takes the step
    r.answer(1)
    assert (r.rule()["step"], r.rule()["serve_ratio"]) == (1, 0.5)
    assert r.rule()["since_unix"] == clock.now and r.rule()["served_at_step"] == 0
    clock.advance(60.0)  # the seconds, not yet the answers
    r.answer(7)
    assert r.rule()["step"] == 1 and r.rule()["served_at_step"] == 7
    r.answer(1)  # the eighth
    assert (r.rule()["step"], r.rule()["serve_ratio"]) == (2, 1.0)
    clock.advance(30.0)
    r.answer(8)
    assert (r.rule()["stage"], r.rule()["serve_ratio"]) == ("live", 1.0)
    assert served_share(r.c, policy) == set(range(1000))  # live: the candidate answers all
    assert [(t.to_stage, t.by, t.reason) for t in r.telemetry.transitions] == [
        ("canary", "policy", "policy"),
        ("canary", "schedule", "step 2/3: held 22 answers, guards green"),
        ("canary", "schedule", "step 3/3: held 8 answers, guards green"),
        ("live", "schedule", "the last step held with guards green"),
    ]
    assert [t.at_unix for t in r.telemetry.transitions][1:] == [
        clock.now - 90.0,
        clock.now - 30.0,
        clock.now,
    ]  # each at the controller's clock
    assert load_state(tmp_path / "rollout.json")["default"].stage == "live"  # persisted


def test_a_rollback_survives_a_restart_and_a_reload_and_a_changed_block_starts_anew(
    tmp_path: Path,
) -> None:
    r = Replica(tmp_path, FakeClock())
    r.c.reconcile(r.policy(POLICY))
    t = r.c.rollback("default", "drill")
    assert (t.to_stage, t.by) == ("shadow", "operator")
    r.start()  # a restart: the state file says rolled back
    policy = r.policy(POLICY)
    r.c.reconcile(policy)
    assert (r.rule()["stage"], r.rule()["rolled_back"]) == ("shadow", True)
    assert served_share(r.c, policy) == set()
    same = r.policy(POLICY + "# reloaded: same rollout block\n")
    r.c.reconcile(same)
    assert (r.rule()["stage"], r.rule()["rolled_back"]) == ("shadow", True)  # no re-promotion
    t = r.c.promote("default")
    assert (t.to_stage, r.rule()["rolled_back"]) == ("canary", False)
    r.c.rollback("default")
    changed = r.policy(POLICY.replace("serve_ratio: 0.3", "serve_ratio: 0.5"))
    r.c.reconcile(changed)  # a policy that says so promotes again
    assert (r.rule()["stage"], r.rule()["serve_ratio"]) == ("canary", 0.5)
    assert served_share(r.c, changed) == canary_share(0.5)
    assert load_state(tmp_path / "rollout.json")["default"].stage == "canary"


def test_an_operators_serve_ratio_survives_reload_and_restart_and_stops_the_steps(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    r = Replica(tmp_path, clock)
    r.c.reconcile(r.policy(STEPS))
    t = r.c.promote("default", stage="canary", ratio=0.4)
    assert t.serve_ratio == 0.4
    r.c.reconcile(r.policy(STEPS + "# reloaded: same rollout block\n"))
    assert r.rule()["serve_ratio"] == 0.4
    r.start()  # a restart reads the state file
    policy = r.policy(STEPS)
    r.c.reconcile(policy)
    assert (r.rule()["stage"], r.rule()["serve_ratio"]) == ("canary", 0.4)
    for _ in range(3):  # every hold met, over and over: the steps would have moved on by now
        clock.advance(31.0)
        r.answer(10)
    assert (r.rule()["stage"], r.rule()["serve_ratio"]) == ("canary", 0.4)
    assert served_share(r.c, policy) == canary_share(0.4)
