"""A fleet of rollout controllers over one real SQLite store, in one process, stepped by the test.

Each controller is a replica as ``serve --state sqlite:///…`` builds it, but with
``sync_thread=False``: it follows the store only when the test calls :meth:`sync_once`, and every
time it reads is the test's :class:`FakeClock`. So the order of events between replicas is the
test's to choose — a replica that has not read the store yet, two replicas deciding on one
version, a store that is down for one sync and back for the next — and nothing waits on a thread
or a wall clock. What only real processes show (sockets, SIGKILL, a ClickHouse server stopped)
stays in tests/e2e/test_fleet_rollout.py and test_fleet_store_down.py.

Shown here, each against ground truth the test computes itself (the store's own rows, the
policy's sampling function, the exchanges it fed):

- **propagation**: a change through one replica — an operator's, a policy's, a guard's — is
  served by every other after its next sync; a new replica serves the fleet's state from its
  first request; the guards of every replica judge the pooled observations of all of them, one
  test with the same e-values everywhere;
- **rollback wins**: a replica that has not seen a rollback cannot undo it (its promotion, its
  held step are refused), and adopts it on its next sync;
- **a step is taken once**: not before ``hold.min_s`` on the controllers' clock, and when two
  replicas decide the same held step on one version, one compare-and-set lands;
- **a stale policy block is held**: a replica whose block the fleet has left holds the rule in
  shadow and never rewrites the store;
- **fail static**: the store down, every replica keeps serving its last decision and keeps its
  observations, its local guards roll it back on their own, an operator's rollback is kept, a
  promotion refused; the store back, each decision is published once and every observation
  reaches the pooled log.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from core.evidence import Evidence
from core.exchange import Role
from evidence.worker import build_evidence
from policies.compile import load_policy
from policies.compiled import CompiledPolicy, RequestFacts
from policies.sample import sample_unit
from rollout.controller import RolloutConflict, RolloutController
from rollout.state import Transition
from rollout.store import SharedStore, StoreError
from tests.evidence.legs import exchange, leg
from tests.rollout.test_rollout_state_file import POLICY

# Guards that hold on the identical legs tests.evidence.legs builds (one token per event: the
# tokens-per-event floor is off), and fire on a candidate that fails every request.
GUARDS = "{min_samples: 5, window: 60, tokens_per_event_min: null, kv_usage_max: null}"
STEPPED = POLICY.replace(
    "rollout: {stage: canary, serve_ratio: 0.3}",
    "rollout: {stage: canary, steps: [0.2, 0.5], hold: {min_requests: 10, min_s: 60}, "
    f"guards: {GUARDS}}}",
)
GUARDED = POLICY.replace(
    "rollout: {stage: canary, serve_ratio: 0.3}",
    f"rollout: {{stage: canary, serve_ratio: 0.3, guards: {GUARDS}}}",
)


@dataclass
class FakeClock:
    """The controllers' clock: seconds since the epoch, moved only by the test."""

    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Plug:
    """Between a replica and the real store: while pulled, every call fails as an unreachable
    store does; while ``stale`` holds heads, :meth:`current` answers them (the replica's read
    landed before another replica's write)."""

    store: SharedStore
    pulled: bool = False
    stale: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr) or name == "close":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.pulled:
                raise StoreError(f"{self.store.name}: unplugged")
            if name == "current" and self.stale is not None:
                return dict(self.stale)
            return attr(*args, **kwargs)

        return call


@dataclass
class StoreTelemetry:
    """What the controller tells telemetry about the store (``specshadow_rollout_store_up``)."""

    store_up: list[bool] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)

    def rollout_stage(self, rule: str, stage: str, serve_ratio: float) -> None:
        pass

    def rollout_guards(self, rule: str, guards: Any) -> None:
        pass

    def rollout_drift(self, rule: str, guard: str, action: str) -> None:
        pass

    def rollout_transition(self, t: Transition, traceparent: str | None) -> None:
        self.transitions.append(t)

    def rollout_store(self, store: str, up: bool) -> None:
        self.store_up.append(up)


