"""The policy's deterministic sampling, from :mod:`core.sample` (the token tap draws by it too).

A request is mirrored by a rule when ``sample_unit(rule.name, key) < rule.ratio``, where the key is
the request id or the configured header's value (sticky per-user sampling).
"""

from __future__ import annotations

from core.sample import is_sampled, sample_unit

__all__ = ["is_sampled", "sample_unit"]
