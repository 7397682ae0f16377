"""Optional dependencies: which extra a command needs, and a clear error when it is missing.

``pip install specshadow`` installs the gateway alone. Reports need ``[report]`` (numpy,
matplotlib), the benchmark matrix ``[loadgen]`` (numpy); ``[all]`` is both. A command calls
:func:`require` before importing them, and the console script turns :class:`MissingExtra` into
one line and exit status 2 — never an ImportError traceback.
"""

from __future__ import annotations

import importlib.util

EXTRAS: dict[str, tuple[str, ...]] = {
    "report": ("numpy", "matplotlib"),
    "loadgen": ("numpy",),
}


class MissingExtra(RuntimeError):
    """A command needs packages of an extra that is not installed."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if not _importable(m)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken installation
        return False


def require(extra: str, *, command: str) -> None:
    """Raise :class:`MissingExtra` naming the extra when one of its packages is absent."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"specshadow {command} needs {', '.join(absent)}, which the '{extra}' extra installs: "
            f"pip install 'specshadow[{extra}]'"
        )
