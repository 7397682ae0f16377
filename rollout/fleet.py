"""One rollout decision for a fleet of gateways sharing a store (``--state sqlite:///…`` or
``clickhouse://…``; the store is :mod:`rollout.store`).

Every replica runs the same :class:`Fleet` beside its :class:`~rollout.controller.RolloutController`:

- **One state.** The store's chain of states is the fleet's decision. A replica serves what it
  last read from the store (a rule whose store state follows another policy block is held in
  shadow until they agree); every change — a guard's rollback, a promotion step, an operator's
  action, a new policy block — is a compare-and-set on the version the replica read, so a
  replica that has not seen a rollback cannot undo it, and a step is taken once.
- **Pooled evidence, one test.** Each replica appends its observations (one row per exchange of
  a rolling-out rule, tagged with the rule's episode) to the store; every replica reads the
  episode's rows in the store's order and feeds them to one :class:`~rollout.guards.GuardBank`.
  The e-process is a function of that ordered stream alone, so every replica computes the same
  one — no leader, no lease — and its guarantee is the one-gateway guarantee over the pooled
  stream: P(an identical candidate is ever rolled back) ≤ α_pooled whatever the number of
  replicas. The first replica to see the breach writes the rollback; the others' writes at the
  same version fail and they adopt it.
- **Fail static.** The store unreachable: the replica keeps the state it last read, says so
  (``specshadow_rollout_store_up`` 0, ``/readyz`` and ``/admin/rollout`` detail, one log line),
  keeps its observations for later, and its **local** bank — the same guards on its own
  observations — may roll it back on its own. Such a decision is published (a compare-and-set
  on the version it had read, if the store's episode is still that one) when the store returns.

**The false-alarm budget.** ``α = 1 − confidence`` is split: the pooled test gets
``(1 − LOCAL_SHARE)·α``; the local bank of the replica that registered ``k``-th with the store
gets ``LOCAL_SHARE·α·6/(π²k²)`` (Σ 6/(π²k²) = 1). By the union bound, P(an identical candidate
is ever rolled back anywhere) ≤ α over any number of replicas, started and restarted in any
order. A replica that never reached the store has no state to serve a candidate with.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from core import jsonx
from core.evidence import LegQuality
from policies.compiled import GuardSpec, RolloutSpec
from rollout.guards import GuardBank, Observation
from rollout.state import RuleState, Transition, new_episode, serve_ratio
from rollout.store import Cursor, SharedStore, StoredState, StoreError

if TYPE_CHECKING:
    from rollout.controller import RolloutController

log = logging.getLogger(__name__)

LOCAL_SHARE = 0.1  # of α, for every replica's local guards together
OUTBOX_MAX = 100_000  # observations kept while the store is unreachable
READ_BATCH = 5000
MIN_GAP_S = 0.02  # between two syncs woken by new observations


def pooled_spec(spec: GuardSpec) -> GuardSpec:
    """The pooled test's guards: ``(1 − LOCAL_SHARE)`` of the rule's α."""
    return replace(spec, confidence=1.0 - (1.0 - spec.confidence) * (1.0 - LOCAL_SHARE))


def local_spec(spec: GuardSpec, k: int) -> GuardSpec:
    """The ``k``-th replica's local guards: ``LOCAL_SHARE·α·6/(π²k²)``."""
    alpha = (1.0 - spec.confidence) * LOCAL_SHARE * 6.0 / (math.pi**2 * k * k)
    return replace(spec, confidence=1.0 - alpha)


def encode(o: Observation, exchange_id: str | None, traceparent: str | None) -> bytes:
    return jsonx.dumps({"o": asdict(o), "x": exchange_id, "t": traceparent})


def decode(body: bytes) -> tuple[Observation, str | None, str | None]:
    data = jsonx.loads(body)
    o = dict(data["o"])
    for key in ("candidate_output", "baseline_output", "primary_output"):
        if isinstance(o.get(key), Mapping):
            q = LegQuality(**o[key])  # JSON gave the sketch back as a list
            o[key] = replace(q, sketch=tuple(q.sketch) if q.sketch is not None else None)
    return Observation(**o), data.get("x"), data.get("t")


@dataclass(slots=True)
class Pooled:
    """One rule's pooled test over one episode, and where this replica is in its log."""

    episode: str
    bank: GuardBank
    cursor: Cursor | None = None
    served: int = 0  # candidate answers in the pooled log since the state's step began
    since: float = 0.0  # the step those answers count for (``RuleState.since_unix``)


@dataclass(slots=True)
class StoreHealth:
    up: bool = False
    since: float = 0.0
    error: str | None = None
    syncs: int = 0
    last_sync_unix: float | None = None


