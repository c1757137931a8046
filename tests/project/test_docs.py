"""The documentation runs (issue 31): README.md and docs/*.md are read as a user reads them.

- Every fenced ```bash block runs, with exit 0, unless the line right before its fence is a
  marker that says why it does not: `<!-- not run: REASON -->` (it needs GPUs, a cluster, the
  network, or takes minutes: `make demo` and `make test` are CI's own steps). A page is one
  session: its runnable blocks run in order, each in its own `bash -euo pipefail`, in one
  scratch folder that looks like the repository root (a link to every top-level entry, no
  `runs/`), with `marscli` and `python` on PATH as the venv gives them.
- Shell blocks are fenced as `bash` (an `sh` or `console` fence would escape the check).
- Links between the pages, and the `docs/X.md "Section"` citations in the code, point at files
  and headings that exist.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/notes/ too
MARKER = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SHELLS = {"sh", "shell", "console", "zsh", "shell-session"}


def blocks(page: Path) -> list[dict]:
    """Every fenced block of a page: language, first line (1-based), text, and the reason of
    its `not run` marker (None: it runs)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        before = next((x.strip() for x in reversed(lines[:start]) if x.strip()), "")
        marker = MARKER.match(before)
        out.append({"lang": lang, "line": start + 1, "text": "\n".join(body) + "\n",
                    "reason": marker.group(1) if marker else None,
                    "marked": bool(marker) or before.startswith("<!-- not run")})
        i += 1
    return out


def bash_blocks(page: Path) -> list[dict]:
    return [b for b in blocks(page) if b["lang"] == "bash"]


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ----------------------------------------------------------------------------- the markers


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    assert {"README.md", "design.md", "rl-loop.md", "gpu.md", "evaluation.md", "demo.md",
            "development.md"} <= names, names


def test_the_readme_is_the_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    # CI reads the test command from the README; the demo's command stands beside it.
    two = next(b for b in bash_blocks(ROOT / "README.md") if "make test" in b["text"])
    assert [x.split("#")[0].strip() for x in two["text"].splitlines()] == ["make demo",
                                                                           "make test"]


def test_every_marked_block_says_why():
    bad = []
    for page in PAGES:
        for b in blocks(page):
            if b["marked"] and (b["reason"] is None or len(b["reason"].split()) < 3):
                bad.append(f"{rel(page)}:{b['line']}: a `not run` marker needs a reason "
                           "of a few words: <!-- not run: needs GPUs ... -->")
            if b["marked"] and b["lang"] != "bash":
                bad.append(f"{rel(page)}:{b['line']}: a `not run` marker before a "
                           f"```{b['lang'] or '(plain)'} block, which never runs anyway")
    assert bad == []


def test_shell_blocks_are_fenced_as_bash():
    bad = [f"{rel(p)}:{b['line']}: ```{b['lang']}: fence shell commands as ```bash"
           for p in PAGES for b in blocks(p) if b["lang"] in SHELLS]
    assert bad == []


# ----------------------------------------------------------------------------- the blocks run


def scratch(tmp: Path) -> tuple[Path, dict]:
    """A folder that looks like the repository root (links to its top-level entries and to
    the venv, a fresh runs/), and an environment whose PATH starts with `marscli` and
    `python` as the venv's. The venv is linked, not left out: a block running `make` would
    otherwise build a new one there (5 GB and minutes each time)."""
    work = tmp / "repo"
    work.mkdir()
    for entry in ROOT.iterdir():
        if (entry.name == ".venv" or not entry.name.startswith(".")) and entry.name != "runs":
            (work / entry.name).symlink_to(entry)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shims = {"marscli": f'exec "{sys.executable}" -m marscli "$@"',
             "python": f'exec "{sys.executable}" "$@"', "python3": f'exec "{sys.executable}" "$@"'}
    for name, line in shims.items():
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{line}\n")
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV.get('PATH', '')}",
           "MARSCLI_CACHE_DIR": str(tmp / "cache"),
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT / "src"), ENV.get("PYTHONPATH"))
                                         if x)}
    return work, env


