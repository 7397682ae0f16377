"""Re-qualification: a configuration change on any leg splits the evidence at the change.

An engine upgrade or a settings change in the middle of a window mixes two populations into one
verdict. Every record's leg carries its backend's reduced engine configuration
(``legs[].engine``); :func:`changes` walks the records in time order and, per backend, notes each
point where a field of that configuration changed (the speculative block included: a new depth is
a new candidate). A field that becomes known (a probe that answers for the first time) is not a
change. :func:`split` keeps the records from the latest change on: the report judges the latest
configuration only, and lists every change (when, which backend, which fields, from what to what).

The split point is the first record that carries the new configuration. The gateway's probe
refreshes every few seconds, so a handful of exchanges just after the change may still carry the
old one and stay on the old side; they are left out, never mixed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from evidence.engine_config import diff
from records.reader import Record

__all__ = ["ConfigChange", "changes", "split"]


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """One backend's configuration changed: first seen in the exchange started at ``at_unix_ns``."""

    backend: str
    at_unix_ns: int
    fields: tuple[str, ...]
    before: Mapping[str, Any]  # the changed fields' old values
    after: Mapping[str, Any]
    fingerprint_before: str | None
    fingerprint_after: str | None

    def at(self) -> str:
        return datetime.fromtimestamp(self.at_unix_ns / 1e9, tz=UTC).strftime(
            "%Y-%m-%d %H:%M:%S UTC"
        )

    def text(self) -> str:
        moved = ", ".join(f"{k} {self.before.get(k)} → {self.after.get(k)}" for k in self.fields)
        return f"{self.backend} changed configuration at {self.at()}: {moved}"

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "at_unix_ns": self.at_unix_ns,
            "fields": list(self.fields),
            "before": dict(self.before),
            "after": dict(self.after),
            "fingerprint_before": self.fingerprint_before,
            "fingerprint_after": self.fingerprint_after,
        }


def changes(records: Sequence[Record]) -> list[ConfigChange]:
    """Every configuration change of every backend, in time order."""
    last: dict[str, tuple[Mapping[str, Any], str | None]] = {}
    out: list[ConfigChange] = []
    for r in sorted(records, key=lambda r: r.started_unix_ns):
        for leg in r.legs:
            engine = leg.engine
            config = engine.settings if engine is not None else None
            if engine is None or config is None:
                continue
            seen = last.get(leg.backend)
            if seen is not None:
                moved = tuple(diff(seen[0], config, speculative=True))
                if moved:
                    out.append(
                        ConfigChange(
                            leg.backend,
                            r.started_unix_ns,
                            moved,
                            {k: seen[0].get(k) for k in moved},
                            {k: config.get(k) for k in moved},
                            seen[1],
                            engine.config_fingerprint,
                        )
                    )
            # Merge: a field this record does not know keeps its last known value.
            merged = {**(seen[0] if seen else {}), **config}
            last[leg.backend] = (merged, engine.config_fingerprint)
    return out


def split(records: Sequence[Record]) -> tuple[list[Record], list[ConfigChange], int | None]:
    """(the records from the latest change on, every change, that change's time or None)."""
    found = changes(records)
    if not found:
        return list(records), found, None
    since = found[-1].at_unix_ns
    return [r for r in records if r.started_unix_ns >= since], found, since
