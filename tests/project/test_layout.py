"""The layout rules a newcomer relies on: no module reaches into another's private names, and
test modules share code through helpers.py, fakes.py and conftest.py, never by importing one
another."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

SOURCES = sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                  *(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


def imports(path: Path) -> list[ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]


def test_no_private_names_imported_across_modules():
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: from {n.module} import {a.name}"
           for p in SOURCES for n in imports(p) if (n.module or "").startswith("marscli")
           for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_test_modules_never_import_each_other():
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: from {n.module}"
           for p in (ROOT / "tests").rglob("*.py") for n in imports(p)
           if (n.module or "").startswith(("test_", "tests.test_"))]
    assert bad == []


# The package's parts, lowest first (docs/design.md, "Layout"): a module imports only from its
# own part and the parts before it, so a library part never imports a stage and nothing but
# cli.py and options.py reads stages/. "base" is the top-level modules every part may use.
LAYERS = ("base", "records", "qwen", "search", "tools", "engines", "agent", "benchmarks", "scoring",
          "rl", "train", "evaluation", "serving", "view", "toy", "stages", "cli")
TOP_LEVEL = {"__init__": "base", "errors": "base", "secrets": "base", "registry": "base",
             "http": "base", "configs": "base", "cli": "cli", "app": "cli", "options": "base",
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


def module_graph() -> dict[str, set[str]]:
    """Every module of the package → the package's modules it imports, at any depth (an import
    inside a function is exactly what holds a circle together). `from marscli.a import b` is
    an import of the module `marscli.a.b` when there is one, else of `marscli.a`; a package is
    its `__init__`. A registry's `lazy` entries name modules as strings and are no imports: the
    module they name imports the registry, never the reverse."""
    modules = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("marscli", *p.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, path in modules.items():
        targets = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("marscli"):
                targets |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in modules
                            else n.module for a in n.names}
            elif isinstance(n, ast.Import):
                targets |= {a.name for a in n.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each a set of
    modules that import one another, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circles():
    """No modules import one another, even inside functions: a circle means a concern split
    between two modules, and the one to move out is what both need (docs/design.md, "Layout")."""
    assert circles(module_graph()) == []


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


STAGE_LINES = 200  # a stage reads its inputs, calls the library and writes: more is library


def test_stages_only_stage():
    """Each stages/*.py is one command's glue, short enough to read at once; what grows past
    that belongs in the part that owns the concern (docs/design.md, "Layout")."""
    long = {p.name: n for p in (PACKAGE / "stages").glob("*.py")
            if (n := len(p.read_text().splitlines())) >= STAGE_LINES}
    assert long == {}


def test_tests_are_grouped_by_part():
    """tests/<part>/ for each part of the package (docs/development.md, "How the tests are
    organised"), plus the loop, the CLI boundary and the project; no test module at the top,
    and no two with one name (pytest imports them by name)."""
    groups = {p.parent.name for p in (ROOT / "tests").rglob("test_*.py")}
    assert groups <= set(LAYERS) - {"base", "stages"} | {"loop", "project"}, groups
    assert not list((ROOT / "tests").glob("test_*.py"))
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names))
