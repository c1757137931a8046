"""The layout rules a newcomer relies on: no module reaches into another's private names, and
test modules share code through helpers.py, fakes.py and conftest.py, never by importing one
another."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

SOURCES = sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                  *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


def imports(path: Path) -> list[ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]


def test_no_private_names_imported_across_modules():
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: from {n.module} import {a.name}"
           for p in SOURCES for n in imports(p) if (n.module or "").startswith("marscli")
           for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_test_modules_never_import_each_other():
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: from {n.module}"
           for p in (ROOT / "tests").glob("*.py") for n in imports(p)
           if (n.module or "").startswith(("test_", "tests.test_"))]
    assert bad == []
