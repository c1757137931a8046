"""A benchmark as evaluation reads it: the rows of a shard with their images checked
(`load_shard`), its rows in marscli's prompt form, what was loaded (for `eval --check` and
`eval`'s first line on stderr), and errors on one line of at most 200 characters
(`stages/eval_check.py`)."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import IO, Any

from marscli.agent.runner import check_images
from marscli.benchmarks import LoadContext, Loaded, load_benchmark
from marscli.errors import BadInput
from marscli.evaluation.paths import image_cache
from marscli.records.schema import Prompt
from marscli.records.shards import in_shard

MAX_ERROR = 200 - len("error: ")  # the CLI prints `error: MESSAGE` on one line
# a path in a message: anything with a slash up to a space, a colon (FILE:LINE) or a quote
_PATH = re.compile(r"[^\s:'\"()\[\],]*/[^\s:'\"()\[\],]+")


def one_line(msg: str, limit: int = MAX_ERROR) -> str:
    """`msg` on one line of at most `limit` characters. Long paths go first (the longest
    becomes `.../NAME`, keeping the file's name), so the row and field after a path stay;
    only then is the tail cut."""
    msg = " ".join(msg.split())
    while len(msg) > limit:
        paths = [m for m in _PATH.finditer(msg) if _short_path(m[0]) != m[0]]
        if not paths:
            break
        m = max(paths, key=lambda m: len(m[0]))
        msg = msg[:m.start()] + _short_path(m[0]) + msg[m.end():]
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def _short_path(path: str) -> str:
    folder, _, name = path.rstrip("/").rpartition("/")
    return ".../" + name if folder and len(path) > len(name) + 4 else path


def normalised(p: Prompt) -> dict:
    """A loaded row in marscli's prompt form, image paths absolute."""
    paths = [str(x.resolve()) for x in p.image_paths()]
    row = {"v": 1, "id": p.id, "question": p.question, "answer": p.answer,
           "choices": p.choices, "category": p.category,
           "image": paths[0] if len(paths) == 1 else paths,
           "benchmark": p.extra.get("benchmark")}
    if p.extra.get("split"):
        row["split"] = p.extra["split"]
    if p.image_search:
        row["image_search"] = p.image_search
    return row


def report(loaded: Loaded) -> dict:
    prompts = [p for _, p in loaded.prompts]
    cats = Counter(p.category or "-" for p in prompts)
    return {"benchmark": loaded.benchmark, "format": loaded.fmt, "split": loaded.split,
            "rows": loaded.rows, "kept": len(prompts), "skipped": dict(loaded.skipped),
            "multiple_choice": sum(bool(p.choices) for p in prompts),
            "categories": dict(sorted(cats.items())), "notes": list(loaded.notes)}


def print_report(rep: dict, err: IO[str]) -> None:
    skipped = ", ".join(f"{v} {k}" for k, v in rep["skipped"].items()) or "none"
    cats = ", ".join(f"{k} {v}" for k, v in rep["categories"].items())
    print(f"check: {rep['benchmark']} ({rep['format']} format, split "
          f"{rep['split'] or '-'}): {rep['rows']} rows, {rep['kept']} kept, skipped: "
          f"{skipped}", file=err)
    print(f"check: {rep['multiple_choice']} multiple-choice; categories: {cats or '-'}",
          file=err)
    for note in rep["notes"]:
        print(f"note: {note}", file=err)


def report_loaded(loaded: Any, n: int, shard: tuple[int, int]) -> None:
    part = f", {n} in shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""
    skipped = "".join(f"; skipped {v} {k}" for k, v in loaded.skipped.items())
    names = sorted({str(p.extra.get("benchmark")) for _, p in loaded.prompts}) or \
        [loaded.benchmark]
    split = f", {loaded.split} split" if loaded.split else ""
    print(f"eval: {', '.join(names)} ({loaded.fmt} format{split}): {loaded.rows} rows{part}"
          f"{skipped}", file=sys.stderr)
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)


def load_shard(bench: str, output: str, fmt: str, image_dir: str | None, benchmark: str | None,
          split: str | None, shard: tuple[int, int]) -> tuple[Any, list]:
    """BENCH's rows of this shard, every image checked, and a line on what was loaded."""
    ctx = LoadContext(source=bench, cache_dir=image_cache(output),
                      image_dir=Path(image_dir) if image_dir else None, benchmark=benchmark,
                      split=split, keep=lambda pid: in_shard(pid, shard))
    loaded = load_benchmark(bench, fmt, ctx)
    rows = [(line, p) for line, p in loaded.prompts if in_shard(p.id, shard)]
    if not rows and not loaded.rows:
        raise BadInput(f"{bench}: no items")
    check_images(bench, rows, loaded.unit, loaded.where)
    report_loaded(loaded, len(rows), shard)
    return loaded, rows
