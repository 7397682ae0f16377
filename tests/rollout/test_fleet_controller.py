"""Rollout controllers sharing one SQLite store, in one process (each as a replica would be):
a promotion built on a state a rollback replaced is refused, an operator's rollback without the
store is kept and published when it returns, a new replica reads the fleet's state, and a
replica whose policy block the fleet has left holds the rule."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from policies.compile import load_policy
from policies.compiled import CompiledPolicy
from rollout.controller import RolloutConflict, RolloutController
from rollout.store import SharedStore, StoreError
from tests.rollout.test_rollout_state_file import POLICY


@dataclass
class Unplugged:
    """A real store with a plug: while pulled, every call fails as an unreachable store does."""

    store: SharedStore
    pulled: bool = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr) or name == "close":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.pulled:
                raise StoreError(f"{self.store.name}: unplugged")
            return attr(*args, **kwargs)

        return call


def load(tmp_path: Path, text: str = POLICY, generation: int = 1) -> CompiledPolicy:
    path = tmp_path / f"policy-{generation}.yaml"
    path.write_text(text)
    return replace(load_policy(path), generation=generation)  # as PolicyStore numbers them


def pause(c: RolloutController) -> None:
    """Stop a replica's sync thread: it keeps what it read, as a slow replica would."""
    assert c.fleet is not None and c.fleet._thread is not None
    c.fleet._stop.set()
    c.fleet._wake.set()
    c.fleet._thread.join(5)


def wait_stage(c: RolloutController, stage: str) -> None:
    deadline = time.monotonic() + 15  # one CI run on a loaded machine took longer than 5 s
    while c.status()["rules"]["default"]["stage"] != stage:
        assert time.monotonic() < deadline, c.status()
        time.sleep(0.02)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, CompiledPolicy, list[RolloutController]]]:
    url = f"sqlite://{tmp_path}/state.db?poll_s=0.05"
    policy = load(tmp_path)
    made: list[RolloutController] = []
    yield url, policy, made
    for c in made:
        c.close()


def replica(fleet: tuple[str, CompiledPolicy, list[RolloutController]]) -> RolloutController:
    url, policy, made = fleet
    c = RolloutController(url)
    c.reconcile(policy)
    made.append(c)
    return c


def test_a_replica_that_has_not_seen_a_rollback_cannot_undo_it(fleet: Any) -> None:
    a, b = replica(fleet), replica(fleet)
    assert b.status()["rules"]["default"]["stage"] == "canary"
    pause(b)
    a.rollback("default", "bad canary")
    assert b.status()["rules"]["default"]["stage"] == "canary"  # b has not read it yet
    with pytest.raises(RolloutConflict):
        b.promote("default", stage="live")
    assert a.status()["rules"]["default"]["stage"] == "shadow"
    assert b.fleet is not None
    b.fleet.sync()
    assert b.status()["rules"]["default"]["stage"] == "shadow"
    # Having seen it, an operator may promote again through b; a reaches the same state.
    b.promote("default", stage="canary", ratio=0.5)
    wait_stage(a, "canary")
    assert a.status()["rules"]["default"]["serve_ratio"] == 0.5
    c = replica(fleet)  # a new replica serves the fleet's state from its first request
    assert c.status()["rules"]["default"]["serve_ratio"] == 0.5


def test_an_operators_rollback_without_the_store_is_kept_and_published_when_it_returns(
    fleet: Any,
) -> None:
    a, b = replica(fleet), replica(fleet)
    assert a.fleet is not None
    plug = Unplugged(a.fleet.store)
    a.fleet.store = plug
    plug.pulled = True
    a.fleet.sync()
    assert a.store_health() is not None and a.store_health()[0] is False  # type: ignore[index]
    with pytest.raises(StoreError):
        a.promote("default", stage="live")  # would not reach the fleet: refused
    t = a.rollback("default", "store is down, roll back anyway")
    assert t.to_stage == "shadow" and a.status()["rules"]["default"]["stage"] == "shadow"
    assert a.status()["store"]["pending_decisions"] == ["default"]
    time.sleep(0.3)
    assert b.status()["rules"]["default"]["stage"] == "canary"  # not published yet
    plug.pulled = False
    wait_stage(b, "shadow")
    assert b.status()["rules"]["default"]["last_transition"]["reason"] == (
        "store is down, roll back anyway"
    )
    assert a.status()["store"]["pending_decisions"] == []


def test_a_replica_whose_policy_block_the_fleet_has_left_holds_the_rule(
    fleet: Any, tmp_path: Path
) -> None:
    url, policy, made = fleet
    a = replica(fleet)
    newer = load(tmp_path, POLICY.replace("serve_ratio: 0.3", "serve_ratio: 0.6"), 2)
    a.reconcile(newer)  # a new block: written once, the fleet follows it
    deadline = time.monotonic() + 15  # as wait_stage
    while a.status()["rules"]["default"]["serve_ratio"] != 0.6:
        assert time.monotonic() < deadline, a.status()
        time.sleep(0.02)
    stale = RolloutController(url)
    made.append(stale)
    stale.reconcile(policy)  # the block the fleet left: held, never rewritten
    rule = stale.status()["rules"]["default"]
    assert rule.get("held") is True and rule["stage"] == "shadow"
    assert a.status()["rules"]["default"]["serve_ratio"] == 0.6