@dataclass
class Rig:
    """Replicas sharing ``url`` under one clock; each with a plug between it and the store."""

    url: str
    tmp: Path
    clock: FakeClock = field(default_factory=FakeClock)
    made: list[RolloutController] = field(default_factory=list)
    plugs: dict[int, Plug] = field(default_factory=dict)
    telemetry: dict[int, StoreTelemetry] = field(default_factory=dict)
    generation: int = 0
    fed: int = 0

    def policy(self, text: str = POLICY) -> CompiledPolicy:
        self.generation += 1
        path = self.tmp / f"policy-{self.generation}.yaml"
        path.write_text(text)
        return replace(load_policy(path), generation=self.generation)  # as PolicyStore numbers

    def replica(self, policy: CompiledPolicy) -> RolloutController:
        """A replica started on ``policy``: it reads the store once, as ``serve`` does."""
        t = StoreTelemetry()
        c = RolloutController(self.url, clock=self.clock, sync_thread=False, telemetry=t)
        assert c.fleet is not None
        plug = Plug(c.fleet.store)
        c.fleet.store = plug  # the real store, behind a plug the test may pull
        self.plugs[id(c)], self.telemetry[id(c)] = plug, t
        c.reconcile(policy)
        self.made.append(c)
        return c

    def plug(self, c: RolloutController) -> Plug:
        return self.plugs[id(c)]

    def feed(self, c: RolloutController, n: int, *, fails: bool = False,
             served_by: Role = "primary") -> None:  # fmt: skip
        """``n`` finished exchanges of the rule, as ``c``'s evidence worker hands them on."""
        for _ in range(n):
            self.fed += 1
            c.handle(evidence(self.fed, fails=fails, served_by=served_by))

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        """The store's own rows, read on a connection of the test's."""
        with sqlite3.connect(self.tmp / "state.db") as db:
            return list(db.execute(sql))


def evidence(i: int, *, fails: bool, served_by: Role) -> Evidence:
    candidate = leg("candidate", backend="cand")
    if fails:
        candidate = replace(candidate, status=500)
    x = exchange(i, primary=leg("primary", backend="prim"), shadows=(candidate,))
    return build_evidence(replace(x, served_by=served_by))


def rule(c: RolloutController) -> dict[str, Any]:
    return dict(c.status()["rules"]["default"])


def served_share(c: RolloutController, policy: CompiledPolicy, n: int = 1000) -> set[int]:
    """Which of ``n`` requests the candidate answers on ``c`` (by request id: the sampling key)."""
    out = set()
    for i in range(n):
        facts = RequestFacts("chat", "m", True, {}, 10, "chat", f"r{i}", 0)
        if c.plan(policy, policy.decide(facts), facts) is not None:
            out.add(i)
    return out


def canary_share(ratio: float, n: int = 1000) -> set[int]:
    """The requests a canary at ``ratio`` answers: the policy's sticky sampling, computed here."""
    return {i for i in range(n) if sample_unit("default/serve", f"r{i}") < ratio}


def history(fleet: Rig) -> list[tuple[str, str]]:
    """The store's chain of the rule: (stage, the reason of the change), oldest first."""
    rows = fleet.rows("SELECT state FROM rollout_log WHERE rule = 'default' ORDER BY version")
    return [(s["stage"], s["last"]["reason"]) for (text,) in rows for s in [json.loads(text)]]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Rig]:
    f = Rig(f"sqlite://{tmp_path}/state.db", tmp_path)
    yield f
    for c in f.made:
        c.close()


def test_a_replica_that_has_not_seen_a_rollback_cannot_undo_it(fleet: Rig) -> None:
    policy = fleet.policy()
    a, b = fleet.replica(policy), fleet.replica(policy)
    assert rule(b)["stage"] == "canary"
    a.rollback("default", "bad canary")
    assert rule(b)["stage"] == "canary"  # b has not read it yet
    with pytest.raises(RolloutConflict):
        b.promote("default", stage="live")  # built on the version the rollback replaced
    assert rule(a)["stage"] == "shadow"
    b.sync_once()
    assert rule(b)["stage"] == "shadow" and rule(b)["rolled_back"] is True
    assert served_share(b, policy) == set()
    # Having seen it, an operator may promote again through b; a serves it after its next sync.
    b.promote("default", stage="canary", ratio=0.5)
    assert rule(a)["stage"] == "shadow"
    a.sync_once()
    assert rule(a)["stage"] == "canary" and rule(a)["serve_ratio"] == 0.5
    assert served_share(a, policy) == served_share(b, policy) == canary_share(0.5)
    c = fleet.replica(policy)  # a new replica serves the fleet's state from its first request
    assert rule(c)["serve_ratio"] == 0.5 and served_share(c, policy) == canary_share(0.5)
    assert history(fleet) == [
        ("canary", "policy"),
        ("shadow", "bad canary"),
        ("canary", "promoted to canary"),
    ]  # the refused promotion wrote nothing


