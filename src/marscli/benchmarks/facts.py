"""What a benchmark is, declared by the loader module that reads it (nanochat's `tasks/`: each
module describes itself), and the tables built from those declarations.

A loader module declares, at import:
- a `Layout` per `--format` it reads: its loader, the published file names that say a folder
  (or file) holds it, and column rules for `--format auto`;
- a `Benchmark` per benchmark name it yields: its title, the `--format` that reads it, the
  release's folder name and the word in a file name that names it, whether it is multiple
  choice and with which letters, its own (`official`) protocol, what its categories are, and
  the paper's numbers (`Paper`).

`benchmarks/__init__.py` imports every module of the package, so every declaration is made
before any table here is read (a module of the package cannot be imported without its
`__init__` running first). Nothing here imports a loader: loaders that read any benchmark
(`mars.py`, `lettered.py`) ask `guess_name` and `benchmark_info` here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Pair = tuple[float | None, float | None]  # (8B, 32B), percent as published; None: unreported


@dataclass(frozen=True)
class Paper:
    """A benchmark's numbers in the SenseNova-MARS paper's main tables (`paper.py` says where
    they come from): the two MARS models (agentic) and the Qwen3-VL-Instruct baselines."""

    items: int | None = None  # items in the paper's evaluation (the release's test_all.json)
    mars: Pair = (None, None)  # SenseNova-MARS-8B / -32B, agentic
    direct: Pair = (None, None)  # Qwen3-VL-8B / -32B-Instruct, direct answer
    agent: Pair = (None, None)  # Qwen3-VL-8B / -32B-Instruct, agentic (zero-shot)


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    multiple_choice: bool = False
    letters: str = "ABCD"  # the option letters the release's extractor knows
    official: str = "mars"  # the benchmark's own protocol: mars | token_f1 | rotations | infoseek
    fmt: str | None = None  # the --format that reads it (None: its name)
    release_folder: str | None = None  # its folder in the release's `data/eval/`
    needle: str | None = None  # a file or folder name holding this (lower case, a-z0-9) names it
    categories: str = ""  # what its rows' `category` holds (the summary's per-category lines)
    paper: Paper = field(default_factory=Paper)

    @property
    def layout(self) -> str:
        return self.fmt or self.name


# (rank, test(columns, suffix)): `--format auto` tries every layout's rules, lowest rank first
ColumnRule = tuple[int, Callable[[set[str], str], bool]]


@dataclass(frozen=True)
class Layout:
    fmt: str  # the --format name
    load: Callable[..., Any]  # load(path: Path, ctx: LoadContext, fmt: str) -> Loaded
    files: tuple[str, ...] = ()  # published file names: a folder holding one, or that file, is it
    folder_files: tuple[str, ...] = ()  # the same, said by a folder only (too common a file name)
    columns: tuple[ColumnRule, ...] = ()


BENCHMARKS: dict[str, Benchmark] = {}
LAYOUTS: dict[str, Layout] = {}


def declare(*facts: Benchmark | Layout) -> None:
    """Add a loader module's layouts and benchmarks to the tables; a name twice is refused."""
    for f in facts:
        table: dict[str, Any] = LAYOUTS if isinstance(f, Layout) else BENCHMARKS
        name = f.fmt if isinstance(f, Layout) else f.name
        if name in table:
            raise ValueError(f"{type(f).__name__.lower()} {name!r} declared twice")
        table[name] = f


def benchmark_info(name: str | None) -> Benchmark:
    """What is known of a benchmark; an unknown name is an open-question benchmark (multiple
    choice where its rows have `choices`, with letters up to E)."""
    return BENCHMARKS.get(name or "") or Benchmark(name or "unknown", name or "unknown",
                                                   letters="ABCDE")


_GENERIC = ("data", "test", "val", "validation", "train", "qa")


def guess_name(path: Path) -> str | None:
    """A benchmark name from a file or folder name (`hr_bench_8k.tsv` → hrbench-8k): the
    release's folder name, else the longest benchmark word the name contains."""
    stem = path.name if path.is_dir() else path.stem
    while (stem in _GENERIC or re.fullmatch(r"(train|test|val|validation)(-\d+-of-\d+)?", stem)) \
            and path.parent != path:
        path = path.parent  # a split's file or the `data/` folder: the folder above names it
        stem = path.name
    for b in BENCHMARKS.values():
        if stem == b.release_folder:
            return b.name
    key = re.sub(r"[^a-z0-9]", "", stem.lower())
    # longest first: `hrmmsearch` before `mmsearch`, `hrbench8k` before `hrbench`
    for b in sorted((b for b in BENCHMARKS.values() if b.needle), key=lambda b: -len(b.needle)):
        if b.needle in key:
            return b.name
    return None
