"""Optional dependencies: which extra a command needs, and a clear error when it is missing.

``pip install specshadow`` installs the gateway alone. Reports need ``[report]`` (numpy,
matplotlib), the benchmark matrix ``[loadgen]`` (numpy), ``specshadow demo`` ``[demo]`` (both:
what the README's first command installs), chDB stores ``[fleet]``; ``[all]`` is every one. A
command calls :func:`require` before importing them, and the console script turns
:class:`MissingExtra` into one line and exit status 2 — never an ImportError traceback.

The line ends with the command that installs the extra *where this copy came from*
(:func:`install_command`): from a clone (an editable install, ``pip install .`` of a checkout, or
the source tree run as it is) that is pip on the checkout, e.g. ``.venv/bin/python -m pip install
-e '.[report]'``, since ``pip install 'specshadow[report]'`` there would look for the project on
an index; an installed release gets ``pip install 'specshadow[report]'``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

from core import jsonx

EXTRAS: dict[str, tuple[str, ...]] = {
    "report": ("numpy", "matplotlib"),
    "loadgen": ("numpy",),
    "demo": ("numpy", "matplotlib"),
    "fleet": ("chdb",),
}
DISTRIBUTION = "specshadow"
# The directory above the top-level packages: in a checkout it holds pyproject.toml.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


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
            f"{install_command(extra)}"
        )


def install_command(extra: str) -> str:
    """The shell command that adds ``extra`` to the environment running this code."""
    checkout, editable = _checkout()
    if checkout is None:
        return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"
    target = shlex.quote(f"{_shown(checkout) or '.'}[{extra}]")
    if not sys.executable:  # an embedding interpreter that does not know its own path
        python = "python3"
    else:
        python = _shown(Path(sys.executable))
        if python == Path(python).name:  # a bare name would be looked up on PATH, not run here
            python = f"./{python}"
    return f"{shlex.quote(python)} -m pip install {'-e ' if editable else ''}{target}"


def _checkout() -> tuple[Path | None, bool]:
    """(the checkout to install from, whether as an editable install), or (None, False).

    The packages running now sit in a checkout (a pyproject.toml of this project beside them):
    an editable install or the source tree run as it is. Otherwise pip's record of where it
    installed this distribution from (PEP 610 ``direct_url.json``): a local directory that is
    still a checkout means ``pip install .`` from a clone, to be repeated with the extra.
    """
    if _is_checkout(SOURCE_ROOT):
        return SOURCE_ROOT, True
    # Imported here: only a missing extra pays for them, not every start of the console script.
    from importlib import metadata
    from urllib.parse import unquote, urlsplit
    from urllib.request import url2pathname

    try:
        record = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        record = None
    try:
        origin = jsonx.loads(record) if record else {}
    except ValueError:
        origin = {}
    url = urlsplit(str(origin.get("url", ""))) if isinstance(origin, dict) else None
    dir_info = origin.get("dir_info") if isinstance(origin, dict) else None
    if url is not None and url.scheme == "file" and isinstance(dir_info, dict):
        root = Path(url2pathname(unquote(url.path)))
        if _is_checkout(root):
            return root, bool(dir_info.get("editable", False))
    return None, False


def _is_checkout(root: Path) -> bool:
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return f'name = "{DISTRIBUTION}"' in text


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it ('' for the directory
    itself), else absolute — what a user would type from where they stand."""
    try:
        here = Path.cwd()
    except OSError:  # the working directory was removed
        return str(path)
    absolute = path if path.is_absolute() else here / path
    try:
        relative = os.path.relpath(absolute, here)
    except ValueError:  # another drive (Windows)
        return str(absolute)
    if relative == ".":
        return ""
    outside = relative == os.pardir or relative.startswith(os.pardir + os.sep)
    return str(absolute) if outside else relative
