"""The paper's benchmarks: loaders from their published local files, and the registry built
from what each loader module declares of itself (`facts.py`).

No hub downloads: the user points `marscli eval BENCH` at files they have, in the layout the
benchmark publishes (docs/evaluation.md, "Where each layout comes from"). Every loader turns
its layout into marscli prompt rows (`records.Prompt`) with `benchmark` (in the row's extra
fields, so trajectories carry it), a `category`, and `choices` for multiple choice (the gold
answer is then the option letter). Any layout may come in any container (`containers.py`:
JSONL, a JSON array, parquet, TSV, a folder of them; one split of a folder, never mixed).
Formats (`--format`, `auto` detects):

| format | module |
|---|---|
| mars: the release's `data/eval/NAME/` folders, any marscli/MARS prompt rows | `mars.py` |
| mmsearch, hr-mmsearch, fvqa, simplevqa, livevqa, mat-search: one open question per row | \
`flat.py` |
| vstar: options in the question text | `vstar.py` |
| infoseek: InfoSeek rows + OVEN images | `infoseek.py` |
| hrbench, mme-realworld: lettered option columns or `multi-choice options` | `lettered.py` |

Each module's docstring lists the columns it reads; its `declare(...)` says the rest (names,
file names, column rules, protocol, letters, categories, the paper's numbers). Adding a
benchmark is its module here plus its test: this package imports every module in it, and
`FORMATS`, name guessing, scoring's `BENCHMARKS` table, the paper's numbers and `eval
--format`'s help are built from the declarations. Decoded images are written once to a cache
folder beside the results (`eval-images/SHA256.EXT`), shared by the shards of a run.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from marscli.benchmarks.common import LoadContext, Loaded
from marscli.benchmarks.facts import BENCHMARKS, LAYOUTS, Benchmark, benchmark_info, guess_name
from marscli.errors import BadInput, unknown_name
from marscli.registry import Registry

for _module in pkgutil.iter_modules(__path__):  # every loader module declares itself on import
    importlib.import_module(f"{__name__}.{_module.name}")

# One signature: load(path: Path, ctx: LoadContext, fmt: str) -> Loaded.
FORMATS: Registry = Registry("--format")
for _layout in LAYOUTS.values():
    FORMATS.register(_layout.fmt)(_layout.load)

# A folder's own file names that say what it holds (the published layouts); the names that
# say it as the file itself too (`data.jsonl` does not: too common a name to say more than
# the file's columns do; the release's MARS rows are found by their `prompt`).
_FOLDER_FILES = [(name, lay.fmt) for lay in LAYOUTS.values() for name in lay.folder_files] + \
                [(name, lay.fmt) for lay in LAYOUTS.values() for name in lay.files]
_PUBLISHED_FILES = {name: lay.fmt for lay in LAYOUTS.values() for name in lay.files}
# Every layout's column rules, in the order `by_columns` tries them.
_COLUMN_RULES = sorted(((rank, lay.fmt, test) for lay in LAYOUTS.values()
                        for rank, test in lay.columns), key=lambda r: r[0])


def format_names() -> list[str]:
    return ["auto", *FORMATS.names()]


def load_benchmark(bench: str, fmt: str, ctx: LoadContext) -> Loaded:
    """Load BENCH in format `fmt` (`auto`: detect); raises BadInput naming the file, line and
    field of the first problem, or the valid format names."""
    if fmt != "auto" and fmt not in FORMATS:
        raise unknown_name("--format", fmt, format_names())
    path = Path(bench)
    if not path.exists():
        raise BadInput(f"{bench}: no such file or folder")
    if ctx.split is not None and not path.is_dir():  # else it would be silently ignored
        raise BadInput(f"--split {ctx.split}: {bench} is one file — --split chooses among the "
                       "files of a benchmark folder; drop --split or point at the folder")
    if fmt == "auto":
        fmt = detect_format(path, ctx.split)
    return FORMATS.get(fmt)(path, ctx, fmt)


def _hint() -> str:
    return f"pass --format (one of: {', '.join(format_names()[1:])})"


def detect_format(path: Path, split: str | None = None) -> str:
    """Guess a format from a folder's file names, then the first data file's columns (parquet
    schema, TSV header, first JSON row), then the file or folder name."""
    from marscli.benchmarks.containers import columns_of, data_files

    if path.is_dir():
        for name, fmt in _FOLDER_FILES:
            if (path / name).is_file():
                return fmt
    elif path.name in _PUBLISHED_FILES:  # before the columns: LiveVQA's look like MMSearch's
        return _PUBLISHED_FILES[path.name]
    elif path.suffix.lower() not in (".parquet", ".tsv", ".csv", ".jsonl", ".json"):
        raise BadInput(f"{path}: unknown file type {path.suffix or '(none)'} — expected a "
                       f"folder, .parquet, .tsv, .jsonl or .json; or {_hint()}")
    files, _ = data_files(path, split)
    cols = columns_of(files[0])
    fmt = by_columns(set(cols), files[0].suffix.lower())
    if fmt is None:
        name = guess_name(files[0]) or guess_name(path)
        fmt = BENCHMARKS[name].layout if name else None
    if fmt is None and files[0].suffix.lower() in (".jsonl", ".json") and (
            "question" in cols and "image" in cols):
        fmt = "mars"  # marscli's own prompt rows
    if fmt is None:
        shown = ", ".join(sorted(cols)[:20])
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        raise BadInput(f"{files[0]}: cannot tell which benchmark this file holds (columns: "
                       f"{shown}) — {_hint()}")
    return fmt


def by_columns(cols: set[str], suffix: str) -> str | None:
    """A format from the columns alone, where they are unambiguous (each layout's column
    rules, lowest rank first: docs/evaluation.md has the published layouts)."""
    for _rank, fmt, test in _COLUMN_RULES:
        if test(cols, suffix):
            return fmt
    return None


__all__ = [
    "BENCHMARKS",
    "FORMATS",
    "Benchmark",
    "LoadContext",
    "Loaded",
    "benchmark_info",
    "detect_format",
    "format_names",
    "guess_name",
    "load_benchmark",
]
