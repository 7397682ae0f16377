"""Deterministic sampling: a (salt, key) pair → a uniform number in [0, 1), and a share by it.

Stateless and pure, so every replica and every reload agrees. The policy mirrors a request when
``sample_unit(rule.name, key) < rule.ratio``, where the key is the request id or the configured
header's value (sticky per-user sampling). Keeping a rule's name keeps its decisions; a higher
ratio only adds requests (the sampled set for 0.1 is contained in the set for 0.2). The token tap
draws its shares (token ids, likelihoods) with :func:`is_sampled` on the exchange id, each under
its own salt, so the shares are independent of each other and of the rules' draws.
"""

from __future__ import annotations

import hashlib

_TWO_POW_53 = float(2**53)


def sample_unit(salt: str, key: str) -> float:
    """Uniform in [0, 1); the same inputs give the same value on every replica and reload."""
    # NUL separates the parts so ("a", "bc") and ("ab", "c") cannot collide.
    digest = hashlib.blake2b(f"{salt}\0{key}".encode(), digest_size=8).digest()
    # Keep 53 bits: (2**64 - 1) / 2**64 rounds to exactly 1.0 as a float, which would make
    # `unit < 1.0` false and a ratio of 1 miss a request; (2**53 - 1) / 2**53 is exact.
    return (int.from_bytes(digest, "big") >> 11) / _TWO_POW_53


def is_sampled(salt: str, key: str, ratio: float) -> bool:
    """``sample_unit(salt, key) < ratio``, without hashing at the 0 and 1 edges."""
    if ratio <= 0.0:
        return False
    if ratio >= 1.0:
        return True
    return sample_unit(salt, key) < ratio
