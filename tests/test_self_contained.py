"""The repository is the whole project: no test, script or product path reaches outside it.

A user's clone has nothing beside it. Two checks over every tracked file:

- no text names a sibling folder of the checkout (``../`` and a folder name): a relative path
  that climbs out of the repository from the file it is written in, or one that stays inside but
  names nothing there (a command in a docs page runs from the clone's root, not the page's
  folder, so ``../x`` in ``docs/`` is a reach outside unless ``x`` is a repository folder);
- no Python module climbs above the repository root from its own location
  (``Path(__file__).resolve().parents[N]`` or ``.parent`` chains deeper than the file sits).

``.ci/run`` also runs everything from a fresh clone in an empty temporary folder, so a reach that
these checks miss still fails there.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".sh", ".cfg", ".ini", ".txt"}
# A relative path that leaves the checkout: ../name at the start of a path (not ../../ inside a
# URL or a docs link between two repository folders, which is resolved below).
_CLIMB = re.compile(r"(?<![\w./-])((?:\.\./)+)([\w.-]+)")


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    paths = [ROOT / p for p in out.split("\0") if p]
    return [
        p
        for p in paths
        if p.is_file()
        and (
            p.suffix in TEXT_SUFFIXES
            or p.parent.name in {"scripts", ".ci"}
            or p.name == "Dockerfile"
        )
    ]


def climbs_out(file: Path, climb: str, name: str | None = None) -> bool:
    """Does ``climb`` (``../`` repeated) and then ``name``, taken from ``file``'s folder, leave the
    repository — or land inside it on nothing that exists?"""
    depth = len(file.relative_to(ROOT).parts) - 1  # folders between the root and the file
    if climb.count("../") > depth:
        return True
    return name is not None and not (file.parent / climb / name).exists()


def test_no_file_names_a_path_outside_the_checkout() -> None:
    offenders: list[str] = []
    for path in tracked_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders.extend(
            f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
            for number, line in enumerate(text.splitlines(), 1)
            for match in _CLIMB.finditer(line)
            if climbs_out(path, match.group(1), match.group(2))
        )
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def _parents_index(node: ast.AST) -> int | None:
    """N for ``<…__file__…>.parents[N]``; the number of ``.parent`` for a ``.parent`` chain."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "parents"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, int)
        and "__file__" in ast.unparse(node.value)
    ):
        return node.slice.value + 1  # parents[0] is the file's folder: one step up
    chain, inner = 0, node
    while isinstance(inner, ast.Attribute) and inner.attr == "parent":
        chain, inner = chain + 1, inner.value
    if chain and "__file__" in ast.unparse(inner):
        return chain
    return None


def test_no_module_climbs_above_the_repository_root() -> None:
    offenders: list[str] = []
    for path in tracked_files():
        if path.suffix != ".py":
            continue
        depth = len(path.relative_to(ROOT).parts)  # steps from the file to the root
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            steps = _parents_index(node)
            if steps is not None and steps > depth:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")  # type: ignore[attr-defined]
    assert not offenders, "modules that climb out of the repository:\n" + "\n".join(offenders)


def test_the_checks_see_a_reach_outside() -> None:
    """The checkers themselves, on examples that must be caught and must pass."""
    assert climbs_out(ROOT / "tests" / "x.py", "../../")
    assert not climbs_out(ROOT / "docs" / "x.md", "../")
    sibling = "../" + "sha" + "red/traces"  # spelled apart so this file names no such path
    assert _CLIMB.search(f"see {sibling}") is not None
    assert climbs_out(ROOT / "docs" / "x.md", "../", "sha" + "red")
    assert not climbs_out(ROOT / "docs" / "x.md", "../", "loadgen")
    tree = ast.parse(
        "from pathlib import Path\nP = Path(__file__).resolve().parents[3] / 'shared'\n"
    )
    (steps,) = [s for s in map(_parents_index, ast.walk(tree)) if s is not None]
    assert steps == 4
