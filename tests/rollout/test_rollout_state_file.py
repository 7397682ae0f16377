"""The rollout state file is written outside the controller's lock (the event loop takes that
lock): a slow disk never stalls whoever takes it, and an older snapshot never overwrites a newer."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import pytest

import rollout.controller as rollout_module
from policies.compile import load_policy
from rollout.controller import RolloutController
from rollout.state import RuleState, load_state, save_state as real_save

POLICY = """version: 1
backends:
  prim: {url: 'http://127.0.0.1:9', kind: sim}
  cand: {url: 'http://127.0.0.1:10', kind: sim}
primary: prim
default:
  ratio: 1.0
  legs: [{backend: cand, role: candidate}]
  rollout: {stage: canary, serve_ratio: 0.3}
"""


def test_a_slow_state_write_holds_no_lock_and_the_newest_state_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(POLICY)
    state_path = tmp_path / "rollout.json"
    controller = RolloutController(state_path)
    controller.reconcile(load_policy(policy_path))
    (name,) = controller.status()["rules"]
    assert load_state(state_path)[name].stage == "canary"

    writing, release = threading.Event(), threading.Event()
    written: list[str] = []

    def slow_save(path: Path | None, states: Mapping[str, RuleState]) -> None:
        writing.set()
        assert release.wait(10), "the test never released the write"
        written.append(states[name].stage)
        real_save(path, states)

    monkeypatch.setattr(rollout_module, "save_state", slow_save)
    operator = threading.Thread(target=controller.rollback, args=(name,))
    operator.start()
    try:
        assert writing.wait(10), "the rollback never wrote the state file"
        # The rollback's write is in progress: the lock is free — the status answers, and a
        # newer change goes through without waiting for that write. Each on a thread of its
        # own, so one that did wait fails here instead of hanging the test (10 s is a liveness
        # bound, not a timing claim).
        seen: list[str] = []
        for step in (
            lambda: seen.append(controller.status()["rules"][name]["stage"]),
            lambda: controller.promote(name, stage="live"),
        ):
            caller = threading.Thread(target=step)
            caller.start()
            caller.join(10)
            assert not caller.is_alive(), "waited for another change's state write"
        assert seen == ["shadow"]
        assert controller.status()["rules"][name]["stage"] == "live"
        assert written == []  # the slow write still holds the rollback's snapshot
    finally:
        release.set()
        operator.join(10)
    assert not operator.is_alive()
    # Written in order: the rollback's snapshot, then the promotion's — the newest last.
    assert written == ["shadow", "live"]
    assert load_state(state_path)[name].stage == "live"
