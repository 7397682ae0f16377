"""Progressive rollout: which backend answers a request, and when a rule rolls back on its own.

The policy states each rule's rollout (``policies.compiled.RolloutSpec``); the
:class:`RolloutController` holds where each rule *is* — stage, promotion step, whether a guard
rolled it back — persisted in a JSON state file so a restart or a reload never re-promotes.

- **Serving** (:meth:`RolloutController.plan`, on the event loop, cheap): ``shadow`` → the
  primary answers as always. ``canary`` → requests whose sticky unit
  ``sample_unit(rule + "/serve", sampling key)`` is below the serve ratio are answered by the
  candidate, with the primary mirrored behind it when the rule samples them (its ``ratio``), so
  pairs keep coming; the rest are served by the primary and mirrored to the candidate as in
  shadow. ``live`` → the candidate answers every request; the primary is mirrored at
  ``reference_ratio``. The kill switch sends everything back to the primary.
- **Guards** (:meth:`RolloutController.handle`, an evidence consumer on the worker thread):
  every finished exchange of a rolling-out rule becomes one :class:`~rollout.guards.Observation`
  fed to the rule's :class:`~rollout.guards.GuardBank` — anytime-valid sequential tests, so
  judging after every exchange does not inflate false rollbacks (the bank's module doc states
  the guarantee). In ``canary`` or ``live`` a breach rolls the rule back to ``shadow`` at once,
  sticky. A new episode (a changed rollout block, an operator's promotion, other guard
  settings) starts a fresh bank: evidence never carries over.
- **Promotion**: with ``steps``, a canary step that held ``hold.min_requests`` candidate answers
  and ``hold.min_s`` seconds with every judging guard ``ok`` or ``unavailable`` and at least one
  ``ok`` moves to the next; after the last comes ``live``. A quality guard that is
  ``unavailable`` on traffic it should judge (``blocks_promotion``: sampled traffic with no
  reference for ``sampled_divergence``) holds the step, and ``/admin/rollout``'s ``waiting``
  says why. The drift guards (``acceptance_drop``, ``speculation_off``) never hold a step; their
  breach goes where ``rollout.on_drift`` says (:meth:`_drift`). Operators promote and roll back through
  ``/admin/rollout`` (:meth:`promote`, :meth:`rollback`).
- **Reloads** (:meth:`reconcile`): a rule whose rollout block is unchanged keeps its state — a
  rolled-back rule stays rolled back; a changed block (its fingerprint) starts from what the new
  policy says.

- **A fleet** (``--state sqlite:///…`` or ``clickhouse://…``): the state lives in a store every
  replica shares, and :class:`~rollout.fleet.Fleet` keeps this controller on it — the store's
  state is served, the guards judge the fleet's pooled observations, and every change
  (:meth:`_transition`, the one door) is a compare-and-set on the version read, so a rollback
  is never undone by a replica that had not seen it. Without the store a replica keeps its
  last state and its local guards (:mod:`rollout.fleet` states the false-alarm budget).

Every transition is logged, counted (``specshadow.rollout.*``) and recorded as an OTel event in
the trace of the exchange that caused it. State changes take a lock; the request path reads an
immutable snapshot and never waits for it.

Size: the controller's state machine — reconcile, plan, guard handling, promotion and operator
actions share one lock and one state; its pure parts are in :mod:`rollout.guards` and
:mod:`rollout.state`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from core.evidence import Evidence
from core.exchange import Exchange
from policies.compiled import (
    CompiledPolicy,
    Decision,
    LegPlan,
    RequestFacts,
    RolloutSpec,
    RuleSpec,
    Stage,
)
from policies.sample import sample_unit
from rollout.fleet import Fleet
from rollout.guards import (
    DRIFT_GUARDS,
    GuardBank,
    GuardState,
    Observation,
    observe,
    window_reading,
)
from rollout.state import (
    Actor,
    RuleState,
    Transition,
    load_state,
    new_episode,
    save_state,
    serve_ratio,
)
from rollout.store import StoreError, open_store, parse_state_url

log = logging.getLogger(__name__)
DRIFT_KEPT = 50  # drift breaches /admin/rollout shows


@dataclass(frozen=True, slots=True)
class ServePlan:
    """The candidate answers this request; ``shadows`` are mirrored behind it."""

    rule: str
    stage: Stage
    candidate: LegPlan
    shadows: tuple[LegPlan, ...]


@dataclass(slots=True)
class _Live:
    """In-memory per rule: the guards' tests, the latest states and KV-cache scrapes."""

    bank: GuardBank
    guards: list[GuardState] = field(default_factory=list)
    kv: tuple[float, ...] = ()


