"""The paper's benchmarks: loaders from their published local files. What each one is, as
scoring needs it (multiple choice, option letters, its own protocol), is `scoring/protocols.py`'s
`BENCHMARKS` table.

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

Each module's docstring lists the columns it reads. Decoded images are written once to a
cache folder beside the results (`eval-images/SHA256.EXT`), shared by the shards of a run.
"""

from __future__ import annotations

import re
from pathlib import Path

from marscli.benchmarks.common import LoadContext, Loaded
from marscli.errors import BadInput, unknown_name
from marscli.registry import Registry

# The release's `data/eval/` folder names (test_all.json) -> benchmark names.
RELEASE_FOLDERS = {
    "mmsearch_end2end_only_image": "mmsearch", "hr_mmsearch": "hr-mmsearch",
    "fvqa_test": "fvqa", "infoseek": "infoseek", "simplevqa_en": "simplevqa",
    "livevqa_research_preview": "livevqa", "mat_search": "mat-search", "vstar_bench": "vstar",
    "hr_bench_4k": "hrbench-4k", "hr_bench_8k": "hrbench-8k", "mme_realworld": "mme-realworld",
}


def guess_name(path: Path) -> str | None:
    """A benchmark name from a file or folder name (`hr_bench_8k.tsv` → hrbench-8k)."""
    stem = path.name if path.is_dir() else path.stem
    generic = ("data", "test", "val", "validation", "train", "qa")
    while (stem in generic or re.fullmatch(r"(train|test|val|validation)(-\d+-of-\d+)?", stem)) \
            and path.parent != path:
        path = path.parent  # a split's file or the `data/` folder: the folder above names it
        stem = path.name
    if stem in RELEASE_FOLDERS:
        return RELEASE_FOLDERS[stem]
    key = re.sub(r"[^a-z0-9]", "", stem.lower())
    for needle, name in (("hrmmsearch", "hr-mmsearch"), ("mmsearch", "mmsearch"),
                         ("hrbench8k", "hrbench-8k"), ("hrbench4k", "hrbench-4k"),
                         ("hrbench", "hrbench"), ("mmerealworld", "mme-realworld"),
                         ("vstar", "vstar"), ("infoseek", "infoseek"), ("fvqa", "fvqa"),
                         ("simplevqa", "simplevqa"), ("livevqa", "livevqa"),
                         ("matsearch", "mat-search")):
        if needle in key:
            return name
    return None


# One signature: load(path: Path, ctx: LoadContext, fmt: str) -> Loaded.
FORMATS: Registry = Registry("--format", lazy={
    "mars": "marscli.benchmarks.mars",
    **dict.fromkeys(("mmsearch", "hr-mmsearch", "fvqa", "simplevqa", "livevqa", "mat-search"),
                    "marscli.benchmarks.flat"),
    "vstar": "marscli.benchmarks.vstar", "infoseek": "marscli.benchmarks.infoseek",
    "hrbench": "marscli.benchmarks.lettered", "mme-realworld": "marscli.benchmarks.lettered",
})

# A folder's own file names that say what it holds (the published layouts).
_FOLDER_FILES = (("data.jsonl", "mars"), ("MAT-Search.json", "mat-search"),
                 ("qa.json", "livevqa"), ("test_questions.jsonl", "vstar"))
# The same names given as the file itself, minus `data.jsonl`: too common a name to say
# more than the file's columns do (the release's MARS rows are found by their `prompt`).
_PUBLISHED_FILES = {name: fmt for name, fmt in _FOLDER_FILES if name != "data.jsonl"}
# Columns only MMSearch's end2end file has: LiveVQA's rows share its `query` + `gt_answer`.
_MMSEARCH_OWN = {"sample_id", "alternative_gt_answers", "area", "subfield"}


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
        fmt = {"hrbench-4k": "hrbench", "hrbench-8k": "hrbench"}.get(name or "", name)
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
    """A format from the columns alone, where they are unambiguous (the published layouts:
    docs/evaluation.md)."""
    if suffix in (".jsonl", ".json") and ("prompt" in cols or "v" in cols):
        return "mars"  # MARS / verl rows, marscli's own rows
    rules = (
        ("mme-realworld", {"multi-choice options"}),
        ("hrbench", {"cycle_category"}),
        ("hr-mmsearch", {"query", "ground_truth"}),
        ("vstar", {"text", "label"}),
    )
    for fmt, need in rules:
        if need <= cols:
            return fmt
    if {"query", "gt_answer"} <= cols and (cols & _MMSEARCH_OWN or "query_image" not in cols):
        return "mmsearch"
    if "image_id" in cols and cols & {"answer_eval", "data_split"}:
        return "infoseek"
    if cols & {"atomic_fact", "atomic_question", "vqa_category"}:
        return "simplevqa"
    if "query_image" in cols and "prompt" not in cols:
        return "livevqa"
    if suffix in (".tsv", ".csv") and "E" in cols:
        return "mme-realworld"
    return None


__all__ = [
    "FORMATS",
    "LoadContext",
    "Loaded",
    "detect_format",
    "format_names",
    "guess_name",
    "load_benchmark",
]
