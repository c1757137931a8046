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


# The package's parts, lowest first (docs/design.md, "Layout"): a module imports only from its
# own part and the parts before it, so a library part never imports a stage and nothing but
# cli.py and options.py reads stages/. "base" is the top-level modules every part may use.
LAYERS = ("base", "records", "qwen", "search", "tools", "engines", "agent", "scoring", "rl",
          "train", "benchmarks", "view", "toy", "stages", "cli")
TOP_LEVEL = {"__init__": "base", "errors": "base", "secrets": "base", "registry": "base",
             "http": "base", "configs": "base", "cli": "cli", "options": "cli",
             "__main__": "cli"}
PACKAGE = ROOT / "src" / "marscli"


def part_of(module: str) -> str:
    """The part a dotted module name (`marscli.qwen.tokens`) belongs to."""
    name = module.split(".")[1] if "." in module else "__init__"
    return TOP_LEVEL.get(name, "base" if name == "__version__" else name)


def marscli_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every marscli import in a file, at any depth (lazy imports count)."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("marscli"):
            names = [f"marscli.{a.name}" for a in n.names] if n.module == "marscli" else [n.module]
            out += [(n.lineno, m) for m in names]
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names if a.name.startswith("marscli")]
    return out


def test_every_module_belongs_to_a_known_part():
    parts = {part_of("marscli." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
             for p in PACKAGE.rglob("*.py")}
    assert parts <= set(LAYERS), parts - set(LAYERS)


def test_no_part_imports_a_part_above_it():
    bad = []
    for p in PACKAGE.rglob("*.py"):
        me = part_of("marscli." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
        bad += [f"{p.relative_to(ROOT)}:{line}: {me} imports {m}"
                for line, m in marscli_imports(p)
                if LAYERS.index(part_of(m)) > LAYERS.index(me)]
    assert bad == []


def test_the_top_level_stays_small():
    assert len(list(PACKAGE.glob("*.py"))) <= 12
