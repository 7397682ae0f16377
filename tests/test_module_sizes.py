"""No product module over :data:`LIMIT` lines without a line saying why it stays whole.

A module past the limit must say, in its module docstring, on a line that starts with ``Size:``,
why it is one module and not two (``Size: one pydantic model per policy key, …``). The sentence is
the review a split would have had: a module that holds two jobs cannot honestly write one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_architecture import PACKAGES, ROOT, modules

LIMIT = 450


def unexplained(root: Path, packages: frozenset[str] = PACKAGES, limit: int = LIMIT) -> list[str]:
    """``path (n lines)`` for every module of ``packages`` over ``limit`` lines whose module
    docstring has no line starting with ``Size:``."""
    found = []
    for _, path in modules(root, packages):
        source = path.read_text(encoding="utf-8")
        n = len(source.splitlines())
        if n <= limit:
            continue
        doc = ast.get_docstring(ast.parse(source, filename=str(path)), clean=False) or ""
        if not any(line.startswith("Size:") for line in doc.splitlines()):
            found.append(f"{path.relative_to(root)} ({n} lines)")
    return found


def test_every_long_module_says_why_it_stays_whole() -> None:
    found = unexplained(ROOT)
    assert not found, (
        f"modules over {LIMIT} lines without a `Size:` line in their docstring (split the module, "
        "or say in one line why it stays whole):\n" + "\n".join(found)
    )


def test_the_size_check_sees_a_long_module_without_a_reason(tmp_path: Path) -> None:
    """Checked by mutation: a long module is reported until its docstring has a ``Size:`` line;
    the word elsewhere (a comment, a later string, mid-line) does not count."""
    package = tmp_path / "core"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    body = "X = 1\n" * 6
    (package / "short.py").write_text('"""Short."""\n' + body, encoding="utf-8")
    long = package / "long.py"
    long.write_text('"""Long; see Size: below."""\n# Size: a comment\n' + body, encoding="utf-8")
    assert unexplained(tmp_path, frozenset({"core"}), limit=7) == ["core/long.py (8 lines)"]
    long.write_text('"""Long.\n\nSize: one job, told in one line.\n"""\n' + body, encoding="utf-8")
    assert unexplained(tmp_path, frozenset({"core"}), limit=7) == []
