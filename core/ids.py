"""Ids the gateway mints: ``x-request-id`` for requests that came without one, and exchange ids.

128 random bits as 32 hex digits — the shape of ``uuid.uuid4().hex`` — from a per-process PRNG
seeded by the OS (and re-seeded in a forked child). ``uuid4`` asks the kernel for every id
(``getrandom``): two of those were 7 % of the gateway's CPU per non-streaming request on the
benchmark VM (profiled; docs/benchmarks.md). These ids name things; they guard nothing, so they
need uniqueness, not unpredictability.
"""

from __future__ import annotations

import os
import random

_RNG = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _RNG.seed(os.urandom(32)))


def new_id() -> str:
    """A fresh 128-bit id as 32 lowercase hex digits."""
    return f"{_RNG.getrandbits(128):032x}"
