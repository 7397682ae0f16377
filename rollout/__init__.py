"""The control plane: progressive rollout of a candidate, its guards and the one decision a fleet shares.

Owns what happens after the report's decision — never what a request's bytes are:

- :mod:`rollout.controller` — :class:`~rollout.controller.RolloutController`, who answers each
  request (the primary, or in a canary the candidate), the stage machine (shadow → canary → live),
  the guards' verdicts and the rollbacks they cause;
- :mod:`rollout.guards` — the guards (latency, errors, quality, acceptance) as anytime-valid
  sequential tests over the exchanges a rule's episode really served;
- :mod:`rollout.sequential` — the e-processes those guards use;
- :mod:`rollout.state` — a rule's state, its transitions and the JSON state file;
- :mod:`rollout.store` and :mod:`rollout.store_clickhouse` — the shared state stores
  (``sqlite:///PATH`` on one host, ``clickhouse://HOST:PORT/DB`` for a fleet);
- :mod:`rollout.fleet` — replicas that share one decision through a store.

``gateway`` imports this package; this package imports nothing of ``gateway`` (the architecture
test holds both).
"""
