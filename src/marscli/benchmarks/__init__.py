"""The paper's benchmarks: loaders from their published local files. What each one is, as
scoring needs it (multiple choice, option letters, its own protocol), is `scoring/protocols.py`'s
`BENCHMARKS` table.

No hub downloads: the user points `marscli eval BENCH` at files they have. Every loader turns
its format into marscli prompt rows (`records.Prompt`) with `benchmark` (in the row's extra
fields, so trajectories carry it), a `category`, and `choices` for multiple choice (the gold
answer is then the option letter). Formats (`--format`, `auto` detects):

| format | files | module |
|---|---|---|
| mars | the release's `data/eval/NAME/` folders (`data.jsonl` + images; MARS rows with \
precomputed image-search results), or any marscli/MARS prompt JSONL | `mars.py` |
| mmsearch, hr-mmsearch, fvqa | parquet (HF `datasets` layout: image columns as \
`{bytes, path}` structs, raw bytes or paths) | `parquet.py` |
| simplevqa, livevqa | parquet or JSONL with the generic column names (unverified layouts) \
| `parquet.py`, `jsonl.py` |
| vstar, infoseek | JSONL + an image folder | `jsonl.py` |
| hrbench, mme-realworld | VLMEvalKit TSV with base64 images | `tsv.py` |

Each module's docstring lists the columns it assumes. Decoded images are written once to a
cache folder beside the results (`eval-images/SHA256.EXT`), shared by the shards of a run.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson

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
    if stem in ("data", "test", "val", "train") or stem.startswith("train-"):
        stem = path.parent.name if not path.is_dir() else stem
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
    "mmsearch": "marscli.benchmarks.parquet", "hr-mmsearch": "marscli.benchmarks.parquet",
    "fvqa": "marscli.benchmarks.parquet",
    "simplevqa": "marscli.benchmarks.jsonl", "livevqa": "marscli.benchmarks.jsonl",
    "vstar": "marscli.benchmarks.jsonl", "infoseek": "marscli.benchmarks.jsonl",
    "hrbench": "marscli.benchmarks.tsv", "mme-realworld": "marscli.benchmarks.tsv",
})


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
    if fmt == "auto":
        fmt = detect_format(path)
    return FORMATS.get(fmt)(path, ctx, fmt)


def _hint() -> str:
    return f"pass --format (one of: {', '.join(format_names()[1:])})"


def detect_format(path: Path) -> str:
    """Guess a format from the file's extension, header, columns or first row."""
    if path.is_dir():
        if (path / "data.jsonl").is_file():
            return "mars"
        for pattern in ("*.parquet", "data/*.parquet", "*.tsv", "*.jsonl"):
            files = sorted(path.glob(pattern))
            if files:
                return _detect_file(files[0], folder=path)
        raise BadInput(f"{path}: no data.jsonl, parquet, TSV or JSONL file in this folder — "
                       f"point at the benchmark's file, or {_hint()}")
    return _detect_file(path)


def _detect_file(path: Path, folder: Path | None = None) -> str:
    where = folder or path
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        from marscli.benchmarks.parquet import parquet_columns

        cols = set(parquet_columns(path))
        if {"query", "gt_answer"} <= cols:
            return "mmsearch"
        if {"query", "ground_truth"} <= cols:
            return "hr-mmsearch"
        name = guess_name(where)
        if name in ("fvqa", "simplevqa", "livevqa", "mmsearch", "hr-mmsearch"):
            return name
        raise BadInput(f"{path}: cannot tell which benchmark this parquet holds (columns: "
                       f"{', '.join(sorted(cols))}) — {_hint()}")
    if suffix in (".tsv", ".csv"):
        with path.open(encoding="utf-8", errors="replace") as fh:
            header = fh.readline(1 << 16).rstrip("\r\n").split("\t")
        if "cycle_category" in header or guess_name(where) in ("hrbench", "hrbench-4k",
                                                               "hrbench-8k"):
            return "hrbench"
        if "E" in header or guess_name(where) == "mme-realworld":
            return "mme-realworld"
        raise BadInput(f"{path}: cannot tell which benchmark this TSV holds (columns: "
                       f"{', '.join(header[:20])}) — {_hint()}")
    if suffix in (".jsonl", ".json"):
        row = _first_row(path)
        if "prompt" in row or ("question" in row and "image" in row and "label" not in row
                               and "image_id" not in row):
            return "mars"
        if "image_id" in row and ("answer_eval" in row or "data_split" in row):
            return "infoseek"
        if "label" in row and "image" in row:
            return "vstar"
        name = guess_name(where)
        if name in ("simplevqa", "livevqa", "vstar", "infoseek"):
            return name
        raise BadInput(f"{path}:1: cannot tell which benchmark these rows are (fields: "
                       f"{', '.join(sorted(row)[:20])}) — {_hint()}")
    raise BadInput(f"{path}: unknown file type {path.suffix or '(none)'} — expected a folder "
                   f"with data.jsonl, .parquet, .tsv or .jsonl; or {_hint()}")


def _first_row(path: Path) -> dict:
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            if raw.strip():
                try:
                    row = orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    raise BadInput(f"{path}:{n}: not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise BadInput(f"{path}:{n}: expected a JSON object")
                return row
    raise BadInput(f"{path}: empty file — expected at least one row")


__all__ = [
    "FORMATS",
    "LoadContext",
    "Loaded",
    "detect_format",
    "format_names",
    "guess_name",
    "load_benchmark",
]