@dataclass(slots=True)
class Fleet:
    """See the module doc. The controller calls :meth:`observe` (evidence thread) and
    :meth:`commit` (under its lock); :meth:`sync_once` — one step, run by the sync thread or
    called directly — calls back into the controller."""

    controller: RolloutController
    store: SharedStore
    poll_s: float
    replica: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    )
    k: int | None = None  # incarnation: the k-th replica registered with the store
    heads: dict[str, StoredState] = field(default_factory=dict)  # what each adopted state is
    pooled: dict[str, Pooled] = field(default_factory=dict)
    local: dict[str, tuple[str, GuardBank | None]] = field(default_factory=dict)  # (episode, bank)
    pending: dict[str, RuleState] = field(default_factory=dict)  # decided while the store was down
    health: StoreHealth = field(default_factory=StoreHealth)
    outbox: deque[tuple[str, str, str, int, bytes]] = field(
        default_factory=lambda: deque(maxlen=OUTBOX_MAX)
    )
    dropped: int = 0
    published: int = 0  # observations appended to the store
    _seq: int = 0  # observations queued (each one's number)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: bool = False
    _warned: set[str] = field(default_factory=set)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, *, thread: bool = True) -> None:
        """Read the store once (a restarted replica serves the fleet's state from its first
        request), then follow it: on a thread that repeats :meth:`sync_once`, or — ``thread``
        False — only when the owner calls :meth:`sync_once` (a test steps replicas in an order
        it chooses, under the controller's clock)."""
        if self._started:
            return
        self._started = True
        self.sync_once()
        if thread:
            self._thread = threading.Thread(target=self._run, name="rollout-fleet", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with contextlib.suppress(StoreError):
            self._flush()
        self.store.close()

    def _run(self) -> None:
        """The sync thread: :meth:`sync_once` every ``poll_s``, or at once when new observations
        or a lost compare-and-set wake it (at most once per ``MIN_GAP_S``)."""
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            started = time.monotonic()
            try:
                self.sync_once()
            except Exception:  # the thread must outlive any surprise; the next sync retries
                log.exception("rollout fleet sync failed")
            self._stop.wait(max(0.0, MIN_GAP_S - (time.monotonic() - started)))

    # -- the evidence thread --------------------------------------------------------------------

    def observe(self, rule: str, spec: RolloutSpec, o: Observation, exchange_id: str | None,
                traceparent: str | None) -> RuleState | None:  # fmt: skip
        """Queue ``o`` for the store and feed the local bank (the caller holds the controller's
        lock). Returns the rollback the local bank decided while the store is unreachable."""
        state = self.controller._states.get(rule)
        if state is None:
            return None
        if len(self.outbox) == self.outbox.maxlen:
            self.dropped += 1
        self._seq += 1
        self.outbox.append(
            (rule, state.episode, self.replica, self._seq, encode(o, exchange_id, traceparent))
        )
        self._wake.set()
        if self.k is None:
            return None
        guards = local_spec(spec.guards, self.k)
        episode, bank = self.local.get(rule, ("", None))
        if bank is None or episode != state.episode or bank.spec != guards:
            bank = GuardBank(guards)
            self.local[rule] = (state.episode, bank)
        bank.update(o)
        if self.health.up or state.stage == "shadow" or bank.breached() is None:
            return None
        return state

    # -- the sync thread ------------------------------------------------------------------------

    def _flush(self) -> None:
        while self.outbox:
            batch = [self.outbox[i] for i in range(min(len(self.outbox), READ_BATCH))]
            self.store.append(batch)
            for _ in batch:
                self.outbox.popleft()
            self.published += len(batch)

    def sync_once(self) -> None:
        """One step of following the store: publish what is queued, read the fleet's state and
        pooled evidence, decide (a rollback or a held step: a compare-and-set), and note whether
        the store answered. Times are the controller's clock."""
        c = self.controller
        try:
            if self.k is None:
                self.k = self.store.register(self.replica, c.clock())
            self._flush()
            heads = self.store.current()
            with c._lock:
                for name in list(c._specs):
                    self._sync_rule(name, heads.get(name))
                c._publish()
        except StoreError as exc:
            self._down(str(exc))
            return
        self._up()

    def _sync_rule(self, name: str, head: StoredState | None) -> None:
        c = self.controller
        rule = c._specs[name]
        spec = rule.rollout
        assert spec is not None
        if head is None or head.state.fingerprint != spec.fingerprint:
            self._policy(name, spec, head)
            return
        pending = self.pending.pop(name, None)
        if (
            pending is not None
            and pending.episode == head.state.episode
            and head.state.stage != "shadow"
        ):
            published = self.store.cas(name, head, pending, self.replica)
            if published is None:
                self.pending[name] = pending  # the head moved: try again on the next one
                return
            head = published
            log.warning(
                "rollout %s: the rollback decided while the store was unreachable is published",
                name,
            )
        if self.heads.get(name) != head:
            self.adopt(name, head)
        self._judge(name, spec, head)

    def _policy(self, name: str, spec: RolloutSpec, head: StoredState | None) -> None:
        """The local policy's block differs from the store's: write it if it is new to the
        store, else hold the rule (this replica's policy is behind, or went back to a block the
        fleet left: an operator decides)."""
        c = self.controller
        c._states.pop(name, None)
        self.heads.pop(name, None)
        if head is not None and any(
            s.state.fingerprint == spec.fingerprint for s in self.store.history(name)
        ):
            if name not in self._warned:
                self._warned.add(name)
                log.error(
                    "rollout %s: this replica's policy block is one the fleet has left (the store "
                    "follows another): the rule is held in shadow here until the policies agree",
                    name,
                )
            return
        self._warned.discard(name)
        now = c.clock()
        step = 0 if spec.steps and spec.stage == "canary" else None
        new = RuleState(spec.stage, spec.fingerprint, step, False, now, episode=new_episode())
        reason = "policy rollout block changed" if head is not None else "policy"
        t = Transition(name, head.state.stage if head else "shadow", spec.stage,
                       serve_ratio(spec, new), now, "policy", reason)  # fmt: skip
        written = self.store.cas(name, head, replace(new, last=t), self.replica)
        if written is not None:
            self.adopt(name, written, announce=True)

    def adopt(self, name: str, head: StoredState, *, announce: bool = False,
              traceparent: str | None = None) -> None:  # fmt: skip
        """Serve the store's ``head`` from now on (the caller holds the controller's lock)."""
        c = self.controller
        old = c._states.get(name)
        c._states[name] = head.state
        self.heads[name] = head
        t = head.state.last
        if t is not None and (old is None or old.last != t):
            if announce or head.writer == self.replica:
                c._announce(t, traceparent)
            else:
                c.transitions = [*c.transitions[-99:], t]
                log.info("rollout %s: %s → %s adopted from the fleet (by %s on %s: %s)",
                         name, t.from_stage, t.to_stage, t.by, head.writer, t.reason)  # fmt: skip

    def commit(self, name: str, new: RuleState, traceparent: str | None) -> bool:
        """Write a change the controller made (it holds its lock); StoreError when unreachable."""
        written = self.store.cas(name, self.heads.get(name), new, self.replica)
        if written is None:
            self._wake.set()  # someone else moved it: read the new head at once
            return False
        self.adopt(name, written, announce=True, traceparent=traceparent)
        return True

    def _judge(self, name: str, spec: RolloutSpec, head: StoredState) -> None:
        """Feed the episode's new pooled observations to the one test; act on a breach or a
        held step (a compare-and-set: once, fleet-wide)."""
        c = self.controller
        state = head.state
        guards = pooled_spec(spec.guards)
        p = self.pooled.get(name)
        if p is None or p.episode != state.episode or p.bank.spec != guards:
            p = self.pooled[name] = Pooled(state.episode, GuardBank(guards), since=state.since_unix)
            c._reset_live(name, p.bank)
        if p.since != state.since_unix:
            p.served, p.since = 0, state.since_unix
        cause: tuple[str | None, str | None] = (None, None)
        while True:
            cursor, bodies = self.store.evidence(name, state.episode, p.cursor, READ_BATCH)
            p.cursor = cursor
            for body in bodies:  # all of them: every replica's bank stays the same
                o, exchange_id, traceparent = decode(body)
                p.bank.update(o)
                p.served += o.served_by == "candidate"
                if cause == (None, None) and p.bank.breached() is not None:
                    cause = (exchange_id, traceparent)  # the exchange that tripped it
            if len(bodies) < READ_BATCH:
                break
        c._judged(name, spec, replace(state, served_at_step=p.served), cause)

    # -- health ---------------------------------------------------------------------------------

    def _down(self, error: str) -> None:
        if self.health.up or not self.health.since:  # news: it was up, or never reached
            log.error("rollout store %s unreachable (%s): every rule keeps its last state; local "
                      "guards protect this replica's traffic", self.store.name, error)  # fmt: skip
            self.health = StoreHealth(
                False, self.controller.clock(), error, self.health.syncs, self.health.last_sync_unix
            )
            self.controller._store_health(False)
        else:
            self.health.error = error

    def _up(self) -> None:
        now = self.controller.clock()
        if not self.health.up:
            if self.health.syncs:
                log.warning("rollout store %s reachable again", self.store.name)
            self.health = StoreHealth(True, now, None, self.health.syncs, now)
            self.controller._store_health(True)
        self.health.syncs += 1
        self.health.last_sync_unix = now

    def status(self) -> dict[str, Any]:
        h = self.health
        return {
            "url": self.store.name,
            "up": h.up,
            "since_unix": h.since,
            "error": h.error,
            "last_sync_unix": h.last_sync_unix,
            "poll_s": self.poll_s,
            "replica": self.replica,
            "incarnation": self.k,
            "observations": self._seq,
            "published_observations": self.published,
            "unpublished_observations": len(self.outbox),
            "dropped_observations": self.dropped,
            "pending_decisions": sorted(self.pending),
            "versions": {n: h.version for n, h in self.heads.items()},
        }
