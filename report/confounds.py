"""The confound gate: is the candidate's difference from production *only* its speculation?

A candidate deployment often differs from production in more than its speculative block — an
engine upgrade, an fp8 quantization or KV cache, another ``max_num_seqs``, prefix caching off — and
then a measured speed-up (or a quality change) cannot be credited to speculation. Every record's
leg carries its backend's engine configuration, reduced to what changes speed or output
(``legs[].engine``, :mod:`evidence.engine_config`). :func:`confound` compares the candidate's
latest configuration with production's and with the baseline leg's, field by field, the
speculative block (with its drafter) left out:

- nothing differs from production (or a field is unknown on one side: unknown is not
  different) → not confounded, judged as always;
- something differs, and the baseline leg runs the candidate's engine and settings but for the
  speculative block → *isolated*: the candidate is judged against that baseline (the speed-up the
  speculation alone gives), and the report says what else differs from production;
- something differs and no baseline isolates it → ``confounded``, naming the fields (with both
  values, and which were only declared in the policy), plus a policy fragment that adds the leg
  that would isolate speculation: a baseline with the candidate's engine and settings, no
  speculative block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from evidence.engine_config import FIELDS, SPECULATIVE, diff
from policies.emit import policy_yaml
from records.reader import Leg, Record

__all__ = ["Confound", "confound"]


@dataclass(frozen=True, slots=True)
class Confound:
    """The gate's reading of one candidate (see the module doc)."""

    backend: str
    fields: tuple[str, ...]  # what differs from production, the speculative block left out
    production: Mapping[str, Any] = field(default_factory=dict)  # those fields' values
    candidate: Mapping[str, Any] = field(default_factory=dict)
    declared: tuple[str, ...] = ()  # of ``fields``, those only the policy declared
    baseline: str | None = None  # the baseline leg's backend, when it has a configuration
    baseline_fields: tuple[str, ...] = ()  # what differs from the baseline (no speculation)
    fingerprint: str | None = None  # the candidate's base fingerprint
    fragment: str | None = None  # the isolating baseline leg, as a policy fragment

    @property
    def isolated(self) -> bool:
        """The baseline runs the candidate's configuration but for speculation."""
        return self.baseline is not None and not self.baseline_fields

    @property
    def confounded(self) -> bool:
        return bool(self.fields) and not self.isolated

    def differences(self) -> str:
        """``quantization (production None, candidate fp8), version (…)``."""
        parts = []
        for k in self.fields:
            said = " — declared, not reported" if k in self.declared else ""
            parts.append(
                f"{k} (production {_shown(self.production.get(k))}, "
                f"candidate {_shown(self.candidate.get(k))}{said})"
            )
        return ", ".join(parts)

    def reason(self) -> str:
        if self.confounded:
            return (
                "confounded: the candidate differs from production in more than its speculative "
                f"block — {self.differences()}; a speed-up or quality change cannot be credited "
                "to speculation. Add a baseline leg with the candidate's engine and settings "
                "and no speculative block (the policy fragment) to isolate it"
            )
        if self.fields:
            return (
                f"judged against baseline {self.baseline}, which runs the candidate's engine and "
                f"settings without speculation: production differs in {self.differences()}"
            )
        return ""

    def to_json(self) -> dict[str, Any]:
        return {
            "confounded": self.confounded,
            "isolated": self.isolated,
            "fields": list(self.fields),
            "production": dict(self.production),
            "candidate": dict(self.candidate),
            "declared": list(self.declared),
            "baseline": self.baseline,
            "baseline_fields": list(self.baseline_fields),
            "fingerprint": self.fingerprint,
            "policy_fragment": self.fragment,
        }


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def _latest(records: Sequence[Record], pick: Any) -> Leg | None:
    """The last leg ``pick(record)`` returns that carries an engine configuration."""
    for r in reversed(records):
        leg = pick(r)
        if leg is not None and leg.engine is not None and leg.engine.settings is not None:
            return leg  # type: ignore[no-any-return]
    return None


def confound(records: Sequence[Record], backend: str) -> Confound | None:
    """The gate for candidate ``backend`` over ``records`` (in time order); None when its
    configuration or production's is unknown."""
    cand = _latest(records, lambda r: r.candidate_leg(backend))
    prim = _latest(records, lambda r: r.primary)
    if cand is None or prim is None or cand.engine is None or prim.engine is None:
        return None
    c, p = cand.engine.settings or {}, prim.engine.settings or {}
    fields = tuple(diff(p, c))
    declared = {*cand.engine.declared, *prim.engine.declared}
    base = _latest(records, lambda r: r.baseline)
    baseline_fields: tuple[str, ...] = ()
    if base is not None and base.engine is not None:
        baseline_fields = tuple(diff(base.engine.settings or {}, c))
    return Confound(
        backend=backend,
        fields=fields,
        production={k: p.get(k) for k in fields},
        candidate={k: c.get(k) for k in fields},
        declared=tuple(k for k in fields if k in declared),
        baseline=base.backend if base is not None and base.engine is not None else None,
        baseline_fields=baseline_fields,
        fingerprint=cand.engine.base_fingerprint,
        fragment=_fragment(backend, cand, c) if fields else None,
    )


def _fragment(backend: str, cand: Leg, config: Mapping[str, Any]) -> str:
    """A baseline leg with the candidate's engine and settings, no speculative block."""
    name = f"{backend}-nospec"
    engine = {k: config[k] for k in FIELDS if k != SPECULATIVE and config.get(k) is not None}
    settings = ", ".join(f"{k}={v}" for k, v in engine.items())
    address = cand.server_address or "HOST:PORT"
    return policy_yaml(
        {
            "backends": {name: {"url": f"http://{address}", "kind": "vllm"}},
            "default": {
                "ratio": "load_matched",
                "legs": [
                    {"backend": backend, "role": "candidate"},
                    {"backend": name, "role": "baseline"},
                ],
            },
        },
        comments=(
            f"The leg that isolates {backend}'s speculation: a server started like {backend}",
            "(same engine and settings) without its speculative block; change the url to it.",
            f"Its settings: {settings}.",
        ),
    )