RUNNABLE = [p for p in PAGES if any(not b["marked"] for b in bash_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_every_unmarked_bash_block_runs(page, tmp_path):
    runnable = [b for b in bash_blocks(page) if not b["marked"]]
    if any("jq " in b["text"] for b in runnable) and not _which("jq"):
        pytest.skip("jq is not installed: the pages use it to look at JSONL")
    work, env = scratch(tmp_path)
    for b in runnable:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", b["text"]], cwd=work, env=env,
                             capture_output=True, text=True, timeout=900, check=False)
        assert res.returncode == 0, (
            f"{rel(page)}:{b['line']}: the block exited {res.returncode}\n{b['text']}\n"
            f"--- stderr (end) ---\n{res.stderr[-4000:]}\n--- stdout (end) ---\n"
            f"{res.stdout[-2000:]}")


def _which(name: str) -> bool:
    return any(os.access(Path(d) / name, os.X_OK)
               for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def test_the_harness_sees_markers_and_failures(tmp_path):
    """The parser and the runner themselves: a marker is tied to the block right after it,
    and a failing line inside a block fails the block."""
    page = tmp_path / "p.md"
    page.write_text("# t\n\n<!-- not run: needs GPUs, eight of them -->\n```bash\nfalse\n```\n\n"
                    "```bash\necho ok\n```\n\n<!-- not run: -->\n```bash\ntrue\n```\n"
                    "```json\n{}\n```\n")
    got = [(b["lang"], b["line"], b["reason"], b["marked"]) for b in blocks(page)]
    assert got == [("bash", 4, "needs GPUs, eight of them", True), ("bash", 8, None, False),
                   ("bash", 13, "", True), ("json", 16, None, False)]
    work, env = scratch(tmp_path)
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", "false | cat\necho after\n"],
                         cwd=work, env=env, capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "after" not in res.stdout
    res = subprocess.run(["bash", "-c", "marscli --help >/dev/null && ls runs 2>&1 || true; "
                          "test -f Makefile && test -d recipes/tiny-vlm"],
                         cwd=work, env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\]\([^)]*\)|[\[\]]", "", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(page: Path) -> list[str]:
    inside, out = False, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside and line.startswith("#"):
            out.append(line.lstrip("#").strip())
    return out


def test_links_between_pages_resolve():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{rel(page)}: ({target}): no such file")
            elif anchor and dest.suffix == ".md" and anchor not in map(slug, headings(dest)):
                bad.append(f"{rel(page)}: ({target}): no heading with that anchor")
    assert bad == []


CITED = re.compile(r"(docs/[\w./-]+\.md)(?:,?\s+\"([^\"]+)\")?")
CODE = [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*"),
        *(ROOT / "tests").rglob("*.py"), *(ROOT / "stages").glob("*.sh"),
        *(ROOT / "recipes").glob("*.mk"), *(ROOT / "bench").glob("*.py"), ROOT / "Makefile"]


def test_docs_cited_in_the_code_exist():
    """`docs/X.md` named in the code is a file, and `docs/X.md "Section"` a heading in it; the
    repository has no DESIGN.md or FINDINGS.md for the code to cite."""
    bad, cited = [], 0
    for src in CODE:
        if not src.is_file() or src.name == "test_docs.py":
            continue
        text = src.read_text(encoding="utf-8", errors="replace")
        for m in CITED.finditer(text):
            cited += 1
            line = text.count("\n", 0, m.start()) + 1
            page = ROOT / m.group(1)
            if not page.is_file():
                bad.append(f"{src.relative_to(ROOT)}:{line}: {m.group(1)}: no such page")
            elif m.group(2) and " ".join(m.group(2).split()) not in headings(page):
                bad.append(f"{src.relative_to(ROOT)}:{line}: {m.group(1)} has no heading "
                           f"{m.group(2)!r}")
        for m in re.finditer(r"\b(DESIGN|FINDINGS)(\.md)?\b", text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{src.relative_to(ROOT)}:{line}: cites {m.group(0)}, which is not in "
                       "the repository: cite docs/design.md or the docs/ page that holds it")
    assert bad == []
    assert cited >= 6
