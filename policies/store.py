"""PolicyStore: the one holder of the active policy and of the reload bookkeeping.

aiohttp freezes app state after startup, so the store is put in the app once and the policy inside
it is swapped by a single attribute assignment (atomic for readers: a request sees the old or the
new policy, never a mix). Reloads may run in a worker thread (``asyncio.to_thread``), so the
bookkeeping is guarded by a lock; reading ``current`` needs none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from policies.compile import load_policy
from policies.compiled import CompiledPolicy

log = logging.getLogger(__name__)


class PolicyStore:
    """Holds the active :class:`CompiledPolicy` (generation 1 for the first) and reload status.

    Attributes:
        reloads: reloads that succeeded (including ones that found the content unchanged).
        reload_failures: reloads rejected (invalid file, unreadable or missing file).
        last_reload_ok: outcome of the latest reload; True before any reload.
        last_error: the latest rejection's message, cleared by the next success.
        last_reload_unix_ns: wall clock of the latest reload attempt; None before any.
        primary_url: the ``--primary`` flag, re-applied on every reload.
    """

    def __init__(self, initial: CompiledPolicy, *, primary_url: str | None = None) -> None:
        self._lock = threading.Lock()
        self._current = dataclasses.replace(initial, generation=1)
        self.primary_url = primary_url
        self.reloads = 0
        self.reload_failures = 0
        self.last_reload_ok = True
        self.last_error: str | None = None
        self.last_reload_unix_ns: int | None = None
        # Called with True/False after each reload attempt (e.g. a telemetry counter). Must not
        # block; may run on a worker thread; exceptions are swallowed.
        self.listeners: list[Callable[[bool], None]] = []

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, primary_url: str | None = None) -> PolicyStore:
        """Load ``path`` (PolicyError/OSError if it cannot be used: fail fast at startup)."""
        return cls(load_policy(path, primary_url=primary_url), primary_url=primary_url)

    @property
    def current(self) -> CompiledPolicy:
        return self._current

    @property
    def generation(self) -> int:
        return self._current.generation

    def replace(self, policy: CompiledPolicy) -> CompiledPolicy:
        """Make ``policy`` current with the next generation; returns the stored copy."""
        with self._lock:
            stored = dataclasses.replace(policy, generation=self._current.generation + 1)
            self._current = stored
            return stored

    def record_reload(self, policy: CompiledPolicy, *, at_unix_ns: int) -> bool:
        """A reload produced ``policy``: swap it in unless its content hash is unchanged.

        Returns True when the generation was bumped.
        """
        with self._lock:
            self.last_reload_ok = True
            self.last_error = None
            self.last_reload_unix_ns = at_unix_ns
            changed = policy.sha256 != self._current.sha256
            if changed:
                self._current = dataclasses.replace(policy, generation=self._current.generation + 1)
        self._notify(True)
        with self._lock:
            # Counted once its listeners (the rollout controller's reconcile) have run: whoever
            # sees the count sees the reload's effects.
            self.reloads += 1
        return changed

    def record_failure(self, error: str, *, at_unix_ns: int) -> None:
        """A reload was rejected; the current policy keeps serving."""
        with self._lock:
            self.reload_failures += 1
            self.last_reload_ok = False
            self.last_error = error
            self.last_reload_unix_ns = at_unix_ns
        self._notify(False)

    def _notify(self, ok: bool) -> None:
        for listener in list(self.listeners):
            try:
                listener(ok)
            except Exception:  # a listener must never break a reload
                log.debug("policy reload listener failed", exc_info=True)

    def status_dict(self) -> dict[str, object]:
        """The body of ``GET /admin/policy``."""
        policy = self._current
        with self._lock:
            last = {
                "ok": self.last_reload_ok,
                "error": self.last_error,
                "at": _iso(self.last_reload_unix_ns),
                "reloads": self.reloads,
                "failures": self.reload_failures,
            }
        return {
            "generation": policy.generation,
            "sha256": policy.sha256,
            "source": policy.source,
            "loaded_at": _iso(policy.loaded_unix_ns),
            "kill_switch": policy.kill_switch,
            "rules": [r.name for r in policy.rules]
            + ([policy.default_rule.name] if policy.default_rule else []),
            "backends": sorted(policy.backends),
            "last_reload": last,
        }


def _iso(unix_ns: int | None) -> str | None:
    if unix_ns is None:
        return None
    return datetime.fromtimestamp(unix_ns / 1e9, tz=UTC).isoformat(timespec="milliseconds")