class RolloutTelemetry(Protocol):
    """What the controller tells telemetry (:class:`otel.telemetry.Telemetry` is one)."""

    def rollout_stage(self, rule: str, stage: str, serve_ratio: float) -> None: ...
    def rollout_guards(self, rule: str, guards: Sequence[GuardState]) -> None: ...
    def rollout_drift(self, rule: str, guard: str, action: str) -> None: ...
    def rollout_transition(self, t: Transition, traceparent: str | None) -> None: ...
    def rollout_store(self, store: str, up: bool) -> None: ...


Cause = tuple[str | None, str | None]  # (exchange id, traceparent) of what caused a change


class RolloutConflict(RuntimeError):
    """The fleet's state moved since this replica read it (a shared store): look again."""


_Snapshot = tuple[int, dict[str, RuleState]]  # (generation, every rule's state)


class RolloutController:
    """See the module doc. ``telemetry`` gets the metrics and events (any object with the
    ``rollout_*`` methods of :class:`otel.telemetry.Telemetry`); ``kv_recent(backend)`` gives the
    candidate's latest scraped KV-cache usages, newest last.

    ``guarded``: something feeds :meth:`handle` (the evidence worker does, in the product as
    ``specshadow.app.build_app`` assembles it). An unguarded controller never lets a candidate
    answer: every rule is held in shadow — a canary must never run with guards nothing feeds.

    ``clock`` (seconds, wall-clock by default) times every state and transition, the held step's
    ``hold.min_s`` and a shared store's health. ``sync_thread`` False: a shared store is followed
    only by :meth:`sync_once` calls (a test drives a fleet of replicas step by step under a
    fake clock); the product follows it on a thread."""

    def __init__(
        self,
        state_path: str | os.PathLike[str] | None,
        *,
        telemetry: RolloutTelemetry | None = None,
        kv_recent: Callable[[str], Sequence[float]] | None = None,
        clock: Callable[[], float] = time.time,
        guarded: bool = True,
        sync_thread: bool = True,
    ) -> None:
        self.guarded = guarded
        self.sync_thread = sync_thread
        self._warned_unguarded = False
        url = parse_state_url(os.fspath(state_path)) if state_path is not None else None
        self.state_url = url
        self.state_path = (
            Path(url.path) if url is not None and not url.shared and url.path else None
        )
        self.telemetry = telemetry
        self.kv_recent = kv_recent
        # The candidate's /metrics acceptance per scrape interval (evidence.scrape), if scraped.
        self.acceptance_recent: Callable[[str], Sequence[tuple[int, float]]] | None = None
        self._window_seen: dict[str, int | None] = {}
        self.clock = clock
        self._lock = threading.Lock()
        # The state file is written outside ``_lock`` (the event loop takes it): a change takes
        # a numbered snapshot under the lock and writes it after releasing it. One writer at a
        # time drains the newest pending snapshot, so an older one never overwrites a newer one
        # and no thread waits for another's write (:meth:`_persist`).
        self._snapshots = 0  # the generation of the newest snapshot taken
        self._pending: _Snapshot | None = None
        self._written = 0  # the generation of the snapshot the file holds
        self._writing = False
        self._write_lock = threading.Lock()  # guards the four above; never held across a write
        self._states: dict[str, RuleState] = load_state(self.state_path)
        # A shared store (sqlite://, clickhouse://): the fleet's state and pooled evidence.
        self.fleet = (
            Fleet(self, open_store(url), url.poll_s) if url is not None and url.shared else None
        )
        self._live: dict[str, _Live] = {}
        self._specs: dict[str, RuleSpec] = {}
        self._policy: CompiledPolicy | None = None
        self._generation = -1
        self.failovers = 0
        # Observations of exchanges dispatched in an episode that had ended when they landed.
        self.stale_observations = 0
        self.handled = 0  # exchanges handed to handle() so far, whatever became of them
        self.drift_breaches: list[dict[str, Any]] = []  # the newest DRIFT_KEPT, for /admin/rollout
        self.transitions: list[Transition] = []  # this process's, newest last (bounded)
        self._engines_seen: dict[str, str] = {}  # rule → its candidate's last fingerprint seen

    # -- the policy ----------------------------------------------------------------------------

    def reconcile(self, policy: CompiledPolicy) -> None:
        """Follow a (new) policy: keep the state of unchanged rollout blocks, start changed ones
        from the policy's stage, forget rules that no longer roll out."""
        if self.fleet is not None:
            self._reconcile_fleet(policy)
            return
        with self._lock:
            if policy.generation == self._generation:
                return
            specs = {r.name: r for r in policy.all_rules if r.rollout is not None}
            now = self.clock()
            changed = False
            for name, rule in specs.items():
                spec = rule.rollout
                assert spec is not None
                old = self._states.get(name)
                if old is not None and old.fingerprint == spec.fingerprint:
                    continue
                step = 0 if spec.steps and spec.stage == "canary" else None
                new = RuleState(spec.stage, spec.fingerprint, step, False, now,
                                episode=new_episode())  # fmt: skip
                if old is not None or spec.stage != "shadow":
                    reason = "policy rollout block changed" if old is not None else "policy"
                    new = replace(new, last=Transition(
                        name, old.stage if old else "shadow", spec.stage,
                        serve_ratio(spec, new), now, "policy", reason,
                    ))  # fmt: skip
                self._states[name] = new
                self._live.pop(name, None)  # a new episode: old observations do not carry over
                changed = True
                self._announce(new.last, None)
            for name in list(self._states):
                if name not in specs:
                    del self._states[name]
                    changed = True
            self._specs = specs
            self._policy = policy
            self._generation = policy.generation
            if changed:
                self._snapshot()
            self._publish()
        self._persist()  # after releasing the lock

    def _reconcile_fleet(self, policy: CompiledPolicy) -> None:
        """A shared store: the fleet's state is the store's. A rule whose stored state follows
        another block than this policy's is held in shadow until the fleet sync writes the new
        block (or finds this policy behind); nothing here waits for the store."""
        assert self.fleet is not None
        with self._lock:
            if policy.generation == self._generation:
                return
            specs = {r.name: r for r in policy.all_rules if r.rollout is not None}
            for name in list(self._states):
                spec = specs[name].rollout if name in specs else None
                if spec is None or self._states[name].fingerprint != spec.fingerprint:
                    del self._states[name]
                    self.fleet.heads.pop(name, None)
            self._specs = specs
            self._policy = policy
            self._generation = policy.generation
        # The first time: one synchronous read, then the sync thread (unless the owner steps it).
        self.fleet.start(thread=self.sync_thread)
        self.fleet._wake.set()

    # -- the request path ----------------------------------------------------------------------

    def plan(
        self, policy: CompiledPolicy, decision: Decision, facts: RequestFacts
    ) -> ServePlan | None:
        """Whether the candidate answers this request (see the module doc). Never raises."""
        if policy.generation != self._generation:
            self.reconcile(policy)
        if decision.rule is None or policy.kill_switch or policy.primary is None:
            return None
        rule = self._specs.get(decision.rule)
        state = self._states.get(decision.rule)
        if rule is None or state is None or state.stage == "shadow":
            return None
        if not self.guarded:
            if not self._warned_unguarded:
                self._warned_unguarded = True
                log.error(
                    "rule %r is in %s, but nothing feeds the rollout guards (the gateway was built "
                    "without its evidence pipeline): the candidate answers nothing",
                    rule.name, state.stage,
                )  # fmt: skip
            return None
        spec = rule.rollout
        assert spec is not None
        key = policy.sampling_key(facts)
        if state.stage == "canary" and sample_unit(f"{rule.name}/serve", key) >= serve_ratio(
            spec, state
        ):
            return None
        primary = LegPlan("primary", policy.primary, None, spec.reference_ratio)
        if state.stage == "canary":
            behind = bool(decision.legs)  # the rule sampled it: the primary is its shadow
        else:
            behind = sample_unit(f"{rule.name}/reference", facts.request_id) < spec.reference_ratio
        others = tuple(
            leg for leg in decision.legs if leg.backend.name != spec.candidate.backend.name
        )
        return ServePlan(
            rule.name, state.stage, spec.candidate, ((primary,) if behind else ()) + others
        )

    def stage_of(self, rule: str | None) -> Stage | None:
        state = self._states.get(rule) if rule is not None else None
        return state.stage if state is not None else None

    def episode_of(self, rule: str | None) -> str | None:
        """The rule's current episode (stamped on each exchange as it is dispatched)."""
        state = self._states.get(rule) if rule is not None else None
        return state.episode if state is not None else None

    # -- guards (the evidence worker's thread) -----------------------------------------------

    def handle(self, evidence: Evidence) -> None:
        """One exchange's evidence, on the evidence worker's thread (counted in ``handled``)."""
        try:
            self._handle_evidence(evidence)
        finally:
            self.handled += 1  # read by tests and diagnostics: exchanges the guards have seen

    def _handle_evidence(self, evidence: Evidence) -> None:
        exchange = evidence.exchange
        rule = self._specs.get(exchange.policy_rule or "")
        if rule is None or rule.rollout is None:
            return
        spec = rule.rollout
        engine = evidence.engines.get(spec.candidate.backend.name)
        if engine is not None:
            with self._lock:
                self._engine_seen(rule.name, spec, engine, exchange)
        observation = observe(evidence, spec.candidate.backend.name)
        if observation is None:
            self._persist()
            return
        if self.fleet is None and self.acceptance_recent is not None:
            observation = self._with_window(rule.name, spec, observation)
        with self._lock:
            state = self._states.get(rule.name)
            dispatched_in = exchange.rollout_episode
            if dispatched_in is not None and state is not None and dispatched_in != state.episode:
                # Dispatched in an earlier episode (its slow legs landed after a promotion, a
                # rollback or a re-qualification): fresh evidence only.
                self.stale_observations += 1
                return
            if self.fleet is None:
                self._handle(rule, spec, observation, exchange)
            else:
                state = self.fleet.observe(
                    rule.name, spec, observation, exchange.exchange_id, exchange.traceparent
                )
                if state is not None:  # the store is unreachable and the local guards tripped
                    self._roll_back(rule.name, state, "guard", "local guards (the rollout store "
                                    "is unreachable)", None, exchange)  # fmt: skip
        self._persist()

    def _engine_seen(self, name: str, spec: RolloutSpec, engine: str, exchange: Exchange) -> None:
        """The candidate's engine configuration fingerprint, as this exchange's evidence saw it
        (the caller holds the lock). The first one is kept. A change in ``canary`` or ``live``
        goes back to the first canary step — the promotion was earned by another build — or,
        with ``on_config_change: hold``, stays but promotes no further; a change lifts a guard's
        rollback (the new build starts again from the first canary step)."""
        state = self._states.get(name)
        if state is None:
            return
        # A fleet's sync may replace the state with the store's before this replica noted the
        # fingerprint there: what this replica saw last counts too.
        known = state.engine if state.engine is not None else self._engines_seen.get(name)
        self._engines_seen[name] = engine
        if known == engine:
            if state.engine is None:
                self._states[name] = replace(state, engine=engine)
            return
        if known is None or (state.stage == "shadow" and not state.rolled_back):
            self._states[name] = replace(state, engine=engine)  # noted, nothing to re-qualify
            if self.fleet is None:
                self._snapshot()
            return
        why = f"the candidate's engine configuration changed ({known} → {engine})"
        if state.stage != "shadow" and spec.on_config_change == "hold":
            ratio = serve_ratio(spec, state) if state.stage == "canary" else state.ratio
            new = replace(state, engine=engine, ratio=ratio)
            reason = f"{why}: held here, no further promotion until an operator promotes"
        elif spec.stage == "shadow":  # a rollback lifted; the policy keeps it in shadow
            new = replace(state, engine=engine, rolled_back=False, since_unix=self.clock())
            reason = f"{why}: the rollback is lifted"
        else:
            step = 0 if spec.steps else None
            new = RuleState("canary", spec.fingerprint, step, False, self.clock(),
                            engine=engine, episode=new_episode())  # fmt: skip
            lifted = "the rollback is lifted, " if state.rolled_back else ""
            reason = f"{why}: {lifted}back to the first canary step"
            self._live.pop(name, None)  # a new episode: the old build's evidence does not count
        log.warning("rollout %s: %s", name, reason)
        self._transition(name, state, new, "schedule", reason, None, exchange)

    def _handle(self, rule: RuleSpec, spec: RolloutSpec, observation: Observation,
                exchange: Exchange) -> None:  # fmt: skip
        """:meth:`handle` under the lock."""
        state = self._states.get(rule.name)
        live = self._live.get(rule.name)
        if live is None or live.bank.spec != spec.guards:
            levels = state.levels_for(state.episode) if state is not None else None
            live = self._live[rule.name] = _Live(GuardBank(spec.guards, levels))
        live.bank.update(observation)
        kv = self.kv_recent(spec.candidate.backend.name) if self.kv_recent is not None else ()
        live.kv = tuple(kv)
        live.guards = live.bank.states(live.kv)
        if state is None:
            return
        levels = live.bank.references()
        if levels and levels != state.levels_for(state.episode):
            # A reference level was fixed: kept with the state (a restart judges against it).
            state = self._states[rule.name] = replace(
                state, acceptance_levels=levels, acceptance_episode=state.episode
            )
            log.info(
                "rollout %s: acceptance reference %s", rule.name,
                ", ".join(f"{k or 'all traffic'} {v:.2f}" for k, v in sorted(levels.items())),
            )  # fmt: skip
            self._snapshot()
        if exchange.served_by == "candidate":
            state = self._states[rule.name] = replace(
                state, served_at_step=state.served_at_step + 1
            )
        self._decide(rule, spec, state, live.guards, (exchange.exchange_id, exchange.traceparent))

    def _decide(self, rule: RuleSpec, spec: RolloutSpec, state: RuleState,
                guards: Sequence[GuardState], cause: Cause) -> None:  # fmt: skip
        """Roll back on a breach, step up on a held step (the caller holds the lock)."""
        breach = next((g for g in guards if g.status == "breach"), None)
        if breach is not None and breach.name in DRIFT_GUARDS and state.stage != "shadow":
            self._drift(rule, spec, state, breach, cause)
        elif breach is not None and state.stage != "shadow":
            self._roll_back(
                rule.name, state, "guard", _breach_text(breach), breach.name, None, cause
            )
        elif (
            state.stage == "canary"
            and spec.steps
            and state.ratio is None
            and self._held(state, spec.hold_requests, spec.hold_s, guards)
        ):
            self._step_up(rule, state, cause)
        self._publish_guards(rule.name, guards)

    def _reset_live(self, name: str, bank: GuardBank) -> None:
        """The fleet's pooled bank for a new episode is the rule's bank (what status shows)."""
        self._live[name] = _Live(bank)

    def _judged(self, name: str, spec: RolloutSpec, state: RuleState, cause: Cause) -> None:
        """The fleet fed the pooled bank up to the store's newest observation (or the first
        breach): decide on it (the caller holds the lock)."""
        live = self._live.get(name)
        rule = self._specs.get(name)
        if live is None or rule is None:
            return
        kv = self.kv_recent(spec.candidate.backend.name) if self.kv_recent is not None else ()
        live.kv = tuple(kv)
        live.guards = live.bank.states(live.kv)
        self._decide(rule, spec, state, live.guards, cause)

    def _store_health(self, up: bool) -> None:
        if self.telemetry is not None and self.fleet is not None:
            self.telemetry.rollout_store(self.fleet.store.name, up)

    def _with_window(self, name: str, spec: RolloutSpec, o: Observation) -> Observation:
        """Attach the candidate's newest ``/metrics`` acceptance readings (the mean of those not
        yet attached) — what watches a ``live`` candidate whose answers carry no counts (vLLM
        returns them only on request, and at ``live`` nothing is mirrored to it). One gateway
        only: a fleet's replicas scrape the same candidate, and their readings would repeat one
        another in the pooled test."""
        assert self.acceptance_recent is not None
        seen = self._window_seen.get(name)
        readings = self.acceptance_recent(spec.candidate.backend.name)
        self._window_seen[name], value = window_reading(seen, readings)
        return o if value is None else replace(o, acceptance_window=value)

    def _drift(self, rule: RuleSpec, spec: RolloutSpec, state: RuleState, breach: GuardState,
               cause: Cause | None) -> None:  # fmt: skip
        """A drift guard's breach (the caller holds the lock): ``rollout.on_drift`` decides —
        back to the first canary step with a new episode (the candidate re-qualifies and its
        reference level is learned anew), back to shadow, or an alert only."""
        text = _breach_text(breach)
        action = spec.on_drift
        log.error("rollout %s: %s (%s; on_drift: %s)", rule.name, text, breach.detail, action)
        if self.telemetry is not None:
            self.telemetry.rollout_drift(rule.name, breach.name, action)
        self.drift_breaches.append(
            {"rule": rule.name, "guard": breach.name, "action": action, "reason": text,
             "detail": breach.detail, "at_unix": self.clock(), "stage": state.stage}
        )  # fmt: skip
        del self.drift_breaches[:-DRIFT_KEPT]
        if action == "shadow":
            self._roll_back(rule.name, state, "guard", text, breach.name, None, cause)
        elif action == "canary":
            step = 0 if spec.steps else None
            new = RuleState("canary", spec.fingerprint, step, False, self.clock(),
                            engine=state.engine, episode=new_episode())  # fmt: skip
            self._live.pop(rule.name, None)  # a new episode: it re-qualifies from fresh evidence
            self._transition(
                rule.name, state, new, "guard",
                f"{text}: back to the first canary step (on_drift: canary)", breach.name, None,
                cause,
            )  # fmt: skip
        else:
            live = self._live.get(rule.name)
            if live is not None:
                live.bank.rearm(breach.name)

    def _held(
        self, state: RuleState, requests: int, seconds: float, guards: Sequence[GuardState]
    ) -> bool:
        judging = [g for g in guards if g.name not in DRIFT_GUARDS]
        return (
            state.served_at_step >= requests
            and self.clock() - state.since_unix >= seconds
            and all(g.status in ("ok", "unavailable") for g in judging)
            and not any(g.blocks_promotion for g in judging)
            and any(g.status == "ok" for g in judging)
        )

    def _step_up(self, rule: RuleSpec, state: RuleState, cause: Cause | None) -> None:
        spec = rule.rollout
        assert spec is not None
        assert spec.steps
        step = (state.step or 0) + 1
        now = self.clock()
        if step < len(spec.steps):
            new = replace(state, step=step, since_unix=now, served_at_step=0)
            reason = f"step {step + 1}/{len(spec.steps)}: held {state.served_at_step} answers, guards green"
        else:
            new = replace(state, stage="live", step=None, since_unix=now, served_at_step=0)
            reason = "the last step held with guards green"
        self._transition(rule.name, state, new, "schedule", reason, None, None, cause)

    def _roll_back(
        self,
        name: str,
        state: RuleState,
        by: Actor,
        reason: str,
        guard: str | None,
        exchange: Exchange | None,
        cause: Cause | None = None,
    ) -> Transition | None:
        new = replace(
            state,
            stage="shadow",
            step=None,
            rolled_back=True,
            since_unix=self.clock(),
            served_at_step=0,
        )
        return self._transition(name, state, new, by, reason, guard, exchange, cause)

    def _transition(self, name: str, old: RuleState, new: RuleState, by: Actor, reason: str,
                    guard: str | None, exchange: Exchange | None,
                    cause: Cause | None = None) -> Transition | None:  # fmt: skip
        """Record, snapshot and announce a stage change (the caller holds the lock and calls
        :meth:`_persist` after releasing it). The one door for every change: with a shared
        store it is a compare-and-set on the version this replica read — None when the fleet
        had moved (nothing changed here); a rollback the store cannot take now is kept and
        published when it returns; another change raises StoreError."""
        rule = self._specs.get(name)
        ratio = serve_ratio(rule.rollout, new) if rule is not None and rule.rollout else 0.0
        exchange_id, traceparent = (
            (exchange.exchange_id, exchange.traceparent) if exchange is not None
            else cause if cause is not None else (None, None)
        )  # fmt: skip
        t = Transition(
            name, old.stage, new.stage, ratio, self.clock(), by, reason, guard, exchange_id
        )  # fmt: skip
        new = replace(new, last=t)
        if self.fleet is None:
            self._states[name] = new
            self._snapshot()  # written by the caller once it released the lock (_persist)
            self._announce(t, traceparent)
        else:
            try:
                if not self.fleet.commit(name, new, traceparent):
                    return None
            except StoreError:
                if not (new.stage == "shadow" and new.rolled_back):
                    raise
                self._states[name] = new  # fail static: this replica stops serving it now
                self.fleet.pending[name] = new
                self._announce(t, traceparent)
        self._publish()
        return t

    # -- the state file (written outside the lock) -------------------------------------------

    def _snapshot(self) -> None:
        """Every rule's state, numbered, to be written once the lock is released (the caller
        holds ``_lock``): the newest pending snapshot replaces any older one."""
        with self._write_lock:
            self._snapshots += 1
            self._pending = (self._snapshots, dict(self._states))

    def _persist(self) -> None:
        """Write the newest pending snapshot, if any; never an older one over a newer. When
        another thread is writing, it writes the newest pending snapshot after its own: nobody
        waits for it. Called without ``_lock`` held: a slow disk never stalls whoever takes it."""
        with self._write_lock:
            if self._pending is None or self._writing:
                return
            self._writing = True
        try:
            while True:
                with self._write_lock:
                    pending = self._pending
                    self._pending = None
                    if pending is None or pending[0] <= self._written:
                        self._writing = False
                        return
                try:
                    save_state(self.state_path, pending[1])
                except OSError:
                    log.exception("rollout state not persisted to %s", self.state_path)
                with self._write_lock:
                    self._written = max(self._written, pending[0])
        except BaseException:
            with self._write_lock:
                self._writing = False
            raise

    def _announce(self, t: Transition | None, traceparent: str | None) -> None:
        if t is None:
            return
        self.transitions = [*self.transitions[-99:], t]
        # A guard's rollback is news; a planned step (the schedule, an operator, the policy) is not.
        log.log(
            logging.WARNING if t.by == "guard" else logging.INFO,
            "rollout %s: %s → %s (serve ratio %.2f) by %s: %s",
            t.rule, t.from_stage, t.to_stage, t.serve_ratio, t.by, t.reason,
        )  # fmt: skip
        if self.telemetry is not None:
            self.telemetry.rollout_transition(t, traceparent)

    def _publish(self) -> None:
        if self.telemetry is None:
            return
        for name, state in self._states.items():
            rule = self._specs.get(name)
            ratio = serve_ratio(rule.rollout, state) if rule is not None and rule.rollout else 0.0
            self.telemetry.rollout_stage(name, state.stage, ratio)

    def _publish_guards(self, name: str, guards: Sequence[GuardState]) -> None:
        if self.telemetry is not None:
            self.telemetry.rollout_guards(name, guards)

    # -- the operator --------------------------------------------------------------------------

    def promote(
        self, name: str, *, stage: Stage | None = None, ratio: float | None = None
    ) -> Transition:
        """One step up (shadow → canary at the first step or ``serve_ratio``; canary → the next
        step, or live), or to ``stage``; clears a rollback. KeyError for an unknown rule."""
        try:
            with self._lock:
                return self._promote(name, stage, ratio)
        finally:
            self._persist()

    def _promote(self, name: str, stage: Stage | None, ratio: float | None) -> Transition:
        """:meth:`promote` under the lock."""
        rule = self._specs[name]
        spec = rule.rollout
        assert spec is not None
        state = self._states.get(name)
        if state is None:
            raise RolloutConflict(
                f"rule {name!r} is held: this replica has not read its state from the store"
            )
        now = self.clock()
        if stage is None:
            if state.stage == "shadow":
                stage = "canary"
            elif (
                state.stage == "canary"
                and spec.steps
                and state.ratio is None
                and (state.step or 0) + 1 < len(spec.steps)
                and ratio is None
            ):
                new = replace(
                    state,
                    step=(state.step or 0) + 1,
                    rolled_back=False,
                    since_unix=now,
                    served_at_step=0,
                )
                return _done(
                    self._transition(name, state, new, "operator", "promoted one step", None, None)
                )
            else:
                stage = "live"
        step = 0 if stage == "canary" and spec.steps and ratio is None else None
        new = replace(
            state,
            stage=stage,
            step=step,
            rolled_back=False,
            since_unix=now,
            served_at_step=0,
            ratio=ratio if stage == "canary" else None,
            episode=new_episode(),
        )
        t = self._transition(name, state, new, "operator", f"promoted to {stage}", None, None)
        if t is not None:
            self._live.pop(name, None)
        return _done(t)

    def rollback(self, name: str, reason: str = "operator rollback") -> Transition:
        """Back to shadow, sticky. With a shared store a rollback wins: when the fleet moved
        since this replica read it, it reads again and rolls back what is there now."""
        try:
            for _ in range(5):
                with self._lock:
                    if name not in self._specs:
                        raise KeyError(name)
                    state = self._states.get(name)
                    if state is None:
                        raise RolloutConflict(f"rule {name!r} is held: its state is not known here")
                    t = self._roll_back(name, state, "operator", reason, None, None)
                    if t is not None:
                        return t
                if self.fleet is not None:
                    self.fleet.sync_once()
            raise RolloutConflict(f"rule {name!r}: the fleet's state kept moving; try again")
        finally:
            self._persist()

    def status(self) -> dict[str, Any]:
        """``GET /admin/rollout``: per rule its stage, serve ratio, guards and last transition."""
        with self._lock:
            rules = {}
            for name, state in self._states.items():
                rule = self._specs.get(name)
                spec = rule.rollout if rule is not None else None
                live = self._live.get(name)
                rules[name] = {
                    "stage": state.stage,
                    "serve_ratio": serve_ratio(spec, state) if spec is not None else 0.0,
                    "candidate": spec.candidate.backend.name if spec is not None else None,
                    "step": state.step,
                    "steps": list(spec.steps) if spec is not None and spec.steps else None,
                    "rolled_back": state.rolled_back,
                    "served_at_step": state.served_at_step,
                    "since_unix": state.since_unix,
                    "window": len(live.bank.window) if live is not None else 0,
                    "guards": [g.to_json() for g in live.bank.states(live.kv, needs=True)]
                    if live is not None
                    else [],
                    "last_transition": state.last.to_json() if state.last is not None else None,
                    "episode": state.episode,
                    "engine": state.engine,  # the candidate's configuration fingerprint
                    # A fleet's levels are its pooled bank's (derived from the store's rows).
                    "acceptance_reference": state.levels_for(state.episode)
                    or (live.bank.references() if live is not None else None)
                    or None,
                    "waiting": self._waiting(name, spec, state, live),
                }
            for name in self._specs:
                if name not in rules:  # a shared store's rule this replica has no state for
                    rules[name] = {"stage": "shadow", "held": True, "serve_ratio": 0.0,
                                   "guards": [], "last_transition": None}  # fmt: skip
            return {
                "state_path": str(self.state_path) if self.state_path is not None else None,
                "store": self.fleet.status() if self.fleet is not None else None,
                "guarded": self.guarded,
                "failovers": self.failovers,
                "stale_observations": self.stale_observations,
                "drift_breaches": list(self.drift_breaches),
                "rules": rules,
            }

    def _waiting(
        self, name: str, spec: RolloutSpec | None, state: RuleState, live: _Live | None
    ) -> str | None:
        """Why a canary with steps is not promoted yet (None: it is not waiting)."""
        if spec is None or state.stage != "canary" or not spec.steps or state.ratio is not None:
            return None
        guards = live.guards if live is not None else []
        why = [
            f"{g.name} {g.status}: {g.detail}"
            for g in guards
            if g.name not in DRIFT_GUARDS
            and (g.blocks_promotion or g.status in ("waiting", "breach"))
        ]
        served = state.served_at_step
        if self.fleet is not None:  # a fleet counts the step's answers in its pooled log
            pooled = self.fleet.pooled.get(name)
            served = pooled.served if pooled is not None else served
        if served < spec.hold_requests:
            why.append(f"held {served} of {spec.hold_requests} candidate answers")
        held_s = self.clock() - state.since_unix
        if held_s < spec.hold_s:
            why.append(f"held {held_s:.0f} of {spec.hold_s:g} s")
        if guards and not any(g.status == "ok" for g in guards if g.name not in DRIFT_GUARDS):
            why.append("no guard has judged the candidate yet")
        return "; ".join(why) or None

    def sync_once(self) -> None:
        """A shared store: one step of following it (:meth:`rollout.fleet.Fleet.sync_once`) —
        publish this replica's observations, adopt the fleet's state, judge the pooled evidence,
        publish a decision kept while the store was down. The sync thread repeats it; a
        controller built with ``sync_thread=False`` moves only when its owner calls it. Nothing
        for a file."""
        if self.fleet is not None:
            self.fleet.sync_once()

    def store_health(self) -> tuple[bool, str] | None:
        """A shared store's reachability, for ``/readyz`` (None: a file or memory)."""
        if self.fleet is None:
            return None
        h = self.fleet.health
        if h.up:
            return True, f"{self.fleet.store.name} reachable"
        return False, (
            f"{self.fleet.store.name} unreachable ({h.error}): serving the last decision"
        )

    def close(self) -> None:
        """Stop following a shared store (publishing what is queued); nothing for a file."""
        if self.fleet is not None:
            self.fleet.close()


def _done(t: Transition | None) -> Transition:
    if t is None:
        raise RolloutConflict(
            "the fleet's rollout state moved since this replica read it: look again"
        )
    return t


def _breach_text(g: GuardState) -> str:
    value = f"{g.value:.3g}" if g.value is not None else "?"
    if g.name == "kv_usage":
        return f"guard kv_usage: {value} sustained at or above {g.threshold:g}"
    if g.name in DRIFT_GUARDS:  # observed against the reference, as the guard reads it
        return f"guard {g.name}: {g.detail.split('; e-value')[0]}"
    bound = f"{g.bound:.3g}" if g.bound is not None else "?"
    return (
        f"guard {g.name}: {value} against {g.threshold:g}, e-value {bound} (anytime-valid), "
        f"n={g.samples}"
    )
