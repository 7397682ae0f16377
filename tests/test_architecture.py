"""The package graph of docs/architecture.md, held against every import in the product's code.

Every ``import`` and ``from … import`` of every module (at any depth: a lazy import inside a
function is still a dependency) is read with :mod:`ast`; an edge between two product packages that
the graph does not allow fails, naming the module and the line. So do a top-level package the
graph does not know (a root directory with an ``__init__.py``, or a name in pyproject's package
list) and any edge into one, a relative import (the product imports absolutely), and an import
cycle among the imports that run when a module loads — those in its body and in its module-level
``try``/``if``/``with`` blocks, not those inside a function or class body, nor under
``if TYPE_CHECKING:``. ``bench/``, ``scripts/`` and ``tests/`` are tools around the product and may
import anything.

The checks are functions of a root directory, and each is checked by mutation: a test writes a
small tree holding the violation and asserts the checker reports it.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package → the project packages it may import (besides itself). docs/architecture.md draws this.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "policies": frozenset({"core"}),
    "otel": frozenset({"core", "records"}),
    "simulator": frozenset({"core"}),
    "records": frozenset({"core"}),
    "evidence": frozenset({"core", "records"}),
    "rollout": frozenset({"core", "policies", "records"}),
    "gateway": frozenset({"core", "policies", "otel", "records", "rollout"}),
    "counterfactual": frozenset({"core", "records"}),
    "loadgen": frozenset({"core"}),
    "report": frozenset({"core", "policies", "evidence", "records", "counterfactual", "loadgen"}),
    "backends": frozenset({"core"}),
    "specshadow": frozenset(
        {
            "core",
            "policies",
            "otel",
            "simulator",
            "evidence",
            "records",
            "gateway",
            "rollout",
            "loadgen",
            "report",
            "backends",
            "counterfactual",
        }
    ),
}
PACKAGES = frozenset(ALLOWED)
# Tools around the product (they may import anything; nothing of the product may import them).
TOOLS = frozenset({"tests", "bench", "scripts"})


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the absolute module name (a relative import is resolved against its module)
    line: int
    level: int  # 0: absolute; n: n leading dots
    written: str  # the module as the source spells it (``..pkg``)


def modules(root: Path, packages: frozenset[str] = PACKAGES) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every module of ``packages`` under ``root``."""
    for package in sorted(packages):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time(node: ast.AST) -> Iterator[ast.AST]:
    """The statements under ``node`` that run when the module loads: every block of the body
    (``try``, ``if``, ``with``, ``for``, ``match``, a class body), not a function's body, nor an
    ``if TYPE_CHECKING:`` block (its ``else`` does run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _load_time(stmt)
            continue
        yield from _load_time(child)


def imports(
    source: str, module: str, *, is_package: bool = False, module_level_only: bool = False
) -> Iterator[Import]:
    """Every import in ``source`` (the text of ``module``; ``is_package``: an ``__init__.py``),
    each as the absolute module it imports. ``module_level_only``: those that run on loading."""
    tree = ast.parse(source, filename=module)
    nodes = _load_time(tree) if module_level_only else ast.walk(tree)
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno, 0, alias.name)
        elif isinstance(node, ast.ImportFrom):
            written = "." * node.level + (node.module or "")
            base = package[: len(package) - (node.level - 1)] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            if node.level > len(package):  # above the top: kept as written, to be reported
                name = written
            if name:
                yield Import(name, node.lineno, node.level, written)
            for alias in node.names:  # `from otel import semconv` imports the module otel.semconv
                yield Import(f"{name}.{alias.name}", node.lineno, node.level, written)


def _imports_of(path: Path, module: str, *, module_level_only: bool = False) -> Iterator[Import]:
    source = path.read_text(encoding="utf-8")
    yield from imports(
        source, module, is_package=path.name == "__init__.py", module_level_only=module_level_only
    )


def local_names(root: Path) -> frozenset[str]:
    """Every name an import could find at the root: its directories and its ``.py`` files."""
    return frozenset(
        p.stem if p.is_file() else p.name
        for p in root.iterdir()
        if (p.is_dir() or p.suffix == ".py")
        and (p.stem if p.is_file() else p.name).isidentifier()
        and not p.name.startswith("__")
    )


def top_level_packages(root: Path) -> frozenset[str]:
    """The root's packages: directories with an ``__init__.py``, and pyproject's package list."""
    found = {p.parent.name for p in root.glob("*/__init__.py")}
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        find = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
        for pattern in find.get("include", []):
            found.add(pattern.split(".")[0].rstrip("*"))
    return frozenset(found)


def unknown_packages(root: Path, allowed: Mapping[str, frozenset[str]] = ALLOWED) -> list[str]:
    """Top-level packages that are neither in the graph nor a tool."""
    return sorted(top_level_packages(root) - set(allowed) - TOOLS)


def forbidden_edges(root: Path, allowed: Mapping[str, frozenset[str]] = ALLOWED) -> list[str]:
    """``path:line: package → other (target)`` for every import the graph does not allow: into a
    product package not listed for the importer, or into anything else of the root (a tool, a
    package the graph does not know)."""
    packages, local = frozenset(allowed), local_names(root)
    forbidden = []
    for name, path in modules(root, packages):
        package = name.split(".")[0]
        for imp in _imports_of(path, name):
            other = imp.target.split(".")[0]
            known = other in packages
            if (known and other != package and other not in allowed[package]) or (
                not known and other in local
            ):
                why = "" if known else ", a package the graph does not know"
                at = f"{path.relative_to(root)}:{imp.line}"
                forbidden.append(f"{at}: {package} → {other} ({imp.target}{why})")
    return forbidden


def relative_imports(root: Path, packages: frozenset[str] = PACKAGES) -> list[str]:
    """``path:line: from ..x`` for every relative import: the product imports absolutely, so an
    upward edge is always spelled with the package it goes to."""
    found = set()
    for name, path in modules(root, packages):
        for imp in _imports_of(path, name):
            if imp.level:
                found.add(f"{path.relative_to(root)}:{imp.line}: from {imp.written} import …")
    return sorted(found)


def import_cycles(root: Path, packages: frozenset[str] = PACKAGES) -> list[list[str]]:
    """Cycles among the imports that run when a module loads (see the module doc)."""
    names = dict(modules(root, packages))
    graph = {
        name: {
            imp.target
            for imp in _imports_of(path, name, module_level_only=True)
            if imp.target in names and imp.target != name
        }
        for name, path in names.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


# --- the product ---------------------------------------------------------------------------------


def test_every_top_level_package_is_in_the_graph() -> None:
    unknown = unknown_packages(ROOT)
    assert not unknown, f"packages docs/architecture.md does not draw: {unknown}"


def test_every_import_follows_the_package_graph() -> None:
    forbidden = forbidden_edges(ROOT)
    assert not forbidden, "edges the package graph forbids:\n" + "\n".join(forbidden)


def test_no_relative_imports() -> None:
    found = relative_imports(ROOT)
    assert not found, "relative imports (import absolutely):\n" + "\n".join(found)


def test_no_module_level_import_cycles() -> None:
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_docs_draw_the_same_graph() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for package, allowed in ALLOWED.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(f"| `{package}/`")), None)
        assert line is not None, f"docs/architecture.md has no table row for {package}/"
        named = {p for p in PACKAGES if f"`{p}`" in line.split("|")[3]}
        assert named == set(allowed), f"{package}: docs say {sorted(named)}, code {sorted(allowed)}"


# --- the checker, checked by mutation: a small tree holding each violation ------------------------

SMALL: dict[str, frozenset[str]] = {"core": frozenset(), "gateway": frozenset({"core"})}


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    """A small project: ``core`` and ``gateway`` (which may import core), plus ``files``."""
    base = {"core/__init__.py": "", "core/a.py": "X = 1\n", "gateway/__init__.py": ""}
    for rel, text in {**base, **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_the_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"gateway/app.py": "from core.a import X\nimport os\n"})
    assert unknown_packages(root, SMALL) == []
    assert forbidden_edges(root, SMALL) == []
    assert relative_imports(root, frozenset(SMALL)) == []
    assert import_cycles(root, frozenset(SMALL)) == []


def test_the_checker_sees_a_forbidden_edge(tmp_path: Path) -> None:
    """An edge core → gateway, lazy inside a function, is reported with its line."""
    root = _tree(tmp_path, {"core/bad.py": "def f():\n    from gateway.app import create_app\n"})
    assert forbidden_edges(root, SMALL) == [
        "core/bad.py:2: core → gateway (gateway.app)",
        "core/bad.py:2: core → gateway (gateway.app.create_app)",
    ]


def test_the_checker_sees_a_package_the_graph_does_not_know(tmp_path: Path) -> None:
    """A new root directory with an ``__init__.py``, a new name in pyproject's package list, and
    an edge into an unknown package are each reported; tools are not packages of the graph."""
    root = _tree(
        tmp_path,
        {
            "extra/__init__.py": "",
            "tests/__init__.py": "",
            "bench/__init__.py": "",
            "gateway/app.py": "import extra.thing\n",
            "core/b.py": "from tests import fakes\n",
            "pyproject.toml": (
                "[tool.setuptools.packages.find]\n"
                'include = ["core*", "gateway*", "listed*", "tests*"]\n'
            ),
        },
    )
    assert unknown_packages(root, SMALL) == ["extra", "listed"]
    edges = forbidden_edges(root, SMALL)
    assert "gateway/app.py:1: gateway → extra (extra.thing, a package the graph does not know)" in (
        edges
    )
    assert any(e.startswith("core/b.py:1: core → tests (tests") for e in edges)
    assert len(edges) == 3  # `from tests import fakes`: tests and tests.fakes


def test_the_checker_sees_a_relative_import(tmp_path: Path) -> None:
    """``from .. import x`` and ``from ..pkg import y`` are reported, and the edge they hide is
    resolved: ``from ..gateway import app`` in ``core.sub.m`` is core → gateway."""
    root = _tree(
        tmp_path,
        {
            "core/sub/__init__.py": "from .. import a\n",
            "core/sub/m.py": "from ..gateway import app\n",
            "gateway/x.py": "from . import y\n",
        },
    )
    found = relative_imports(root, frozenset(SMALL))
    assert found == [
        "core/sub/__init__.py:1: from .. import …",
        "core/sub/m.py:1: from ..gateway import …",
        "gateway/x.py:1: from . import …",
    ]
    above = _tree(tmp_path / "above", {"core/m.py": "from ...gateway import app\n"})
    assert relative_imports(above, frozenset(SMALL)) == ["core/m.py:1: from ...gateway import …"]


def test_a_relative_import_resolves_against_its_module() -> None:
    def targets(source: str, module: str, *, is_package: bool = False) -> set[str]:
        return {i.target for i in imports(source, module, is_package=is_package)}

    assert targets("from .. import x\n", "core.sub.m") == {"core", "core.x"}
    assert targets("from ..pkg import y\n", "core.sub.m") == {"core.pkg", "core.pkg.y"}
    assert targets("from . import x\n", "core.sub", is_package=True) == {"core.sub", "core.sub.x"}
    assert targets("from .b import c\n", "core.a") == {"core.b", "core.b.c"}


def test_the_checker_sees_a_cycle_built_in_module_level_blocks(tmp_path: Path) -> None:
    """An import cycle through a module-level ``try``, ``if`` or ``with`` block is a cycle; the
    same imports inside a function, or under ``if TYPE_CHECKING:``, are not."""
    blocks = {
        "try": "try:\n    from core.{other} import f\nexcept ImportError:\n    f = None\n",
        "if": "import sys\nif sys.version_info >= (3, 11):\n    import core.{other}\n",
        "with": "import contextlib\nwith contextlib.suppress(ImportError):\n    import core.{other}\n",
        "class": "class C:\n    from core.{other} import f\n",
    }
    for kind, block in blocks.items():
        root = _tree(
            tmp_path / kind,
            {"core/p.py": block.format(other="q"), "core/q.py": "from core.p import g\n"},
        )
        assert import_cycles(root, frozenset(SMALL)) == [["core.p", "core.q", "core.p"]], kind
    lazy = {
        "function": "def f():\n    from core.q import g\n",
        "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.q import g\n",
    }
    for kind, block in lazy.items():
        root = _tree(tmp_path / kind, {"core/p.py": block, "core/q.py": "from core.p import g\n"})
        assert import_cycles(root, frozenset(SMALL)) == [], kind
