"""The engine choice sits above both engines: the Python fold (report.population) and the SQL in
the engine (report.sql) never import each other — lazily inside a function included — and both
build report.aggregates' types."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_neither_engine_imports_the_other() -> None:
    population = _imports(ROOT / "report" / "population.py")
    sql = _imports(ROOT / "report" / "sql.py")
    assert "report.sql" not in population
    assert "report.population" not in sql
    assert "report.aggregates" in population and "report.aggregates" in sql


def test_the_choice_imports_both() -> None:
    gather = _imports(ROOT / "report" / "gather.py")
    assert {"report.population", "report.sql"} <= gather
