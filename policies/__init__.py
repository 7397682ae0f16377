"""Policies: what gets mirrored where, decided from an SRE-edited, hot-reloaded file.

This package owns the policy file's schema (``model``, published as ``schema.json`` next to the
documented ``examples/``), its parsing with field-path errors (``parse``, ``errors``), its
compilation into a hot-path form (``compile`` → ``compiled.CompiledPolicy.decide``),
deterministic sampling (``sample``), shadow request shaping (``shape``), the active-policy
holder (``store``), hot reload on file change and SIGHUP (``watch``) and the ``specshadow policy``
CLI (``cli``). Everything but ``watch`` and ``cli`` is pure. It builds on :mod:`core`
only.
"""

from policies.compile import load_policy, parse_policy, policy_from_flags
from policies.compiled import (
    BackendSpec,
    Budgets,
    CompiledPolicy,
    Decision,
    LegPlan,
    MirrorSpec,
    RequestFacts,
    Shaping,
    SkipReason,
    Timeouts,
)
from policies.errors import PolicyError
from policies.sample import sample_unit
from policies.shape import shadow_headers, shape_shadow_body
from policies.store import PolicyStore
from policies.watch import reload_in_thread, reload_now, watch_policy_file

__all__ = [
    "BackendSpec",
    "Budgets",
    "CompiledPolicy",
    "Decision",
    "LegPlan",
    "MirrorSpec",
    "PolicyError",
    "PolicyStore",
    "RequestFacts",
    "Shaping",
    "SkipReason",
    "Timeouts",
    "load_policy",
    "parse_policy",
    "policy_from_flags",
    "reload_in_thread",
    "reload_now",
    "sample_unit",
    "shadow_headers",
    "shape_shadow_body",
    "watch_policy_file",
]