def test_a_guards_rollback_on_the_pooled_evidence_is_written_once_and_reaches_every_replica(
    fleet: Rig,
) -> None:
    policy = fleet.policy(GUARDED)
    a, b = fleet.replica(policy), fleet.replica(policy)
    fleet.feed(a, 6)
    fleet.feed(b, 6)
    a.sync_once()
    b.sync_once()
    a.sync_once()
    # One test, not two: each replica's guards read all twelve exchanges, with the same e-values.
    guards = [[(g["guard"], g["bound"], g["samples"]) for g in rule(c)["guards"]] for c in (a, b)]
    assert guards[0] == guards[1]
    assert {g: n for g, _, n in guards[0]}["error_rate_delta"] == 12
    assert fleet.rows("SELECT count(*) FROM rollout_evidence") == [(12,)]

    # The candidate starts failing; each replica sees half of it. Ten failures are not enough
    # for a's guards on the store's log (a's half published, b's not yet), twenty are.
    for _ in range(10):
        fleet.feed(a, 1, fails=True)
        fleet.feed(b, 1, fails=True)
    assert rule(a)["stage"] == rule(b)["stage"] == "canary"  # decided on the pooled log only
    a.sync_once()  # a publishes its half and judges what the store holds: not yet a breach
    assert rule(a)["stage"] == "canary"
    b.sync_once()  # b publishes its half, judges both, and writes the rollback
    t = rule(b)["last_transition"]
    assert (rule(b)["stage"], t["by"], t["guard"]) == ("shadow", "guard", "error_rate_delta")
    assert t["exchange_id"] is not None and int(t["exchange_id"].split("-")[1]) > 12
    assert rule(a)["stage"] == "canary"  # a has not read it yet
    a.sync_once()
    assert rule(a)["stage"] == "shadow" and rule(a)["last_transition"] == t
    assert served_share(a, policy) == served_share(b, policy) == set()
    assert [stage for stage, _ in history(fleet)] == ["canary", "shadow"]  # written once
    # Each change is an event of the replica that wrote it; the others adopt it as news.
    assert [x.by for x in fleet.telemetry[id(a)].transitions] == ["policy"]
    assert [x.by for x in fleet.telemetry[id(b)].transitions] == ["guard"]
    assert fleet.rows("SELECT count(*) FROM rollout_evidence") == [(32,)]


def test_a_step_is_taken_after_its_hold_and_once_when_two_replicas_decide_it(fleet: Rig) -> None:
    policy = fleet.policy(STEPPED)
    a, b = fleet.replica(policy), fleet.replica(policy)
    assert rule(a)["serve_ratio"] == 0.2 and served_share(a, policy) == canary_share(0.2)
    fleet.feed(a, 6, served_by="candidate")
    fleet.feed(b, 6, served_by="candidate")
    for c in (a, b):
        c.sync_once()
    assert rule(a)["step"] == 0  # twelve answers, guards green, but 60 s have not passed
    fleet.clock.advance(59.0)
    for c in (a, b):
        c.sync_once()
    assert rule(a)["step"] == rule(b)["step"] == 0

    # The hold is met for both. b's read of the head lands before a's write (b's plug answers
    # what it had read): both decide the step on one version; one compare-and-set lands.
    fleet.plug(b).stale = fleet.plug(b).store.current()
    fleet.clock.advance(1.0)
    a.sync_once()
    assert rule(a)["step"] == 1 and rule(a)["serve_ratio"] == 0.5
    b.sync_once()  # decides the same step on the version a replaced: refused, nothing written
    assert rule(b)["step"] == 0
    fleet.plug(b).stale = None
    b.sync_once()
    assert rule(b)["step"] == 1 and served_share(b, policy) == canary_share(0.5)
    assert history(fleet) == [
        ("canary", "policy"),
        ("canary", "step 2/2: held 12 answers, guards green"),
    ]
    assert rule(b)["since_unix"] == fleet.clock.now  # the step began on the controllers' clock


def test_a_held_step_built_on_a_state_a_rollback_replaced_is_refused(fleet: Rig) -> None:
    policy = fleet.policy(STEPPED)
    a, b = fleet.replica(policy), fleet.replica(policy)
    fleet.feed(b, 12, served_by="candidate")
    b.sync_once()
    a.sync_once()
    fleet.plug(b).stale = fleet.plug(b).store.current()
    a.rollback("default", "operator saw something")
    fleet.clock.advance(60.0)
    b.sync_once()  # b's hold is met on the version the rollback replaced
    assert rule(b)["stage"] == "canary" and rule(b)["step"] == 0
    fleet.plug(b).stale = None
    b.sync_once()
    assert rule(b)["stage"] == "shadow" and rule(b)["rolled_back"] is True
    assert [stage for stage, _ in history(fleet)] == ["canary", "shadow"]


