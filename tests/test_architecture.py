"""The package graph of docs/architecture.md, held against every import in the product's code.

Every ``import`` and ``from … import`` of every module (at any depth: a lazy import inside a
function is still a dependency) is read with :mod:`ast`; an edge between two product packages that
the graph does not allow fails, naming the module and the line. Module-level import cycles fail
too. ``bench/``, ``scripts/`` and ``tests/`` are tools around the product and may import anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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
    "gateway": frozenset({"core", "policies", "otel"}),
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
            "loadgen",
            "report",
            "backends",
            "counterfactual",
        }
    ),
}
PACKAGES = frozenset(ALLOWED)


def modules() -> Iterator[tuple[str, Path]]:
    for package in sorted(PACKAGES):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def imports(path: Path, *, module_level_only: bool = False) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = tree.body if module_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            for alias in node.names:  # `from otel import semconv` imports the module otel.semconv
                yield f"{node.module}.{alias.name}", node.lineno


def test_every_import_follows_the_package_graph() -> None:
    forbidden = []
    for name, path in modules():
        package = name.split(".")[0]
        for target, line in imports(path):
            other = target.split(".")[0]
            if other in PACKAGES and other != package and other not in ALLOWED[package]:
                forbidden.append(f"{path.relative_to(ROOT)}:{line}: {package} → {other} ({target})")
    assert not forbidden, "edges the package graph forbids:\n" + "\n".join(forbidden)


def test_no_module_level_import_cycles() -> None:
    names = dict(modules())
    graph = {
        name: {t for t, _ in imports(path, module_level_only=True) if t in names and t != name}
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
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_the_graph_test_sees_a_forbidden_edge(tmp_path: Path) -> None:
    """The checker itself: an edge core → gateway in a module is reported."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from gateway.app import create_app\n", encoding="utf-8")
    assert ("gateway.app", 2) in set(imports(module))
    assert "gateway" not in ALLOWED["core"]


def test_docs_draw_the_same_graph() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for package, allowed in ALLOWED.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(f"| `{package}/`")), None)
        assert line is not None, f"docs/architecture.md has no table row for {package}/"
        named = {p for p in PACKAGES if f"`{p}`" in line.split("|")[3]}
        assert named == set(allowed), f"{package}: docs say {sorted(named)}, code {sorted(allowed)}"
