"""The one policy error: config time only, it never reaches a client.

Every problem found while reading, validating or compiling a policy is reported as a
:class:`PolicyError` whose lines each start with the field path that is wrong, e.g.
``rules[2].ratio: must be between 0 and 1, got 1.5`` — so an SRE can go straight to the line.
"""

from __future__ import annotations

from collections.abc import Sequence


class PolicyError(ValueError):
    """A policy that cannot be used. ``str(err)`` is one problem per line, each ``path: message``.

    Attributes:
        problems: the individual ``path: message`` lines, in document order.
        source: where the policy came from (a file path, ``"flags"``), or ``None`` when unknown.
    """

    def __init__(self, problems: str | Sequence[str], *, source: str | None = None) -> None:
        lines = (problems,) if isinstance(problems, str) else tuple(problems)
        super().__init__("\n".join(lines))
        self.problems: tuple[str, ...] = lines
        self.source = source