def test_an_operators_rollback_without_the_store_is_kept_and_published_when_it_returns(
    fleet: Rig,
) -> None:
    policy = fleet.policy()
    a, b = fleet.replica(policy), fleet.replica(policy)
    fleet.plug(a).pulled = True
    a.sync_once()
    health = a.store_health()
    assert health is not None and health[0] is False and "serving the last decision" in health[1]
    assert a.status()["store"]["up"] is False and fleet.telemetry[id(a)].store_up == [True, False]
    assert served_share(a, policy) == canary_share(0.3)  # the last decision still serves
    with pytest.raises(StoreError):
        a.promote("default", stage="live")  # would not reach the fleet: refused
    t = a.rollback("default", "store is down, roll back anyway")
    assert t.to_stage == "shadow" and rule(a)["stage"] == "shadow"
    assert served_share(a, policy) == set()  # this replica stops serving it at once
    assert a.status()["store"]["pending_decisions"] == ["default"]
    a.sync_once()  # still down: still pending
    b.sync_once()
    assert rule(b)["stage"] == "canary"  # not published yet
    assert [stage for stage, _ in history(fleet)] == ["canary"]
    fleet.plug(a).pulled = False
    a.sync_once()
    assert a.status()["store"]["pending_decisions"] == [] and a.status()["store"]["up"] is True
    assert fleet.telemetry[id(a)].store_up == [True, False, True]
    assert rule(b)["stage"] == "canary"  # b reads it on its next sync
    b.sync_once()
    assert rule(b)["stage"] == "shadow"
    assert rule(b)["last_transition"]["reason"] == "store is down, roll back anyway"
    assert history(fleet) == [("canary", "policy"), ("shadow", "store is down, roll back anyway")]


def test_without_the_store_replicas_keep_serving_and_their_local_guards_act_then_publish(
    fleet: Rig,
) -> None:
    policy = fleet.policy(GUARDED)
    a, b = fleet.replica(policy), fleet.replica(policy)
    fleet.feed(a, 10)
    fleet.feed(b, 10)
    for c in (a, b):
        c.sync_once()
    for c in (a, b):
        fleet.plug(c).pulled = True
        c.sync_once()
        assert c.store_health() is not None and c.store_health()[0] is False  # type: ignore[index]
    # The last decision holds: each replica answers the canary's share, and keeps what it sees.
    fleet.feed(a, 10)
    fleet.feed(b, 10)
    for c in (a, b):
        c.sync_once()
        assert served_share(c, policy) == canary_share(0.3)
        assert c.status()["store"]["unpublished_observations"] == 10
    # The candidate fails: each replica's local guards roll it back on their own.
    rolled: dict[int, int] = {}
    for n in range(1, 201):
        for c in (a, b):
            if id(c) not in rolled:
                fleet.feed(c, 1, fails=True)
                if rule(c)["stage"] == "shadow":
                    rolled[id(c)] = n
        if len(rolled) == 2:
            break
    assert len(rolled) == 2, "the local guards never acted without the store"
    for c in (a, b):
        t = rule(c)["last_transition"]
        assert t["by"] == "guard" and "store is unreachable" in t["reason"]
        assert c.status()["store"]["pending_decisions"] == ["default"]
        assert served_share(c, policy) == set()
    assert [stage for stage, _ in history(fleet)] == ["canary"]  # nothing reached the store
    observed = {id(c): c.status()["store"]["observations"] for c in (a, b)}

    for c in (a, b):
        fleet.plug(c).pulled = False
    a.sync_once()  # a publishes its observations and its rollback
    b.sync_once()  # b publishes its observations, finds the fleet rolled back: adopts it
    for c in (a, b):
        store = c.status()["store"]
        assert store["up"] is True and store["pending_decisions"] == []
        assert store["unpublished_observations"] == store["dropped_observations"] == 0
        assert (
            rule(c)["stage"] == "shadow"
            and "store is unreachable" in (rule(c)["last_transition"]["reason"])
        )
    assert [stage for stage, _ in history(fleet)] == ["canary", "shadow"]  # published once
    # Nothing observed while it was down is lost: every exchange fed reached the pooled log.
    assert fleet.rows("SELECT count(*) FROM rollout_evidence") == [(fleet.fed,)]
    assert sum(observed.values()) == fleet.fed


def test_a_replica_whose_policy_block_the_fleet_has_left_holds_the_rule(fleet: Rig) -> None:
    policy = fleet.policy()
    a = fleet.replica(policy)
    newer = fleet.policy(POLICY.replace("serve_ratio: 0.3", "serve_ratio: 0.6"))
    a.reconcile(newer)  # a new block: held here until the sync writes it
    assert rule(a).get("held") is True and served_share(a, newer) == set()
    a.sync_once()  # written once; the fleet follows it
    assert rule(a)["serve_ratio"] == 0.6 and served_share(a, newer) == canary_share(0.6)
    stale = fleet.replica(policy)  # the block the fleet left: held, never rewritten
    stale.sync_once()
    stale_rule = rule(stale)
    assert stale_rule.get("held") is True and stale_rule["stage"] == "shadow"
    assert served_share(stale, policy) == set()
    a.sync_once()
    assert rule(a)["serve_ratio"] == 0.6
    assert [reason for _, reason in history(fleet)] == ["policy", "policy rollout block changed"]
